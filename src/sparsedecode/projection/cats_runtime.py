"""CATS in the decode step: gate GEMV -> SiLU -> row-gather up -> sparse down (SATS paper §2, CATS).

CATS thresholds the MLP activation itself: channel j of a layer is kept iff
|SiLU(gate(x))_j| > t. A dropped channel zeroes that entry of SiLU(gate)·up,
so it needs neither row j of up nor column j of down. `CatsMLP` runs the gate
projection dense and, on CUDA (or under TRITON_INTERPRET=1), feeds SiLU(gate)
to `kernels.gather_gemv.cats_up`, which reads only the up rows of kept channels
and returns the gated product h with exact zeros for dropped ones; down takes h
as a `SparseLinear` at threshold 0, whose input-sparse GEMV skips down's rows
for every dropped channel. Both halves move real bytes: about keep x (up + down).
On CPU the same outputs come from the masked reference (up read whole and
masked: 'masked', it saves no bytes). The realized keep it reports is over the
SiLU(gate) channels, as the calibrator targets; the mask is compared in float32
on every path, so CPU and CUDA keep the same channels. Prefill (several tokens)
runs the dense MLP, as in both papers.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from sparsedecode.kernels.gather_gemv import cats_up
from sparsedecode.kernels.sparse_gemv import _interpreting, keep_mask, workspace
from sparsedecode.projection.sparse_linear import FixedDtypeBuffers, SparseLinear


class CatsMLP(FixedDtypeBuffers):
    """A SwiGLU MLP whose one-token path drops channels with |SiLU(gate)| <= threshold.

    up_proj is kept as an nn.Linear whose weight is made row-major (N, K) once where the
    row-gather kernel runs (a CPU model stores it column-major for faster CPU GEMV).
    """

    FIXED_DTYPE = ("threshold", "ws_acc")

    def __init__(self, mlp: nn.Module, threshold: float, site: str = "", track: bool = False):
        super().__init__()
        up = mlp.up_proj.to_linear() if isinstance(mlp.up_proj, SparseLinear) else mlp.up_proj
        self.gate_proj, self.up_proj = mlp.gate_proj, up
        down = mlp.down_proj
        self.down_proj = down if isinstance(down, SparseLinear) else SparseLinear.from_linear(down, 0.0)
        self.site = site
        self.track = track
        dev = up.weight.device
        if (dev.type == "cuda" or _interpreting()) and not up.weight.is_contiguous():
            up.weight = nn.Parameter(up.weight.detach().contiguous(), requires_grad=False)  # (N, K)
        self.register_buffer("threshold", torch.tensor(float(threshold), device=dev), persistent=False)
        # int64 counts: model.to(dtype) casts floating buffers only
        self.register_buffer("kept", torch.zeros(2, dtype=torch.int64, device=dev), persistent=False)
        acc, count = workspace(up.out_features, dev)
        self.register_buffer("ws_acc", acc, persistent=False)  # (d_ff,) fp32, zero between calls
        self.register_buffer("ws_count", count, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        """x (..., d) -> (..., d)."""
        act = F.silu(self.gate_proj(x))  # (..., d_ff)
        if x.shape[:-1].numel() != 1:
            return self.down_proj(act * self.up_proj(x))  # prefill: dense (down runs dense too)
        if self.track:
            keep = keep_mask(act, self.threshold)  # (1, d_ff)
            self.kept[0] += keep.sum()
            self.kept[1] += keep.numel()
        if x.is_cuda or _interpreting():
            # reads only the up rows of kept channels; h is 0 exactly where dropped
            h = cats_up(x, self.up_proj.weight, act, self.threshold, self.up_proj.bias,
                        ws=(self.ws_acc, self.ws_count))  # (..., d_ff)
        else:
            h = (act * keep_mask(act, self.threshold)) * self.up_proj(x)  # masked: up read whole
        return self.down_proj(h)  # zeros: down skips those rows

    def realized_keep(self) -> float:
        """Kept SiLU(gate) channels over channels seen by tracked one-token calls."""
        kept, total = self.kept.tolist()
        return kept / total if total else float("nan")



def cats_(model, thresholds: dict[str, float], track: bool = False) -> list[CatsMLP]:
    """Replace the MLP of every layer by a `CatsMLP` with its 'layers.{i}.act' threshold."""
    from sparsedecode.errors import InputError

    out = []
    for i, layer in enumerate(model.layers):
        key = f"layers.{i}.act"
        if key not in thresholds:
            raise InputError(f"no CATS threshold for '{key}'; a CATS file has one per layer")
        mlp = layer.mlp
        if isinstance(mlp, CatsMLP):
            mlp.threshold.fill_(float(thresholds[key]))
            mlp.track = track
        else:
            mlp = CatsMLP(layer.mlp, thresholds[key], site=key, track=track)
            layer.mlp = mlp
        out.append(mlp)
    return out
