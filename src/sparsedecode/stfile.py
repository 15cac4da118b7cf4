"""Safetensors files with a JSON header: thresholds (`projection.thresholds`) and routing
tables (`projection.routing`) share how they are written (atomically) and read (anything
that is not ours is an InputError naming the command that makes one)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from sparsedecode.errors import InputError


def save_with_header(path: str | os.PathLike, tensors: dict, fmt: str, header: dict) -> Path:
    """Write `tensors` and {'format': fmt, 'header': json(header)} to a temp name, then rename:
    an interrupted save never leaves a half-written file at `path`."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file({k: t.contiguous() for k, t in tensors.items()}, str(tmp),
                  metadata={"format": fmt, "header": json.dumps(header)})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_with_header(path: str | os.PathLike, fmt: str, what: str, make: str,
                     keys: set[str] | None = None) -> tuple[dict, dict]:
    """(tensors, header) of a file `save_with_header` wrote with format `fmt`. A missing,
    corrupt or foreign file (or one without exactly `keys`, when given) raises InputError
    saying it is not a `what` and that `make` makes one."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise InputError(f"no {what} at {path}; make one with `{make}`")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except Exception as e:  # a corrupt or foreign file: same fix
        raise InputError(f"{path} is not a safetensors {what} ({type(e).__name__}); make one with "
                         f"`{make}`") from None
    if meta.get("format") != fmt or "header" not in meta or (keys is not None and set(tensors) != keys):
        raise InputError(f"{path} is not a sparsedecode {what} (format {meta.get('format')!r}); "
                         f"make one with `{make}`")
    try:
        header = json.loads(meta["header"])
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: the {what}'s header is not JSON ({e.msg}); make one with `{make}`") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: the {what}'s header is not a JSON object; make one with `{make}`")
    return tensors, header


def fit_header(header: dict, fields: tuple[str, ...], required: tuple[str, ...], path, what: str) -> dict:
    """The header restricted to `fields`: a missing required field is an InputError; fields a
    newer writer added are dropped with a warning that names them."""
    import warnings

    missing = [f for f in required if f not in header]
    if missing:
        raise InputError(f"{path}: the {what}'s header lacks {', '.join(missing)}; it was not written by "
                         "this version of sparsedecode: make it again")
    extra = sorted(set(header) - set(fields))
    if extra:
        warnings.warn(f"{path}: the {what}'s header has fields this version does not know "
                      f"({', '.join(extra)}); they are ignored (a newer sparsedecode wrote it)", stacklevel=3)
    return {k: v for k, v in header.items() if k in fields}
