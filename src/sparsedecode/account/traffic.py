"""Bytes one decode step reads, and the bytes each branch removes (ByteCross §3.1-3.2).

At batch 1 a decode step does about one FLOP per byte, so its latency follows
the bytes it reads (Eq. 1):

    B_total(n) = B_MLP + B_Attn + B_KV(n) + B_other

with, per layer, B_MLP = 3 d d_ff s_w (Eq. 2), B_Attn = (2 d h_q d_h +
2 d h_kv d_h) s_w (Eq. 3 in its general form) and B_KV(n) = 2 h_kv d_h n s_kv
(Eq. 4), where a layer with a sliding window of w tokens reads min(n, w) of them
(`ModelDims.kv_tokens`). B_other is the LM head, one embedding row, every norm weight and any
q/k/v bias: read every step and never sparsified. All functions here count
bytes over all layers; s_w and s_kv are the weight and cache element sizes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from sparsedecode.account.dims import ModelDims
from sparsedecode.account.units import check_keep
from sparsedecode.errors import InputError


def _check_sizes(weight_bytes: float, kv_bytes: float) -> None:
    for what, v in (("weight bytes", weight_bytes), ("KV bytes", kv_bytes)):
        if not v > 0:
            raise InputError(
                f"{what} per element must be positive (2 for 16-bit, 0.5 for 4-bit), got {v}"
            )


@dataclass(frozen=True)
class StepBytes:
    """Bytes of one decode step at context `context`, over all layers."""

    context: int
    mlp: float
    attn: float
    kv: float
    other: float

    @property
    def total(self) -> float:
        return self.mlp + self.attn + self.kv + self.other

    def to_dict(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k != "context"}, "total": self.total}


def step_bytes(dims: ModelDims, n: int, weight_bytes: float = 2, kv_bytes: float = 2) -> StepBytes:
    """B_MLP, B_Attn, B_KV(n) and B_other of one step at context n (Eq. 1-4)."""
    _check_sizes(weight_bytes, kv_bytes)
    if n < 0:
        raise InputError(f"context must be non-negative, got {n}")
    L = dims.n_layers
    return StepBytes(
        context=n,
        mlp=L * dims.mlp_params * weight_bytes,
        attn=L * dims.attn_params * weight_bytes,
        kv=dims.kv_tokens(n) * dims.kv_elems_per_token * kv_bytes,
        other=dims.other_params * weight_bytes,
    )


def sparsified_params(dims: ModelDims, ff_only: bool = False) -> int:
    """Parameters per layer that the projection branch thresholds: P, or 3 d d_ff when FF-only."""
    return dims.mlp_params if ff_only else dims.proj_params


def projection_saving(
    dims: ModelDims, rp: float, ff_only: bool = False, weight_bytes: float = 2
) -> float:
    """Delta B_P = (B_MLP + B_Attn)(1 - r_P) over all layers (§3.2); constant in n."""
    rp = check_keep(rp, "projection keep")
    return dims.n_layers * sparsified_params(dims, ff_only) * weight_bytes * (1.0 - rp)


def kv_saving(dims: ModelDims, n: int, rkv: float, kv_bytes: float = 2) -> float:
    """Delta B_KV(n) = B_KV(n)(1 - r_KV) over all layers (§3.2); linear in n up to the
    smallest sliding window, and flat once every layer's window is full."""
    rkv = check_keep(rkv, "KV keep")
    return dims.kv_tokens(n) * dims.kv_elems_per_token * kv_bytes * (1.0 - rkv)


def traffic_table(
    dims: ModelDims,
    contexts: list[int],
    rp: float = 0.5,
    rkv: float = 0.3,
    ff_only: bool = False,
    weight_bytes: float = 2,
    kv_bytes: float = 2,
) -> list[dict]:
    """Share of reads by MLP, attention, KV and other, and MB each branch removes.

    One row per context, like the paper's Table 9 (App. C), which uses the
    FF-only branch at 50% keep and the KV branch at 30% keep.
    """
    rows = []
    for n in contexts:
        b = step_bytes(dims, n, weight_bytes, kv_bytes)
        t = b.total
        rows.append(
            {
                "context": n,
                "total_bytes": t,
                "share": {
                    "mlp": b.mlp / t,
                    "attn": b.attn / t,
                    "kv": b.kv / t,
                    "other": b.other / t,
                },
                "removed_mb": {
                    "projection": projection_saving(dims, rp, ff_only, weight_bytes) / 1e6,
                    "kv": kv_saving(dims, n, rkv, kv_bytes) / 1e6,
                },
            }
        )
    return rows
