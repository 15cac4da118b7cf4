"""Sink + recent window: the KV comparison that reads the cache in place.

In the style of attention sinks (Xiao et al., 2024b), as ByteCross times and
tests it beside the scored selection (§4.1; App. A: the window reads the full
cache in place, one kernel call over the recent entries through a start
offset and one over the sinks, merged by log-sum-exp; App. G). It keeps the
first `sinks` positions and the most recent budget - sinks, with the same
budget as the scored selection (round(keep x n) - max_new, so it also refuses
a budget below sinks + window), and needs no scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from sparsedecode.errors import InputError
from sparsedecode.kv.select import KVSelector, _check_int


def window_ranges(n: int, budget: int, sinks: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((0, s), (n - recent, n)): the half-open cache ranges read in place.

    s = min(sinks, budget) sinks and recent = budget - s entries; the ranges
    never overlap, and budget n gives (0, s), (s, n), i.e. the dense cache.
    """
    _check_int(n, "context n", 1)
    _check_int(sinks, "sinks", 0)
    _check_int(budget, "budget", 0)
    if budget > n:
        raise InputError(f"window budget {budget} exceeds the context n = {n}")
    s = min(sinks, budget)
    return (0, s), (n - (budget - s), n)


@dataclass
class SinkWindow(KVSelector):
    """sinks: leading positions kept; window: the observation window the budget
    must hold (the recent entries always include it)."""

    name: ClassVar[str] = "window"

    def select(self, q_obs: Tensor | None, k_cache: Tensor, n: int, keep: float,
               max_new: int) -> Tensor:
        """Kept positions (B, Hkv, budget) int64, ascending; q_obs is ignored.

        k_cache (B, Hkv, T >= n, D) gives the batch, heads and device.
        """
        if k_cache.dim() != 4:
            raise InputError(f"k_cache must be (B, Hkv, T, D), got shape {tuple(k_cache.shape)}")
        B, Hkv, T, _ = k_cache.shape
        if n > T:
            raise InputError(f"context n = {n} exceeds the {T} positions of k_cache")
        budget = self.budget(n, keep, max_new)
        (a, b), (c, d) = window_ranges(n, budget, self.sinks)
        dev = k_cache.device
        pos = torch.cat([torch.arange(a, b, device=dev), torch.arange(c, d, device=dev)])  # (budget,)
        return pos.expand(B, Hkv, budget).contiguous()  # (B, Hkv, budget)


__all__ = ["SinkWindow", "window_ranges"]
