"""SnapKV-style scored selection: keep the entries the last prompt tokens attend to.

Li et al., 2024, 'SnapKV: LLM Knows What You are Looking for Before
Generation', as ByteCross uses it for its KV branch (§4.1; App. A 'Scored
selection'; App. G for the two-turn 'kept' and 'rescored' uses). Once, after
a dense prefill of n tokens, the caller re-runs the last W = `window` prompt
tokens and hands their post-RoPE queries here. Per KV head:

1. each query head's softmax attention over the n cached keys, scaled by
   1/sqrt(D), with the causal mask inside the window (window query i sits at
   position n - W + i and sees keys <= n - W + i), in float32;
2. summed over the W queries, then over the G query heads of the KV head's
   GQA group (query head h belongs to KV head h // G, Hugging Face's
   repeat_kv order);
3. pooled over positions, width `pool_width`, stride 1, same length: 'avg'
   (avg_pool1d, padding width // 2, padding not counted) or 'max';
4. the first `sinks` and the last W positions forced in, the rest by score up
   to the budget of the base (round(keep x n) - max_new).

Choices the paper leaves open, written down here: the window's own positions
are scored and pooled like the rest (SnapKV pools only the prefix before the
window; the window is forced in either way, so only the pooled scores of the
last width // 2 prefix positions differ); the pooling width must be odd so
the pooled scores stay aligned with their positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from sparsedecode.errors import InputError
from sparsedecode.kernels.snapkv_scores import scores_ref, snapkv_scores
from sparsedecode.kernels.snapkv_scores import usable as snapkv_kernels_usable
from sparsedecode.kv.select import KVSelector, _check_int

POOL_KINDS = ("avg", "max")
SCORE_ELEMENTS = 2**28  # float32 logits scored at once (1 GiB)


@dataclass
class SnapKV(KVSelector):
    """window: observation queries W (the last W prompt tokens, >= 1);
    pool_width: odd width of the pooling over positions (1: none);
    pool_kind: 'avg' or 'max'; sinks: leading positions always kept."""

    window: int = 64
    pool_width: int = 7
    pool_kind: str = "avg"
    sinks: int = 4
    name: ClassVar[str] = "snapkv"

    def __post_init__(self):
        super().__post_init__()
        _check_int(self.window, "snapkv window", 1)
        if _check_int(self.pool_width, "snapkv pool_width", 1) % 2 == 0:
            raise InputError(f"snapkv pool_width must be odd so pooled scores stay on their "
                             f"positions, got {self.pool_width}: use {self.pool_width + 1}")
        if self.pool_kind not in POOL_KINDS:
            raise InputError(f"snapkv pool_kind must be 'avg' or 'max', got {self.pool_kind!r}")

    def scores(self, q_obs: Tensor, k_cache: Tensor, n: int) -> Tensor:
        """Pooled attention score of each of the n cached positions, (B, Hkv, n) float32.

        q_obs (B, Hq, W, D): post-RoPE queries of prompt positions n - W .. n - 1
        (1 <= W <= n); k_cache (B, Hkv, T >= n, D): post-RoPE keys, the first n valid.
        On CUDA (operands of one dtype, bf16, fp16 or fp32) the two Triton launches of `kernels.snapkv_scores`;
        elsewhere its float32 PyTorch reference, in slices of at most SCORE_ELEMENTS logits.
        """
        _check_shapes(q_obs, k_cache, n)
        if snapkv_kernels_usable(q_obs, k_cache):
            return self.pool(snapkv_scores(q_obs, k_cache, n))  # two launches, no logits stored
        return self.pool(scores_ref(q_obs, k_cache, n, SCORE_ELEMENTS))

    def pool(self, s: Tensor) -> Tensor:
        """Same-length 1-D pooling over positions of s (B, Hkv, n)."""
        w = self.pool_width
        if w == 1:
            return s
        if self.pool_kind == "avg":
            return F.avg_pool1d(s, w, stride=1, padding=w // 2, count_include_pad=False)
        return F.max_pool1d(s, w, stride=1, padding=w // 2)

    def select(self, q_obs: Tensor, k_cache: Tensor, n: int, keep: float, max_new: int) -> Tensor:
        """Kept positions (B, Hkv, budget) int64, ascending: sinks, the last W, then by score.

        q_obs must hold W = min(window, n) queries. keep 1.0 returns every
        position 0 .. n - 1 (dense) without scoring.
        """
        B, Hq, W, D, Hkv = _check_shapes(q_obs, k_cache, n)
        if W != min(self.window, n):
            raise InputError(
                f"q_obs holds {W} observation queries but the snapkv window is {self.window}: "
                f"re-run the last {min(self.window, n)} prompt tokens, or set window={W}"
            )
        budget = self.budget(n, keep, max_new)
        if budget == n:
            return torch.arange(n, device=k_cache.device).expand(B, Hkv, n).contiguous()
        return self.topk_positions(self.scores(q_obs, k_cache, n), budget,
                                   self.forced(n, k_cache.device), n_forced=self.n_forced(n))


def _check_shapes(q_obs: Tensor, k_cache: Tensor, n: int) -> tuple[int, int, int, int, int]:
    """Validate the scoring operands; returns (B, Hq, W, D, Hkv)."""
    if q_obs.dim() != 4 or k_cache.dim() != 4:
        raise InputError(f"snapkv wants q_obs (B, Hq, W, D) and k_cache (B, Hkv, T, D); got "
                         f"q_obs {tuple(q_obs.shape)} and k_cache {tuple(k_cache.shape)}")
    B, Hq, W, D = q_obs.shape
    Bk, Hkv, T, Dk = k_cache.shape
    if Bk != B or Dk != D:
        raise InputError(f"q_obs {tuple(q_obs.shape)} does not match k_cache {tuple(k_cache.shape)} "
                         "in batch or head dim: pass the queries and keys of the same layer")
    if Hkv == 0 or Hq % Hkv:
        raise InputError(f"{Hq} query heads are not a multiple of {Hkv} KV heads: pass all query "
                         "heads of the layer")
    _check_int(n, "context n", 1)
    if n > T:
        raise InputError(f"context n = {n} exceeds the {T} positions of k_cache")
    if not 1 <= W <= n:
        raise InputError(f"q_obs holds {W} observation queries; want 1 .. n = {n}")
    return B, Hq, W, D, Hkv


__all__ = ["POOL_KINDS", "SnapKV"]
