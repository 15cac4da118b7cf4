"""The quality-matched crossover (ByteCross §5.2, App. A 'Quality-matched crossover').

Nominal keep ratios compare branches of unequal quality. Given a measured
curve {keep: quality increase} for each branch (e.g. decode-position ΔPPL at
32K) and a budget, each branch takes the most aggressive keep whose linearly
interpolated increase stays within the budget; a budget above a whole curve
takes the curve's most aggressive tested keep, and no curve is ever extended
toward dense decoding. Eq. 5 at the two admissible keeps gives the crossover.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparsedecode.account.crossover import crossover
from sparsedecode.account.dims import ModelDims
from sparsedecode.errors import InputError


def admissible_keep(curve: dict[float, float], budget: float) -> float | None:
    """Lowest keep whose interpolated increase stays within `budget`, or None.

    Walks from the least aggressive tested keep toward the most aggressive and
    stops where the curve first rises above the budget, interpolating the keep
    at which it meets the budget. None when even the least aggressive tested
    keep exceeds the budget (the curve is not extended toward keep 1).
    """
    if not curve:
        raise InputError("a quality curve needs at least one KEEP:DELTA point")
    pts = sorted(curve.items(), key=lambda kv: -kv[0])  # least aggressive first
    k0, d0 = pts[0]
    if d0 > budget:
        return None
    for k1, d1 in pts[1:]:
        if d1 > budget:
            return k0 + (budget - d0) * (k1 - k0) / (d1 - d0)
        k0, d0 = k1, d1
    return k0


@dataclass(frozen=True)
class MatchedCrossover:
    budget: float
    proj_keep: float | None
    kv_keep: float | None
    crossover: float  # tokens; 0 when only the KV branch is admissible, inf when only projection

    def to_dict(self) -> dict:
        return {
            "budget": self.budget,
            "proj_keep": self.proj_keep,
            "kv_keep": self.kv_keep,
            "crossover_exact": None if self.crossover == float("inf") else self.crossover,
        }


def matched_crossover(
    dims: ModelDims,
    proj_curve: dict[float, float],
    kv_curve: dict[float, float],
    budget: float,
    ff_only: bool = False,
    weight_bytes: float = 2,
    kv_bytes: float = 2,
) -> MatchedCrossover:
    """Crossover at equal quality cost: Eq. 5 at each branch's admissible keep.

    A branch with no admissible keep stays dense (keep 1): then the other
    branch wins at every context (crossover 0 or inf).
    """
    if budget < 0:
        raise InputError(f"quality budget must be non-negative, got {budget}")
    rp = admissible_keep(proj_curve, budget)
    rkv = admissible_keep(kv_curve, budget)
    if rkv is None and rp is None:
        raise InputError(
            f"no tested keep of either branch stays within budget {budget}; "
            "raise the budget or measure less aggressive keeps"
        )
    n = crossover(
        dims,
        1.0 if rp is None else rp,
        1.0 if rkv is None else rkv,
        ff_only,
        weight_bytes,
        kv_bytes,
    )
    return MatchedCrossover(budget=budget, proj_keep=rp, kv_keep=rkv, crossover=n)
