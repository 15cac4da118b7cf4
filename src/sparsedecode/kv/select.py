"""KV selection: the work every selector shares, done once.

The KV branch of ByteCross (§4.1; App. A 'Scored selection'; App. G) runs once
after a dense prefill of n prompt tokens: it picks, per (batch, KV head), which
cache positions decoding will read, and gathers them into one contiguous buffer
that every later decode step reads and extends with its own key and value. A
selector decides *which* positions; the base owns the rest:

- `budget`: how many positions a KV head keeps, round(keep x n) - max_new, so
  that together with the max_new tokens the protocol generates a step never
  attends more than round(keep x n) entries (App. A). keep 1.0 is "everything":
  budget n, whatever max_new is, so keep 1.0 reproduces dense decoding exactly.
- `topk_positions`: the forced positions (sinks, observation window) plus the
  best-scoring rest, ties to the lower position, sorted ascending.
- `gather`: the kept keys and values copied into fresh contiguous buffers with
  room for the generated tokens.

Methods are dataclasses in files of their own (snapkv.py, window.py), found by
name in `SELECTORS`; `get_selector(name, **fields)` builds one. A method
implements `select(q_obs, k_cache, n, keep, max_new)` (and, when it scores,
`scores(q_obs, k_cache, n)`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from sparsedecode.account.units import check_keep
from sparsedecode.errors import InputError
from sparsedecode.registry import Registry


def _check_int(value, what: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InputError(f"{what} must be an integer >= {low}, got {value!r}")
    return value


@dataclass
class KVSelector:
    """A KV selection method. Subclasses are dataclasses whose fields are their
    configuration; they validate them in __post_init__ (calling this one) and
    implement `select`.

    sinks: leading positions always kept (attention sinks; 4 in ByteCross §4.1).
    window: the observation window, the last `window` prompt positions, always
    kept (64 in App. A). A budget must hold both.
    """

    sinks: int = 4
    window: int = 64
    name: ClassVar[str] = ""

    def __post_init__(self):
        _check_int(self.sinks, f"{self.name} sinks", 0)
        _check_int(self.window, f"{self.name} window", 0)

    # -- the interface ---------------------------------------------------------
    def select(self, q_obs: Tensor | None, k_cache: Tensor, n: int, keep: float,
               max_new: int) -> Tensor:
        """Kept positions (B, Hkv, budget) int64, ascending, of the first n cache entries.

        q_obs (B, Hq, W, D): post-RoPE queries of the last W prompt tokens (methods
        that do not score ignore it); k_cache (B, Hkv, T >= n, D): post-RoPE keys.
        """
        raise NotImplementedError

    # -- shared parts ----------------------------------------------------------
    def budget(self, n: int, keep: float, max_new: int) -> int:
        """Positions kept per KV head: round(keep x n) - max_new (rounded half up).

        keep 1.0 means everything: n, so decoding reads exactly the dense cache.
        Raises InputError for keep outside (0, 1], or a budget below sinks + window.
        """
        _check_int(n, "context n", 1)
        _check_int(max_new, "max_new", 0)
        keep = check_keep(keep, f"{self.name} keep")
        if keep == 1.0:
            return n
        kept = math.floor(keep * n + 0.5)
        b = kept - max_new
        need = self.sinks + self.window
        if b < need:
            low = (need + max_new) / n
            fix = (f"raise keep to at least {low:.3g}" if low <= 1.0
                   else f"give a context longer than {need + max_new} tokens")
            raise InputError(
                f"{self.name} budget round({keep:g} x {n}) - {max_new} generated = {b} entries "
                f"cannot hold the {self.sinks} sinks and the {self.window}-token observation "
                f"window ({need} entries): {fix}, lower max_new, or lower sinks/window"
            )
        return b

    def forced(self, n: int, device=None) -> Tensor:
        """(n,) bool: True at the first `sinks` and the last `window` of n positions."""
        mask = torch.zeros(n, dtype=torch.bool, device=device)
        mask[: self.sinks] = True
        if self.window:
            mask[max(n - self.window, 0):] = True
        return mask

    def n_forced(self, n: int) -> int:
        """How many of n positions `forced` marks (known on the host: no device sync)."""
        s, w = min(self.sinks, n), min(self.window, n)  # [0, s) and [n - w, n)
        return s + w - max(0, s + w - n)  # minus their overlap

    @staticmethod
    def topk_positions(scores: Tensor, budget: int, forced: Tensor, n_forced: int | None = None) -> Tensor:
        """The `budget` positions kept per (batch, KV head), ascending, int64 (B, Hkv, budget).

        scores (B, Hkv, n): higher is kept first. forced: (n,) bool mask, or a 1-D
        tensor of positions, kept whatever their score. The rest go by
        descending score, ties to the lower position (a stable sort), so the
        selection is deterministic on every device.
        """
        if scores.dim() != 3:
            raise InputError(f"scores must be (B, Hkv, n), got shape {tuple(scores.shape)}")
        n = scores.shape[-1]
        if forced.dtype != torch.bool:
            pos = forced.reshape(-1).long().to(scores.device)
            forced = torch.zeros(n, dtype=torch.bool, device=scores.device)
            forced[pos] = True
        if forced.shape != (n,):
            raise InputError(f"forced mask has shape {tuple(forced.shape)}, want ({n},) for {n} scores")
        if n_forced is None:
            n_forced = int(forced.sum())  # a host sync; callers that know it pass n_forced
        _check_int(budget, "budget", 0)
        if not n_forced <= budget <= n:
            raise InputError(
                f"budget {budget} must lie between the {n_forced} forced positions and the "
                f"{n} scored ones: raise keep or lower sinks/window"
            )
        key = scores.float().masked_fill(forced.to(scores.device), math.inf)  # (B, Hkv, n)
        order = torch.sort(key, dim=-1, descending=True, stable=True).indices  # (B, Hkv, n)
        return order[..., :budget].sort(dim=-1).values  # (B, Hkv, budget) int64

    @staticmethod
    def gather(k_cache: Tensor, v_cache: Tensor, idx: Tensor, extra: int = 0,
               check: bool = True, out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """Contiguous buffers (B, Hkv, budget + extra, D) holding the kept entries first.

        k_cache, v_cache (B, Hkv, T, D); idx (B, Hkv, budget) positions in [0, T).
        Slots budget .. budget + extra - 1 are zero, for the tokens to be
        generated. Buffers have the caches' dtype and device. `out`: a (k, v) pair of
        buffers (B, Hkv, >= budget, D) to gather into instead (one copy, no zeroing;
        their slots past budget are left as they are); returned.
        """
        if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
            raise InputError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} "
                             "must both be (B, Hkv, T, D)")
        B, Hkv, T, D = k_cache.shape
        if idx.dim() != 3 or idx.shape[:2] != (B, Hkv):
            raise InputError(f"idx {tuple(idx.shape)} must be (B, Hkv, budget) = ({B}, {Hkv}, budget) "
                             f"for caches {tuple(k_cache.shape)}")
        _check_int(extra, "extra", 0)
        budget = idx.shape[-1]
        # One host sync, outside any captured step: an index past T would gather garbage on CUDA.
        # `check=False` skips it for indices from `topk_positions`, in range by construction.
        if check and budget and (int(idx.min()) < 0 or int(idx.max()) >= T):
            raise InputError(f"idx holds positions outside [0, {T}) of the caches")
        ix = idx.long().to(k_cache.device)[..., None].expand(B, Hkv, budget, D)  # (B, Hkv, budget, D)
        if out is not None:
            if len(out) != 2 or any(b.dim() != 4 or b.shape[:2] != (B, Hkv) or b.shape[2] < budget
                                    or b.shape[3] != D or b.dtype != k_cache.dtype for b in out):
                raise InputError(f"out must be two buffers ({B}, {Hkv}, >= {budget}, {D}) of {k_cache.dtype}")
            for cache, buf in zip((k_cache, v_cache), out, strict=True):
                torch.gather(cache, 2, ix, out=buf[:, :, :budget])
            return out[0], out[1]
        bufs = []
        for cache in (k_cache, v_cache):
            buf = cache.new_zeros(B, Hkv, budget + extra, D)  # (B, Hkv, budget + extra, D)
            buf[:, :, :budget] = torch.gather(cache, 2, ix)
            bufs.append(buf)
        return bufs[0], bufs[1]


SELECTORS: Mapping[str, type[KVSelector]] = Registry("KV selector", {
    "snapkv": "sparsedecode.kv.snapkv:SnapKV",
    "window": "sparsedecode.kv.window:SinkWindow",
})


def get_selector(name: str, **params) -> KVSelector:
    """Build the selector `name` from its fields; an unknown name suggests a close one."""
    return SELECTORS.build(name, **params)


__all__ = ["SELECTORS", "KVSelector", "get_selector"]
