"""CATS in the decode step: gate GEMV -> mask -> sparse up/down (SATS paper §2, CATS).

CATS thresholds the MLP activation itself: channel j of a layer is kept iff
|SiLU(gate(x))_j| > t. A dropped channel zeroes that entry of SiLU(gate)·up,
so it needs neither row j of up nor column j of down. `CatsMLP` runs the gate
projection dense, masks, and feeds the product to down as a `SparseLinear` at
threshold 0: on CUDA the input-sparse GEMV then skips down's rows for every
dropped channel (real bytes). Up is still computed for every channel here (its
bytes are read, a masked stand-in) until a row-gather GEMV exists; the realized
keep it reports is over the SiLU(gate) channels, as the calibrator targets.
Prefill (several tokens) runs the dense MLP, as in both papers.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from sparsedecode.projection.sparse_linear import SparseLinear


class CatsMLP(nn.Module):
    """A SwiGLU MLP whose one-token path drops channels with |SiLU(gate)| <= threshold."""

    def __init__(self, mlp: nn.Module, threshold: float, site: str = "", track: bool = False):
        super().__init__()
        self.gate_proj, self.up_proj = mlp.gate_proj, mlp.up_proj
        down = mlp.down_proj
        self.down_proj = down if isinstance(down, SparseLinear) else SparseLinear.from_linear(down, 0.0)
        self.site = site
        self.track = track
        self.register_buffer("threshold", torch.tensor(float(threshold)), persistent=False)
        # int64 counts: model.to(dtype) casts floating buffers only
        self.register_buffer("kept", torch.zeros(2, dtype=torch.int64), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        """x (..., d) -> (..., d)."""
        act = F.silu(self.gate_proj(x))  # (..., d_ff)
        if x.shape[:-1].numel() != 1:
            return self.down_proj(act * self.up_proj(x))  # prefill: dense (down runs dense too)
        keep = act.abs() > self.threshold.to(act.dtype)  # (1, d_ff)
        if self.track:
            self.kept[0] += keep.sum()
            self.kept[1] += keep.numel()
        return self.down_proj((act * keep) * self.up_proj(x))  # zeros: down skips those rows

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
