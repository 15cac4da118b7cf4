"""What the sparse GEMVs share (`kernels.sparse_gemv`, `kernels.gather_gemv`): device queries,
the split arithmetic, the workspace, the threshold test, and the one split-K finish.

The split-K finish: a grid of (tiles, K splits) reduces each tile's splits in the same
launch. Every program adds its fp32 partial into a workspace with atomics (it stays in L2),
then `split_arrive` bumps the tile's arrival count (a barrier, then an acq_rel atomic); the
program that arrives last takes the sum with `split_take`, which leaves the workspace at
zero, writes its output and puts the count back with `split_reset`. One launch, no host
sync, a workspace all-zero again after every call: capturable in a CUDA graph and
replayable. One-warp programs read the sum with loads and reset with stores; programs of
several warps keep the atomic exchanges (`finish_mode`; docs/kernels/sparse_gemv.md#finish).
"""

from __future__ import annotations

import functools
import math
import os

import torch
from torch import Tensor

from sparsedecode.errors import InputError

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_BLOCK = 16  # smallest tile width: workspace() sizes its counters for it


@functools.cache
def cpu_half_native(dtype: torch.dtype) -> bool:
    """Whether this CPU does `dtype` (bfloat16, float16) GEMMs in hardware (AVX512-BF16, AMX):
    where it does not, PyTorch's half GEMMs run several times slower than float32's."""
    if dtype == torch.bfloat16:
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    if dtype == torch.float16:
        return torch.cpu._is_amx_fp16_supported()
    return True


