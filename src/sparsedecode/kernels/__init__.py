"""Kernels, one file each: Triton kernel + launcher + `*_ref` in plain PyTorch."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType

from sparsedecode.errors import InputError


def override(module: ModuleType, **values) -> dict:
    """Set the module-level knobs given a value (None: left as is); return every named knob's
    effective value, for the record.

    Benchmarks pass their flags through it, so a flag left out keeps the module's default
    instead of resetting it (`proj_decode_h200.py` once reset `decode_attention.MIN_SPLIT_KEYS`
    to None that way, and its step records ran without the new default). A name the module
    does not have is refused, so a misspelt knob cannot be set silently.
    """
    missing = [name for name in values if not hasattr(module, name)]
    if missing:
        raise InputError(f"{module.__name__} has no knob {', '.join(missing)}")
    for name, value in values.items():
        if value is not None:
            setattr(module, name, value)
    return {name: getattr(module, name) for name in values}


@contextlib.contextmanager
def knobs(module: ModuleType, **values) -> Iterator[dict]:
    """`override` for the length of a with block: the knobs given a value are set (names checked
    the same way) and every named knob is restored on exit, error or not. Yields the effective
    values. For timing a variant (an ablation, a config) without leaving it set for what follows."""
    saved = {name: getattr(module, name) for name in values if hasattr(module, name)}
    try:
        yield override(module, **values)
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
