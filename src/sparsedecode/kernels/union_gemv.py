"""Input-sparse GEMV for a decode batch: one weight read over the union of kept channels
(ByteCross §3.3 and App. F; issue 44 item 3).

A batch of B sequences decodes one token each; token b keeps input channel i when |x[b, i]| > t,
as TEAL's one-token kernel does (`kernels.sparse_gemv`). The batch shares each weight read, so a
row of the (K, N) transposed weight is read when any token keeps its channel (the union u_B the
batching appendix measures) and never when none does, and token b adds only the rows it keeps:

    y[b, :] = sum over i with |x[b, i]| > t of x[b, i] * w_t[i, :] (+ bias)

- The grid is (N tiles, K splits). A program loads its (B, BLOCK_K) slice of the batch, forms
  each token's mask and the union over the batch, and issues the weight loads of its
  (BLOCK_K, BLOCK_N) tile masked by the union: a row no token keeps is never read.
- The tile's product is one `tl.dot` of the masked tokens (padded to at least 16 rows, zeros)
  with the tile, accumulated in float32: 16-bit operands on the tensor cores, float32 ones in
  IEEE precision (not TF32), and float32 under the interpreter.
- Splits add into a float32 (B, N) buffer (`tl.atomic_add`); bias and the cast back follow.
- `union` counts the kept rows of the union on the device (one int32, no host sync): over K, the
  realized u_B of this call.

`union_gemv_ref` is the same product masked in PyTorch (every weight read): the tests' oracle and
the path where no kernel runs. The CPU's own kernel for a batch is `kernels.cpu_gemv`'s
`sparse_gemv_union_cpu`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sparsedecode.errors import InputError
from sparsedecode.kernels.common import DTYPES, interpreting, keep_mask

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

MIN_ROWS = 16  # tl.dot's smallest M: a batch below it is padded with zero tokens


@dataclass(frozen=True)
class UnionConfig:
    """A launch of `union_gemv`: columns per program (`block_n`), rows per loop iteration
    (`block_k`), warps per program, and programs per SM the K splits aim at. The default is the
    fastest of benchmarks/kernels/union_gemv_bench.py --sweep (docs/kernels/union_gemv.md)."""

    block_n: int = 256
    block_k: int = 32
    warps: int = 4
    programs_per_sm: int = 2

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 16 and v & (v - 1) == 0):
                raise InputError(f"UnionConfig.{name} must be a power of two >= 16; got {v!r}")
        if self.warps not in (1, 2, 4, 8) or not (isinstance(self.programs_per_sm, int) and self.programs_per_sm >= 1):
            raise InputError(f"UnionConfig wants warps in 1, 2, 4, 8 and programs_per_sm >= 1; got {self}")


DEFAULT = UnionConfig()


def union_gemv_ref(x: Tensor, w_t: Tensor, threshold, bias: Tensor | None = None) -> Tensor:
    """x (B, K), w_t (K, N) -> (B, N) in x's dtype: each token's own masked product, float32
    accumulation (reads every weight)."""
    keep = keep_mask(x, threshold)
    y = torch.where(keep, x.float(), 0.0) @ w_t.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def check_inputs(x: Tensor, w_t: Tensor, bias: Tensor | None) -> tuple[int, int, int]:
    """Validate a batch's operands; returns (B, K, N)."""
    if x.dim() != 2 or w_t.dim() != 2 or x.shape[1] != w_t.shape[0]:
        raise InputError(f"union_gemv takes x (B, K) and w_t (K, N); got {tuple(x.shape)} and {tuple(w_t.shape)}")
    B, K = x.shape
    N = w_t.shape[1]
    if B < 1:
        raise InputError("union_gemv needs at least one token (B >= 1)")
    if x.dtype != w_t.dtype or x.dtype not in DTYPES:
        raise InputError(f"union_gemv runs in float16, bfloat16 or float32 with one dtype for x and w_t; "
                         f"got {x.dtype} and {w_t.dtype}")
    if x.device != w_t.device:
        raise InputError(f"x lives on {x.device} and w_t on {w_t.device}")
    if w_t.stride(1) != 1 or x.stride(1) != 1:
        raise InputError("union_gemv wants unit stride along the rows of x and w_t")
    if bias is not None and (bias.shape != (N,) or bias.device != x.device):
        raise InputError(f"bias must be ({N},) on {x.device}; got {tuple(bias.shape)} on {bias.device}")
    return B, K, N


