"""Input-sparse GEMV on CPU that skips the bytes of dropped channels (ByteCross §3.2, §4.1; TEAL's
decode kernel; issue 46 item 1).

`sparse_gemv_cpu(x, w_t, threshold, bias)` (TEAL's input sites, and CATS's down) computes what `kernels.sparse_gemv.sparse_gemv_ref`
computes, sum over kept i of x_i * w_t[i, :] (+ bias) with |x_i| > threshold in float32, but reads
only the rows of kept channels of the (in, out) weight: at keep 0.5 the projection reads half its
bytes; `sparse_gemv_lora_cpu` adds a LoRA adapter's s * B (A x_m) in the same call, reading A only in
the kept rows too (kernels/lora_gemv.py). `cats_up_cpu` is CATS's up on CPU: only the rows of the up weight whose SiLU(gate) channel
is kept (`kernels.gather_gemv.cats_up` on CUDA). The kernel is `cpu_gemv.c`, built at first use with the host's C compiler (`$CC`, else `cc`
or `gcc`; `-O3 -march=native -fopenmp`) into the sparsedecode cache, keyed by the source, the flags,
the compiler and the machine, and loaded with ctypes beside the OpenMP runtime torch has loaded
(one thread pool; it runs `torch.get_num_threads()` threads). Weights: float32, bfloat16, float16.

Without a compiler the kernel cannot be built: `cpu_kernel()` says why, and the projection branch
falls back to the masked reference, which the engine reports (`cpu_projection`) and says once on
stderr. Decision log: docs/kernels/cpu_gemv.md.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from sparsedecode.cache import cache_dir
from sparsedecode.errors import InputError
from sparsedecode.kernels.common import check_factors, keep_mask

SOURCE = Path(__file__).with_name("cpu_gemv.c")
# built into one library: the GEMVs, and the whole decode step that calls them (kernels.cpu_step)
SOURCES = (SOURCE, Path(__file__).with_name("cpu_step.c"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
_P, _L = ctypes.c_void_p, ctypes.c_long
SIGNATURES = {"sd_gemv_rows": (_P, _P, _P, _P, _L, _L, _L, ctypes.c_float, ctypes.c_int),
              "sd_gemv_lora": (_P, _P, _P, _P, _L, _L, _L, ctypes.c_float, _P, _P, _L, ctypes.c_float, ctypes.c_int),
              "sd_gemv_segs": (_P, _P, _P, _P, _L, _L, _L, _L, _P, _P, _P, ctypes.c_int),
              "sd_gather_rows": (_P, _P, _P, _P, _P, _L, _L, _L, ctypes.c_float, ctypes.c_int),
              "sd_gemv_union": (_P, _P, _P, _P, _L, _L, _L, _L, ctypes.c_float, _P, ctypes.c_int),
              "sd_step": (_P, _P, _L, _L, _P, _P, ctypes.c_int)}


@dataclass(frozen=True)
class CpuKernel:
    """The built library (`lib`, None when it could not be built) and, then, why (`reason`)."""

    lib: ctypes.CDLL | None
    path: Path | None
    reason: str = ""
    # (name, dtype) -> the C function, typed once at load: one dict lookup per decode call
    fns: dict = field(default_factory=dict, repr=False, compare=False)

    def supports(self, dtype: torch.dtype) -> bool:
        return self.entry("sd_gemv_rows", dtype) is not None

    def entry(self, name: str, dtype: torch.dtype):
        """The C function `name` for weights of `dtype`, or None."""
        return self.fns.get((name, dtype))


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or (cc if Path(cc).is_file() else None)
    return shutil.which("cc") or shutil.which("gcc")


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join([*(f.read_text() for f in SOURCES), *FLAGS, version, platform.machine(),
                                    platform.node() if "-march=native" in FLAGS else ""]).encode()).hexdigest()[:16]
    out = cache_dir() / "kernels" / f"cpu_gemv-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=out.parent) as tmp:
        part = Path(tmp) / out.name
        r = subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", str(part), "-lm"], capture_output=True, text=True,
                           timeout=300)
        if r.returncode != 0:
            raise OSError(f"{cc} failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
        os.replace(part, out)
    return out


@functools.cache
def cpu_kernel() -> CpuKernel:
    """The CPU kernel, built and loaded once per process (or why not)."""
    cc = _compiler()
    if cc is None:
        return CpuKernel(None, None, "no C compiler found ($CC, cc or gcc)")
    try:
        path = _build(cc)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        return CpuKernel(None, None, f"building {' and '.join(f.name for f in SOURCES)} failed: {e}")
    fns = {}
    for name, args in SIGNATURES.items():
        for dtype, suffix in SUFFIX.items():
            fn = getattr(lib, f"{name}_{suffix}", None)
            if fn is not None:
                fn.argtypes, fn.restype = args, ctypes.c_long
                fns[name, dtype] = fn
    return CpuKernel(lib, path, fns=fns)


@torch.compiler.assume_constant_result  # traced code reads it as a constant (it builds nothing then)
def has_entry(name: str, dtype: torch.dtype) -> bool:
    """Whether the built kernel has C function `name` ('sd_gemv_rows', 'sd_gather_rows') for `dtype`."""
    return cpu_kernel().entry(name, dtype) is not None


def _entry(what: str, name: str, x: Tensor, w: Tensor, width: int, bias: Tensor | None, n_bias: int):
    """Check one call's operands (w: a CPU 2-D weight with unit stride along its rows; x: one
    token of `width`; bias: (n_bias,)) and return the C entry for w's dtype."""
    if w.dim() != 2 or w.stride(1) != 1 or w.device.type != "cpu":
        raise InputError(f"{what} wants a CPU 2-D weight with unit stride along its rows; got "
                         f"{tuple(w.shape)} strides {w.stride()} on {w.device}")
    if x.shape[-1] != width or x.shape[:-1].numel() != 1:
        raise InputError(f"{what} takes one token of width {width}; got x of shape {tuple(x.shape)}")
    if bias is not None and bias.shape != (n_bias,):
        raise InputError(f"bias must have shape ({n_bias},); got {tuple(bias.shape)}")
    fn = cpu_kernel().entry(name, w.dtype)
    if fn is None:
        raise InputError(f"the CPU kernel has no {w.dtype} entry ({cpu_kernel().reason or 'not built for it'})")
    return fn


