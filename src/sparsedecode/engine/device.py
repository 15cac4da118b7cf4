"""Device and dtype choice, and a probe that the device can actually run the dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparsedecode.errors import InputError, option

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def resolve_device(device=None) -> torch.device:
    """`device` as a torch.device; None or 'auto' picks CUDA when present."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InputError(f"unknown device '{device}': use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"device '{device}' is not available: this torch sees no CUDA GPU; use {option('device', 'cpu')}")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InputError(
                f"device '{device}' does not exist: {torch.cuda.device_count()} CUDA device(s) visible"
            )
    elif dev.type != "cpu":
        raise InputError(f"device type '{dev.type}' is not supported; use cpu or cuda")
    return dev


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    """`dtype` (name or torch.dtype) or the default: float32 on CPU, bfloat16 (float16 if
    the GPU lacks bf16) on CUDA."""
    if dtype is None or dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise InputError(f"unknown dtype '{dtype}': use float32, bfloat16 or float16") from None


def check_dtype(device: torch.device, dtype: torch.dtype) -> None:
    """Raise an InputError if a matmul and SDPA in `dtype` fail on `device`."""
    name = str(dtype).removeprefix("torch.")
    fix = f"use {option('dtype', 'float32' if device.type == 'cpu' else 'float16')}"
    if not dtype.is_floating_point:
        raise InputError(f"dtype {name} is not a floating-point type; use float32, bfloat16 or float16")
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(False):
        cap = torch.cuda.get_device_capability(device)
        raise InputError(
            f"this GPU (compute capability {cap[0]}.{cap[1]}) cannot run bfloat16 natively "
            f"(needs 8.0 or newer); {fix}"
        )
    try:
        a = torch.ones(4, 8, device=device, dtype=dtype)
        _ = F.linear(a, a)
        q = a.view(1, 1, 4, 8)
        _ = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    except (RuntimeError, NotImplementedError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"{device.type} cannot run dtype {name} here ({first}); {fix}") from None


def use_compile_cache() -> str:
    """Keep torch.compile's caches (FX graphs, generated kernels, autotuning) under the
    sparsedecode cache, so that a later process on this machine (`serve` starting again,
    another `generate`) skips most of the compile. A TORCHINDUCTOR_CACHE_DIR the user set wins.
    Returns the directory."""
    import os

    from sparsedecode.cache import cache_dir

    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def dict_tag_guards_off() -> None:
    """Turn off dynamo's recursive dict-tag guard fast path where this torch has it on (2.10,
    2.11): with a few compiled steps of one code object kept (the runtime gate keeps one per
    configuration) it aborts the process, "Could not register a callback for recursive dict
    tag optimization" (measured on the H200, torch 2.11; pytorch#178224, off by default
    upstream since #181873). Set once for the process, as upstream now ships it: patching it
    around each call of the step cost 40 us a step on the uncaptured (sdpa_fused) path."""
    cfg = torch._dynamo.config
    if getattr(cfg, "use_recursive_dict_tags_for_guards", False):
        cfg.use_recursive_dict_tags_for_guards = False


__all__ = ["DTYPES", "check_dtype", "dict_tag_guards_off", "resolve_device", "resolve_dtype",
           "use_compile_cache"]
