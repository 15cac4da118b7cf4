"""Crossover lengths and ideal speedup bounds (ByteCross §3.3, §4.3, App. C).

The crossover n* is the context at which the two savings match,
Delta B_P = Delta B_KV(n*). The layer count cancels (Eq. 5):

    n* = P (1 - r_P) s_w / (2 h_kv d_h (1 - r_KV) s_kv)

so precision enters as s_w / s_kv: 4-bit weights with a 16-bit cache move the
crossover four times closer. Variants: the FF-only branch (P -> 3 d d_ff); a
KV method with a fixed token budget b (r_KV = b/n); a batch of B sequences
whose sparse projection reads the union u_B of their channels; and the
latency crossing once each branch pays a kernel cost beyond its byte time.

Sliding windows: a layer with a window of w tokens reads min(n, w) cached tokens, so the KV
saving stops growing at its window, and the crossing is where the savings of all layers
together reach the projection saving. It is 'never' (math.inf) when every layer slides and
the windows cap the KV saving below the projection saving.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from sparsedecode.account.dims import ModelDims
from sparsedecode.account.traffic import (
    _check_sizes,
    kv_saving,
    projection_saving,
    sparsified_params,
    step_bytes,
)
from sparsedecode.account.units import check_keep
from sparsedecode.errors import InputError


def crossover(
    dims: ModelDims,
    rp: float,
    rkv: float,
    ff_only: bool = False,
    weight_bytes: float = 2,
    kv_bytes: float = 2,
) -> float:
    """n* in tokens (Eq. 5), exact; math.inf when the KV branch removes nothing, or removes
    less than the projection branch at any context because every layer's window caps it."""
    return _kv_crossing(dims, _tokens_per_layer(dims, rp, rkv, ff_only, weight_bytes, kv_bytes))


def _tokens_per_layer(dims, rp, rkv, ff_only, weight_bytes, kv_bytes) -> float:
    """Eq. 5 without windows: the context at which one layer's KV saving equals its projection
    saving; math.inf when r_KV = 1."""
    rp, rkv = check_keep(rp, "projection keep"), check_keep(rkv, "KV keep")
    _check_sizes(weight_bytes, kv_bytes)
    if rkv == 1.0:
        return math.inf
    p = sparsified_params(dims, ff_only)
    return p * (1.0 - rp) * weight_bytes / (dims.kv_elems_per_token * (1.0 - rkv) * kv_bytes)


def _kv_crossing(dims: ModelDims, per_layer: float, budget: float = 0) -> float:
    """The context n at which the layers together skip n_layers x `per_layer` cached tokens,
    a layer of window w skipping max(min(n, w) - budget, 0) (w = 0: no window); math.inf when
    the windows cap the layers below that. Without windows: budget + per_layer."""
    if not dims.windows:
        return budget + per_layer
    target = dims.n_layers * per_layer
    n, value = float(budget), 0.0
    slope = sum(1 for w in dims.windows if not w or w > budget)  # layers whose skip still grows
    for w in sorted(w for w in dims.windows if w > budget):
        if value + slope * (w - n) >= target:
            break
        value, n, slope = value + slope * (w - n), float(w), slope - 1
    return n + (target - value) / slope if slope else math.inf