def linear(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, w, bias), computed in float32 and cast back where x is a half dtype on a CPU that
    lacks its GEMMs (`cpu_half_native`): a prefill of half weights then runs at float32 speed rather
    than several times slower, reading the half weights it stores (widened per call)."""
    if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float16) or cpu_half_native(x.dtype) \
            or torch.compiler.is_compiling():
        return torch.nn.functional.linear(x, w, bias)
    b = None if bias is None else bias.float()
    return torch.nn.functional.linear(x.float(), w.float(), b).to(x.dtype)


def interpreting() -> bool:
    """Whether Triton runs on CPU under TRITON_INTERPRET=1."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def rows_per_split(K: int, block_k: int, splits: int) -> int:
    per = -(-K // splits)  # ceil(K / splits)
    return -(-per // block_k) * block_k  # rounded up to whole BLOCK_K tiles


def splits(K: int, block_k: int, want: int) -> int:
    """The split count actually used for `want`: every split gets >= 1 row."""
    want = max(1, min(want, -(-K // block_k)))
    return -(-K // rows_per_split(K, block_k, want))


def workspace(N: int, device, block_n: int = MIN_BLOCK) -> tuple[Tensor, Tensor]:
    """Zeroed (fp32 partial sums (N,), int32 arrival counters (tiles,)) for N outputs.

    The kernels leave both at zero again, so one workspace serves any number of calls
    in sequence (and in a CUDA graph); sized for the smallest tile, it fits any config.
    """
    return (torch.zeros(N, device=device, dtype=torch.float32),
            torch.zeros(-(-N // block_n), device=device, dtype=torch.int32))


def lora_workspace_sizes(N: int, rank: int) -> tuple[int, int]:
    """(float32 sums, int32 counters) a call with an adapter of `rank` needs at most, for any
    BLOCK_N >= MIN_BLOCK: N outputs and each column tile's own u of `rank`; a counter per tile."""
    tiles = -(-N // MIN_BLOCK)
    return N + tiles * rank, tiles


def lora_workspace(N: int, rank: int, device) -> tuple[Tensor, Tensor]:
    """`workspace` of a call that carries an adapter of `rank` (kernels/lora_gemv.py): the output
    sums and each tile's u, the tiles' arrival counters, all zero."""
    n_acc, n_count = lora_workspace_sizes(N, rank)
    return (torch.zeros(n_acc, device=device, dtype=torch.float32),
            torch.zeros(n_count, device=device, dtype=torch.int32))


def check_inputs(x: Tensor, w_t: Tensor, threshold, bias: Tensor | None) -> tuple[int, int]:
    """Validate sparse-GEMV operands; returns (K, N)."""
    if w_t.dim() != 2:
        raise InputError(f"sparse_gemv wants w_t (K, N), the weight transposed; got {tuple(w_t.shape)}")
    K, N = w_t.shape
    if x.dim() < 1 or x.shape[-1] != K:
        raise InputError(f"x {tuple(x.shape)} does not end in K={K}, the rows of w_t {tuple(w_t.shape)}")
    if x.numel() != K:
        raise InputError(
            f"sparse_gemv multiplies one token: x {tuple(x.shape)} holds {x.numel() // max(K, 1)} rows; "
            "run several tokens (prefill) densely"
        )
    if x.dtype != w_t.dtype or x.dtype not in DTYPES:
        raise InputError(
            f"sparse_gemv runs in float16, bfloat16 or float32 with one dtype for x and w_t; "
            f"got {x.dtype} and {w_t.dtype}"
        )
    if x.device != w_t.device:
        raise InputError(f"x lives on {x.device} and w_t on {w_t.device}")
    if bias is not None and (bias.shape != (N,) or bias.device != x.device):
        raise InputError(f"bias must be ({N},) on {x.device}; got {tuple(bias.shape)} on {bias.device}")
    check_threshold(threshold, x.device)
    return K, N


def lora_scales(scale) -> list[float]:
    """The adapter scale of each segment (one for a one-site call)."""
    return [float(v) for v in scale] if isinstance(scale, (list, tuple)) else [float(scale)]


def check_factors(a_t: Tensor, b_t: Tensor, K: int, N: int, dtype: torch.dtype, device, segments: int = 1,
                  who: str = "adapter") -> int:
    """An adapter's A^T (K, segments * r) and B^T (r, N), contiguous in `dtype` on `device`, r >= 1
    (read from a_t's columns); returns r. The one check of every kernel that takes factors."""
    r = a_t.shape[-1] // segments if a_t.dim() == 2 else -1
    for name, t, shape in (("a_t", a_t, (K, segments * r)), ("b_t", b_t, (r, N))):
        if t.shape != shape or r < 1 or t.dtype != dtype or t.device != torch.device(device) or not t.is_contiguous():
            raise InputError(f"the {who}'s {name} must be contiguous {shape} in {dtype} on {device}"
                             f"{' (the segments side by side)' if segments > 1 else ''}; got {tuple(t.shape)} "
                             f"{t.dtype} on {t.device}")
    return r


def check_lora(lora, x: Tensor, K: int, N: int, segments, ws) -> None:
    """The adapter operands of `sparse_gemv(lora=...)`: (a_t (K, S r), b_t (r, N), scale), S the
    segments (1 without), scale one number or one per segment (0: that site has no adapter)."""
    if not isinstance(lora, (tuple, list)) or len(lora) != 3:
        raise InputError("lora= is (a_t (K, r), b_t (r, N), scale)")
    a_t, b_t, scale = lora
    n_seg = 1 if segments is None else len(segments)
    r = check_factors(a_t, b_t, K, N, x.dtype, x.device, n_seg)
    if len(lora_scales(scale)) != n_seg or not all(math.isfinite(v) for v in lora_scales(scale)):
        raise InputError(f"the adapter wants {n_seg} finite scale(s), one per segment; got {scale!r}")
    n_acc, n_count = lora_workspace_sizes(N, r)
    if ws is not None and (ws[0].numel() < n_acc or ws[1].numel() < n_count):
        raise InputError(f"with an adapter ws must be lora_workspace({N}, {r}, device)")


def check_threshold(threshold, device) -> None:
    """A threshold is a float or a 1-element float tensor on the operands' device."""
    if isinstance(threshold, Tensor):
        if threshold.numel() != 1 or not threshold.dtype.is_floating_point:
            raise InputError(
                f"threshold must be a float or a 1-element float tensor; got {threshold.dtype} "
                f"{tuple(threshold.shape)}"
            )
        if threshold.device != device:
            raise InputError(f"threshold lives on {threshold.device}, x on {device}")
    elif not isinstance(threshold, (int, float)):
        raise InputError(f"threshold must be a float or a 1-element tensor; got {type(threshold).__name__}")


def keep_mask(x: Tensor, threshold) -> Tensor:
    """Kept channels |x| > t, compared in float32 as the kernels do; bool, x's shape."""
    t = threshold.float() if isinstance(threshold, Tensor) else torch.tensor(float(threshold))
    return x.float().abs() > t.to(x.device).reshape(())


def finish_mode(num_warps: int) -> str:
    """'load' (the sum read by loads, the count reset by a store) for one-warp programs, 'xchg'
    (atomic exchanges) for programs of several warps, where the loads returned wrong sums on
    the H200 (docs/kernels/sparse_gemv.md#finish)."""
    return "load" if num_warps == 1 else "xchg"


if triton is not None:

    @triton.jit
    def split_arrive(Count, tile, num_splits):
        """Whether this program is the last of its tile's splits to arrive (call after its
        partial adds): all lanes' adds precede the release of the arrival count (bar.sync,
        then a release atomic, which is cumulative); the last arrival acquires it and so sees
        every split's adds."""
        tl.debug_barrier()
        arrived = tl.atomic_add(Count + tile, 1, sem="acq_rel")
        return arrived == num_splits - 1

    @triton.jit
    def split_take(Acc, offs, mask, LOAD: tl.constexpr):
        """The fp32 sums at Acc + offs (mask), the workspace left at zero: with LOAD by loads
        from L2 (ordered after the acquire) and stores, else by one atomic exchange per element
        on the float's bits."""
        if LOAD:
            total = tl.load(Acc + offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(Acc + offs, tl.zeros_like(total), mask=mask)
        else:
            acc_bits = Acc.to(tl.pointer_type(tl.int32)) + offs
            total = tl.atomic_xchg(acc_bits, tl.zeros_like(offs), mask=mask,
                                   sem="relaxed").to(tl.float32, bitcast=True)
        return total

    @triton.jit
    def split_reset(Count, tile, LOAD: tl.constexpr):
        """The tile's arrival count back at zero: with LOAD a plain store (no program of this
        launch reads it after the last arrival), else an atomic exchange."""
        if LOAD:
            tl.store(Count + tile, 0)
        else:
            tl.atomic_xchg(Count + tile, 0, sem="relaxed")