if triton is not None:

    @triton.jit
    def _union_gemv_kernel(x_ptr, w_ptr, out_ptr, union_ptr, B, K, N, stride_x, stride_w, thr, rows_per_split,
                           ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                           UPCAST: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_b = tl.arange(0, ROWS)
        b_ok = offs_b < B
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        kept = tl.zeros((BLOCK_K,), dtype=tl.int32)
        k_lo = pid_k * rows_per_split
        for k0 in range(0, rows_per_split, BLOCK_K):
            offs_k = k_lo + k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K  # a split's rows are a whole number of BLOCK_K
            x = tl.load(x_ptr + offs_b[:, None] * stride_x + offs_k[None, :],
                        mask=b_ok[:, None] & k_ok[None, :], other=0.0)
            keep = tl.abs(x.to(tl.float32)) > thr  # (ROWS, BLOCK_K); NaN is dropped
            xm = tl.where(keep, x, tl.zeros_like(x))
            row = (tl.max(keep.to(tl.int32), axis=0) > 0) & k_ok  # the union over the batch
            w = tl.load(w_ptr + offs_k[:, None] * stride_w + offs_n[None, :],
                        mask=row[:, None] & n_ok[None, :], other=0.0)  # rows no token keeps: no bytes
            if UPCAST:  # float32 (IEEE, not TF32), and under the interpreter (NumPy has no bfloat16 dot)
                acc += tl.dot(xm.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:  # 16-bit operands on the tensor cores, float32 accumulation
                acc += tl.dot(xm, w)
            kept += row.to(tl.int32)
        tl.atomic_add(out_ptr + offs_b[:, None] * N + offs_n[None, :], acc, mask=b_ok[:, None] & n_ok[None, :])
        if pid_n == 0:
            tl.atomic_add(union_ptr, tl.sum(kept, axis=0))


def union_gemv(x: Tensor, w_t: Tensor, threshold, bias: Tensor | None = None, splits: int | None = None,
               union: Tensor | None = None, config: UnionConfig = DEFAULT) -> Tensor:
    """x (B, K), one decode token per sequence, through w_t (K, N) -> (B, N) in x's dtype, each
    token keeping its own channels, the weight read once in the rows of their union. `union`: an
    int32 device tensor of one element to which the union's kept rows are added (the realized
    u_B is union / K). `splits`: programs along K (default: `config.programs_per_sm` per SM)."""
    B, K, N = check_inputs(x, w_t, bias)
    if triton is None:
        raise InputError("union_gemv needs Triton (pip install triton) and a CUDA GPU, or TRITON_INTERPRET=1")
    thr = float(threshold)
    if thr != thr or thr < 0.0 and thr != float("-inf"):
        raise InputError(f"threshold must be >= 0 (or -inf, every channel read); got {threshold}")
    rows = max(MIN_ROWS, triton.next_power_of_2(B))
    if rows > 64:
        raise InputError(f"union_gemv takes at most 64 tokens a call; got {B} (split the batch)")
    bn, bk = config.block_n, config.block_k
    n_tiles = triton.cdiv(N, bn)
    if splits is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
        splits = max(1, min(triton.cdiv(K, bk), triton.cdiv(config.programs_per_sm * sms, n_tiles)))
    per = triton.cdiv(triton.cdiv(K, splits), bk) * bk
    splits = triton.cdiv(K, per)
    out = torch.zeros(B, N, dtype=torch.float32, device=x.device)
    count = union if union is not None else torch.zeros(1, dtype=torch.int32, device=x.device)
    _union_gemv_kernel[(n_tiles, splits)](x, w_t, out, count, B, K, N, x.stride(0), w_t.stride(0), thr, per,
                                          ROWS=rows, BLOCK_K=bk, BLOCK_N=bn,
                                          UPCAST=x.dtype == torch.float32 or interpreting(), num_warps=config.warps)
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


__all__ = ["DEFAULT", "UnionConfig", "union_gemv", "union_gemv_ref"]
