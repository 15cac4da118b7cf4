"""CATS: one threshold per layer on |SiLU(gate(x))| at a percentile of calibration text.

Lee et al., 2024, 'CATS: Contextually-Aware Thresholding for Sparsity in Large
Language Models' (cited in ByteCross §3.2; described in §2 of the SATS paper,
"Sensitivity-Aware Thresholding for Sparsity", 2026): for a target sparsity k, the cutoff
t of a layer is the k-th percentile of |SiLU(x W_gate)| over calibration
activations, and channels with |SiLU(x W_gate)| <= t are zeroed. A zeroed
channel zeroes SiLU(gate)·up, so the decode step computes gate densely, then
reads only the matching rows of up and columns of down. Keys `layers.{i}.act`;
`keep` is the fraction of SiLU(gate) channels kept ('act_keep').
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from sparsedecode.projection.calibrate import Activations, Calibrator
from sparsedecode.projection.thresholds import ACT_SITE, site_key


@dataclass
class Cats(Calibrator):
    """keep: fraction of SiLU(gate) channels kept, in (0, 1]."""

    name: ClassVar[str] = "cats"

    @property
    def keep_metric(self) -> str:
        return "act_keep"

    def site_keeps(self, engine, acts: Activations, progress: bool = False) -> dict[str, float]:
        return {site_key(i, ACT_SITE): self.keep for i in range(engine.dims.n_layers)}