def crossover_batched(
    dims: ModelDims,
    union: float,
    rkv: float,
    batch: int,
    ff_only: bool = False,
    weight_bytes: float = 2,
    kv_bytes: float = 2,
) -> float:
    """n*_B = P (1 - u_B) / (2 B h_kv d_h (1 - r_KV)), at most n*/B (§3.3, App. F).

    A batch shares each weight read while every sequence reads its own cache,
    and the sparse projection reads every channel any sequence activates.
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise InputError(f"batch must be a positive integer, got {batch}")
    union = check_keep(union, "union keep")
    return _kv_crossing(dims, _tokens_per_layer(dims, union, rkv, ff_only, weight_bytes, kv_bytes) / batch)


def crossover_fixed_budget(
    dims: ModelDims,
    rp: float,
    budget: int,
    ff_only: bool = False,
    weight_bytes: float = 2,
    kv_bytes: float = 2,
) -> float:
    """n* = b + P (1 - r_P) / (2 h_kv d_h) for a KV method keeping b tokens (§3.3).

    Substituting r_KV = b/n into Eq. 5; valid because the crossing lies above b
    whenever the projection branch removes anything.
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise InputError(f"KV token budget must be a non-negative integer, got {budget}")
    rp = check_keep(rp, "projection keep")
    _check_sizes(weight_bytes, kv_bytes)
    p = sparsified_params(dims, ff_only)
    return _kv_crossing(dims, p * (1.0 - rp) * weight_bytes / (dims.kv_elems_per_token * kv_bytes), budget)


def round_tokens(n: float) -> int | None:
    """A crossover to the nearest token, as the paper reports it (App. C); None if infinite."""
    return None if math.isinf(n) else round(n)


@dataclass(frozen=True)
class Bounds:
    """Ideal speedups B_total / (B_total - Delta B) of each mode at one context."""

    context: int
    projection: float
    kv: float
    both: float

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "context"}


def bounds(
    dims: ModelDims,
    n: int,
    rp: float,
    rkv: float,
    ff_only: bool = False,
    weight_bytes: float = 2,
    kv_bytes: float = 2,
) -> Bounds:
    """Byte bounds at context n (§3.3): falling with n for the projection branch,
    rising for the KV branch, largest for both. The projection saving covers the
    seven projections only: LM head, embedding row and norms stay dense."""
    total = step_bytes(dims, n, weight_bytes, kv_bytes).total
    dp = projection_saving(dims, rp, ff_only, weight_bytes)
    dkv = kv_saving(dims, n, rkv, kv_bytes)
    return Bounds(
        context=n,
        projection=total / (total - dp),
        kv=total / (total - dkv),
        both=total / (total - dp - dkv),
    )


def latency_crossing(
    dims: ModelDims,
    rp: float,
    rkv: float,
    cost_proj_ms: float,
    cost_kv_ms: float,
    bandwidth_gbps: float,
    ff_only: bool = False,
    weight_bytes: float = 2,
    kv_bytes: float = 2,
) -> float:
    """n_lat ~ n* - (c_P - c_KV) / s (§4.3), in tokens.

    s is the growth of the byte-time gap per token: the KV bytes the KV branch
    skips per extra token of context divided by the effective bandwidth. Each
    branch is modelled as byte time plus a constant kernel cost c (ms). With sliding
    windows s falls as layers fill their windows: n_lat is where the gap, solved exactly
    over the windows, pays c_P - c_KV.
    """
    if not bandwidth_gbps > 0:
        raise InputError(f"effective bandwidth must be positive (GB/s), got {bandwidth_gbps}")
    per_layer = _tokens_per_layer(dims, rp, rkv, ff_only, weight_bytes, kv_bytes)
    if math.isinf(per_layer):
        return math.inf
    # The gap must also pay c_P - c_KV: in cached tokens per layer at one layer's skipped bytes per
    # token. With sliding windows the gap grows only through the layers whose window is not yet
    # full, so the shifted target is solved over the windows as n* is (not n* minus a constant slope).
    per_token_s = kv_saving(dims, 1, rkv, kv_bytes) / dims.n_layers / (bandwidth_gbps * 1e9)
    return _kv_crossing(dims, per_layer - (cost_proj_ms - cost_kv_ms) * 1e-3 / per_token_s / dims.n_layers)


def kv_gap_growth_ms_per_k(
    dims: ModelDims, rkv: float, bandwidth_gbps: float, kv_bytes: float = 2
) -> float:
    """s of §4.3 in ms per 1K tokens of context (about 0.06 ms on A100 for Llama-3.1-8B)."""
    return kv_saving(dims, 1024, rkv, kv_bytes) / (bandwidth_gbps * 1e9) * 1e3
