"""The byte account of token routing (SATS paper §3.2).

Token routing sends a fraction r of decode steps through the sparse path and
the rest through the dense (base) one. A sparse step reads a fraction k of the
sparsified projection bytes, a dense step all of them, so the mean step reads

    k_eff = r k + (1 - r)

of them. Bytes are linear in the keep, so every byte quantity of the account
(crossover, bounds, traffic) of a routed configuration is the static one at
k_eff: routing at r = 0.5 over a keep-0.5 sparse path reads like a static keep
of 0.75.
"""

from __future__ import annotations

from sparsedecode.account.units import check_keep
from sparsedecode.errors import InputError


def check_routed(value, what: str = "routed fraction") -> float:
    """A routed fraction lies in [0, 1]: 0 routes every step dense, 1 every step sparse."""
    try:
        r = float(value)
    except (TypeError, ValueError):
        raise InputError(
            f"{what} '{value}' is not a number: give the fraction of decode steps routed to "
            "the sparse path, in [0, 1]"
        ) from None
    if not 0.0 <= r <= 1.0:
        raise InputError(
            f"{what} {value} is outside [0, 1]: it is the fraction of decode steps routed to "
            "the sparse path (0 all dense, 1 all sparse)"
        )
    return r


def routed_keep(keep: float, routed: float) -> float:
    """k_eff = r k + (1 - r): the mean keep of a step when a fraction `routed` of steps reads
    `keep` of the sparsified bytes and the rest reads them all."""
    k = check_keep(keep, "sparse-path keep")
    r = check_routed(routed)
    return r * k + (1.0 - r)


__all__ = ["check_routed", "routed_keep"]