def _ptr(t: Tensor | None):
    return None if t is None else t.data_ptr()


def _f32(t: Tensor | None, n: int) -> Tensor | None:
    return None if t is None else t.reshape(n).float().contiguous()


def sparse_gemv_cpu(x: Tensor, w_t: Tensor, threshold, bias: Tensor | None = None,
                    kept: Tensor | None = None) -> Tensor:
    """x (..., K) holding one token, w_t (K, N) on CPU -> (..., N) in x's dtype, reading only the
    rows of kept channels (|x_i| > threshold in float32), accumulated in float32. `kept`: a
    float64 buffer of 2 to which [kept channels, K] is added (the realized keep). Under
    torch.compile it is the custom op `sparsedecode::cpu_sparse_gemv` (traced whole)."""
    if torch.compiler.is_compiling():
        return _sparse_gemv_op(x, w_t, _traced_threshold(x, w_t, threshold, kept), bias)
    return _gemv_rows(x, w_t, threshold, bias, kept)


def _traced_threshold(x: Tensor, w_t: Tensor, threshold, kept) -> Tensor:
    """The threshold as a tensor for a traced call, its [kept channels, K] added to `kept` there."""
    thr = torch.as_tensor(threshold, dtype=torch.float32)
    if kept is not None:
        kept[0] += keep_mask(x, thr).sum()
        kept[1] += w_t.shape[0]
    return thr


def _gemv_rows(x: Tensor, w_t: Tensor, threshold, bias: Tensor | None, kept, lora=None) -> Tensor:
    """The C call of `sparse_gemv_cpu`, or with `lora` = (a_t, b_t, scale) of `sparse_gemv_lora_cpu`."""
    K, N = w_t.shape
    what = "sparse_gemv_cpu" if lora is None else "sparse_gemv_lora_cpu"
    fn = _entry(what, "sd_gemv_rows" if lora is None else "sd_gemv_lora", x, w_t, K, bias, N)
    adapter = () if lora is None else _lora_args(w_t, *lora)
    y = torch.empty(N, dtype=torch.float32)
    xf, b = _f32(x, K), _f32(bias, N)  # held here: the C call reads their memory
    n = fn(xf.data_ptr(), w_t.data_ptr(), _ptr(b), y.data_ptr(), K, N, w_t.stride(0), float(threshold), *adapter,
           torch.get_num_threads())
    if n < 0:
        raise MemoryError(f"{what} could not allocate its partial sums")
    if kept is not None:
        kept[0] += n
        kept[1] += K
    return y.to(x.dtype).reshape(*x.shape[:-1], N)


