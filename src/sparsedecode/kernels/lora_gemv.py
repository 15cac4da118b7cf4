"""LoRA-aware input-sparse GEMV of one decode token (SATS paper §4.2 'Fine-tuning Methods').

An adapter site of the sparse decode step computes

    y = x_m W^T + s * B (A x_m) (+ bias),   x_m = x * (|x| > t),   s = alpha / r,

with A (r, in) and B (out, r). The paper found separate low-rank operations a substantial
overhead of the fine-tuned sparse path and folded them into the sparse MLP kernels; here the
adapter rides in the launch of the base sparse GEMV (`kernels.sparse_gemv`, its LORA path),
with no program of its own:

- The shrink is input-sparse like the base weight: A is stored transposed, a_t (in, r), and
  every program of the base grid (a column tile and a K split) loads, beside its kept rows of
  the weight, the same rows of a_t (the same threshold test: a dropped channel's r adapter values
  are never read) and sums its split's partial of its own tile's u = A x_m (float32) into the
  workspace after the N outputs. Each tile thus has a whole u once its own splits have arrived;
  a_t's kept rows are read from HBM once and by the other tiles from L2 (r / BLOCK_N more loads
  per program: 16 / 256 for rank 16 in bf16).
- The expand is in the split-K finish: the tile's last split adds s * (b_t[:, tile])^T u from
  the tile's columns of B stored transposed, b_t (r, out), before bias, residual and rounding,
  and takes u back to zero with the sums. One launch, no program waits on another tile, no
  host sync; the base weight's layout and loops are untouched (with no adapter the kernel
  compiles to the same instructions).
- Everything after x_m is accumulated in float32 and rounded once, as `lora_gemv_ref` computes.

Its fused forms carry the adapter too: SwiGLU's product (`up=`), the residual add and the input
RMSNorm (`residual=`, `norm=`), since the adapter's column reads x through the same loads.
What was chosen against what, and which measurement decides: docs/kernels/lora_gemv.md. On CPU
the same call is `kernels.cpu_gemv.sparse_gemv_lora_cpu`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sparsedecode.errors import InputError
from sparsedecode.kernels.common import keep_mask, lora_workspace
from sparsedecode.kernels.options import DEFAULT, GemvOptions
from sparsedecode.kernels.sparse_gemv import sparse_gemv


def lora_gemv_ref(x: Tensor, w_t: Tensor, threshold, a_t: Tensor, b_t: Tensor, scale: float,
                  bias: Tensor | None = None) -> Tensor:
    """Masked reference of `lora_gemv` (reads every weight): x (..., K), w_t (K, N), a_t (K, r),
    b_t (r, N) -> (..., N) in x's dtype, x_m w_t + scale * (x_m a_t) b_t (+ bias) in float32 with
    x_m = x where |x| > threshold (float32) else 0, rounded once. Several rows of x (a decode
    batch) are each masked by their own test."""
    xm = torch.where(keep_mask(x, threshold), x.float(), 0.0)  # (..., K)
    y = xm @ w_t.float() + float(scale) * ((xm @ a_t.float()) @ b_t.float())  # (..., N)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def lora_delta(x: Tensor, a_t: Tensor, b_t: Tensor, scale: float, keep: Tensor | None = None) -> Tensor:
    """The adapter's term alone, scale * (x a_t) b_t, for several tokens in x's dtype (float32
    inside): a prefill's (keep None: dense, as the base) or a decode batch's with each row masked
    by its `keep` (bool, x's shape). It reads every row of a_t: the reference path of the rows
    that no one-token kernel runs (docs/kernels/lora_gemv.md)."""
    xf = x.float() if keep is None else torch.where(keep, x.float(), 0.0)
    return (float(scale) * ((xf @ a_t.float()) @ b_t.float())).to(x.dtype)


def lora_gemv(
    x: Tensor, w_t: Tensor, threshold, a_t: Tensor, b_t: Tensor, scale: float, bias: Tensor | None = None,
    ws: tuple[Tensor, Tensor] | None = None, *, up: Tensor | None = None,
    residual: Tensor | None = None, norm: tuple[Tensor, Tensor, float] | None = None,
    config: tuple[int, int, int, int, int] | None = None, options: GemvOptions = DEFAULT.gemv,
) -> Tensor | tuple[Tensor, Tensor]:
    """One token through an adapter site in one launch (CUDA, or CPU under TRITON_INTERPRET=1):
    x (..., K) one token, w_t (K, N), a_t (K, r) = A^T, b_t (r, N) = B^T, all contiguous in x's
    dtype -> (..., N), what `lora_gemv_ref` computes; a_t's rows of dropped channels are never
    read. `ws`: a persistent `lora_workspace(N, r, device)` (zero between calls, as the kernel
    leaves it; else each call allocates one). `up`, `residual`,
    `norm`, `config`, `options`: as `kernels.sparse_gemv.sparse_gemv`."""
    if a_t.dim() != 2 or b_t.dim() != 2:
        raise InputError(f"lora_gemv wants a_t (K, r) and b_t (r, N); got {tuple(a_t.shape)} and {tuple(b_t.shape)}")
    if isinstance(threshold, (list, tuple)):
        raise InputError("lora_gemv runs one site with one threshold")
    return sparse_gemv(x, w_t, threshold, bias, ws=ws, config=config, up=up, residual=residual, norm=norm,
                       options=options, lora=(a_t, b_t, float(scale)))


__all__ = ["lora_delta", "lora_gemv", "lora_gemv_ref", "lora_workspace"]
