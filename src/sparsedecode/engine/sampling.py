"""Next-token choice from one row of logits, on the device (no host sync)."""

from __future__ import annotations

import math

import torch

from sparsedecode.errors import InputError, option

SEED_RANGE = (0, 2**64 - 1)  # what torch.Generator.manual_seed takes


def check_sampling(temperature: float, top_p: float, seed: int | None = None) -> None:
    """Refuse sampling settings that would fail or silently misbehave (NaN compares false)."""
    if not (isinstance(temperature, int | float) and math.isfinite(temperature) and temperature >= 0):
        raise InputError(f"{option('temperature')} must be a finite number >= 0 (0 is greedy), got {temperature}")
    if not (isinstance(top_p, int | float) and 0 < top_p <= 1):
        raise InputError(f"{option('top_p')} must be in (0, 1], got {top_p}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise InputError(f"{option('seed')} must be a whole number in [0, 2^64 - 1], got {seed}")


def sample(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0, generator=None):
    """Token id (1,) long from logits (V,): greedy at temperature 0, else nucleus sampling."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)  # (1,)
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (V,)
    if top_p >= 1:
        return torch.multinomial(probs, 1, generator=generator)
    p_sorted, order = probs.sort(descending=True)  # (V,)
    # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
    outside = (p_sorted.cumsum(-1) - p_sorted) >= top_p
    p_sorted = p_sorted.masked_fill(outside, 0.0)
    return order.gather(-1, torch.multinomial(p_sorted, 1, generator=generator))  # (1,)


__all__ = ["check_sampling", "sample"]