def _lora_args(w_t: Tensor, a_t: Tensor, b_t: Tensor, scale: float) -> tuple:
    """The adapter's C arguments (A^T, B^T, r, scale), checked against the (K, N) weight w_t."""
    r = check_factors(a_t, b_t, *w_t.shape, w_t.dtype, "cpu")
    return a_t.data_ptr(), b_t.data_ptr(), r, float(scale)


def sparse_gemv_lora_cpu(x: Tensor, w_t: Tensor, threshold, a_t: Tensor, b_t: Tensor, scale: float,
                         bias: Tensor | None = None, kept: Tensor | list | None = None) -> Tensor:
    """`sparse_gemv_cpu` plus an adapter's s * B (A x_m) (kernels/lora_gemv.py) in the same call: a_t
    (K, r) is read only in the rows of kept channels, as w_t is, b_t (r, N) whole (the expand);
    both in w_t's dtype. What `kernels.lora_gemv.lora_gemv_ref` computes, accumulated in float32.
    Under torch.compile it is the custom op `sparsedecode::cpu_lora_gemv`."""
    if torch.compiler.is_compiling():
        return _lora_gemv_op(x, w_t, _traced_threshold(x, w_t, threshold, kept), a_t, b_t, float(scale), bias)
    return _gemv_rows(x, w_t, threshold, bias, kept, (a_t, b_t, scale))


def sparse_gemv_segs_cpu(x: Tensor, w_t: Tensor, thresholds, widths, bias: Tensor | None = None,
                         kept: list | None = None) -> Tensor:
    """Several sites fused side by side in w_t (K, sum of widths) (q|k|v, gate|up), site j with
    its own threshold: what `sparse_gemv_cpu` of each site's column slice computes, in one call,
    each site reading only the rows it keeps. `kept`: per site a float64 buffer of 2 (or None) to
    which [kept channels, K] is added. Eager only (the decoder calls each site apart under
    torch.compile)."""
    K, N = w_t.shape
    fn = _entry("sparse_gemv_segs_cpu", "sd_gemv_segs", x, w_t, K, bias, N)
    widths = [int(n) for n in widths]
    if len(thresholds) != len(widths) or sum(widths) != N or min(widths, default=0) < 1:
        raise InputError(f"sparse_gemv_segs_cpu wants one threshold per site and widths summing to {N}; "
                         f"got {len(thresholds)} thresholds, widths {widths}")
    ends = torch.tensor(widths, dtype=torch.int64).cumsum(0)
    t = torch.tensor([float(v) for v in thresholds], dtype=torch.float32)
    counts = torch.zeros(len(widths), dtype=torch.int64)
    y = torch.empty(N, dtype=torch.float32)
    xf, b = _f32(x, K), _f32(bias, N)  # held here: the C call reads their memory
    if fn(xf.data_ptr(), w_t.data_ptr(), _ptr(b), y.data_ptr(), K, N, w_t.stride(0), len(widths),
          ends.data_ptr(), t.data_ptr(), counts.data_ptr(), torch.get_num_threads()) < 0:
        raise MemoryError("sparse_gemv_segs_cpu could not allocate its kept lists or partial sums")
    for buf, n in zip(kept or (), counts.tolist(), strict=False):
        if buf is not None:
            buf[0] += n
            buf[1] += K
    return y.to(x.dtype).reshape(*x.shape[:-1], N)


def sparse_gemv_union_cpu(x: Tensor, w_t: Tensor, threshold, bias: Tensor | None = None) -> tuple[Tensor, int, Tensor]:
    """A decode batch's tokens x (B, K), one per sequence, through w_t (K, N) on CPU (ByteCross §3.3,
    App. F): token b keeps its own channels |x[b, i]| > threshold and row b of the result is its own
    `sparse_gemv_cpu` (to float32 rounding), but the weight is read once for the batch, only in the
    rows of the union of kept channels. Returns (y (B, N) in x's dtype, the union's size, each
    token's kept channels (B,) int64): union / K is the realized u_B the batching appendix measures."""
    if x.dim() != 2:
        raise InputError(f"sparse_gemv_union_cpu takes x of shape (B, K); got {tuple(x.shape)}")
    B, K = x.shape
    if B < 1:
        raise InputError("sparse_gemv_union_cpu needs at least one token (B >= 1)")
    if w_t.dim() != 2 or w_t.shape[0] != K:
        raise InputError(f"sparse_gemv_union_cpu wants w_t of shape ({K}, N); got {tuple(w_t.shape)}")
    N = w_t.shape[1]
    fn = _entry("sparse_gemv_union_cpu", "sd_gemv_union", x[:1], w_t, K, bias, N)
    y = torch.empty(B, N, dtype=torch.float32)
    kept = torch.zeros(B, dtype=torch.int64)
    xf, b = x.float().contiguous(), _f32(bias, N)  # held here: the C call reads their memory
    n = fn(xf.data_ptr(), w_t.data_ptr(), _ptr(b), y.data_ptr(), B, K, N, w_t.stride(0), float(threshold),
           kept.data_ptr(), torch.get_num_threads())
    if n < 0:
        raise MemoryError("sparse_gemv_union_cpu could not allocate its masks or partial sums")
    return y.to(x.dtype), int(n), kept


def cats_up_cpu(x: Tensor, w_up: Tensor, gate_act: Tensor, threshold, bias: Tensor | None = None) -> Tensor:
    """CATS's up projection on CPU, reading only the rows of kept channels (SATS paper §2): x (..., K)
    one token, w_up (N, K) row-major, gate_act (..., N) = SiLU(gate(x)) -> (..., N) in x's dtype,
    gate_act_j * (w_up[j] . x + bias_j) where |gate_act_j| > threshold (float32), exactly 0 elsewhere;
    what `kernels.gather_gemv.cats_up_ref` computes. Under torch.compile: `sparsedecode::cpu_cats_up`."""
    if torch.compiler.is_compiling():
        return _cats_up_op(x, w_up, gate_act, torch.as_tensor(threshold, dtype=torch.float32), bias)
    return _gather_rows(x, w_up, gate_act, threshold, bias)


def _gather_rows(x: Tensor, w_up: Tensor, gate_act: Tensor, threshold, bias: Tensor | None) -> Tensor:
    N, K = w_up.shape
    fn = _entry("cats_up_cpu", "sd_gather_rows", x, w_up, K, bias, N)
    if gate_act.shape[-1] != N or gate_act.shape[:-1].numel() != 1:
        raise InputError(f"cats_up_cpu wants gate_act of width {N}; got shape {tuple(gate_act.shape)}")
    h = torch.empty(N, dtype=torch.float32)
    xf, act, b = _f32(x, K), _f32(gate_act, N), _f32(bias, N)  # held here: the C call reads them
    fn(xf.data_ptr(), w_up.data_ptr(), act.data_ptr(), _ptr(b), h.data_ptr(), K, N, w_up.stride(0),
       float(threshold), torch.get_num_threads())
    return h.to(x.dtype).reshape(*x.shape[:-1], N)


# The custom ops torch.compile traces (fullgraph) in place of the ctypes calls it cannot trace.
@torch.library.custom_op("sparsedecode::cpu_sparse_gemv", mutates_args=())
def _sparse_gemv_op(x: Tensor, w_t: Tensor, threshold: Tensor, bias: Tensor | None) -> Tensor:
    return _gemv_rows(x, w_t, threshold, bias, None)


@_sparse_gemv_op.register_fake
def _(x, w_t, threshold, bias):
    return x.new_empty(*x.shape[:-1], w_t.shape[1])


@torch.library.custom_op("sparsedecode::cpu_lora_gemv", mutates_args=())
def _lora_gemv_op(x: Tensor, w_t: Tensor, threshold: Tensor, a_t: Tensor, b_t: Tensor, scale: float,
                  bias: Tensor | None) -> Tensor:
    return _gemv_rows(x, w_t, threshold, bias, None, (a_t, b_t, scale))


@_lora_gemv_op.register_fake
def _(x, w_t, threshold, a_t, b_t, scale, bias):
    return x.new_empty(*x.shape[:-1], w_t.shape[1])


@torch.library.custom_op("sparsedecode::cpu_cats_up", mutates_args=())
def _cats_up_op(x: Tensor, w_up: Tensor, gate_act: Tensor, threshold: Tensor, bias: Tensor | None) -> Tensor:
    return _gather_rows(x, w_up, gate_act, threshold, bias)


@_cats_up_op.register_fake
def _(x, w_up, gate_act, threshold, bias):
    return x.new_empty(*x.shape[:-1], w_up.shape[0])


__all__ = ["CpuKernel", "cats_up_cpu", "cpu_kernel", "has_entry", "sparse_gemv_cpu", "sparse_gemv_lora_cpu",
           "sparse_gemv_segs_cpu"]
