"""RoPE, the cache write and split-K attention of one decode token in one launch (ByteCross §4.1: the
decode step's fixed costs).

`rope_attention` runs the split kernel of `kernels.decode_attention` with its ROPE constexpr on:
each split program rotates its query heads itself, and the program whose chunk holds the token's
position adds the new entry to its softmax and stores it in the caches. Where `rope_cache` and
then `split_k_attention` take two launches and a trip of the rotated queries through memory, this
takes one; the decoder's one-token step on the plain cache uses it wherever it can (decision log
docs/kernels/decode_attention.md#rope-in-attention).

`rope_attention_ref` is the same in plain PyTorch: `rope_cache_ref`, then `split_k_ref`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from sparsedecode.errors import InputError
from sparsedecode.kernels.decode_attention import (
    _check_kernel_args,
    _check_options,
    _interpreting,
    _launch,
    split_k_ref,
)
from sparsedecode.kernels.options import DEFAULT, AttentionOptions
from sparsedecode.kernels.rope_cache import _check as check_rope
from sparsedecode.kernels.rope_cache import rope_cache_ref

try:
    import triton
except ImportError:
    triton = None


@torch.library.custom_op("sparsedecode::rope_split_k_decode", mutates_args=("k_cache", "v_cache"))
def _rope_split_k_op(
    q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k_cache: Tensor, v_cache: Tensor,
    scale: float, num_splits: int, block_n: int, num_warps: int, num_stages: int, programs_per_sm: int,
    min_split_keys: int,
) -> tuple[Tensor, Tensor]:
    # Writes the new entry at pos into the caches (declared), reads [0, pos + 1).
    return _launch(q, k_cache, v_cache, None, pos, None, 0, 1, scale, num_splits, block_n, num_warps,
                   num_stages, True, programs_per_sm, min_split_keys, rope=(k, v, cos, sin))


@_rope_split_k_op.register_fake
def _(q, k, v, cos, sin, pos, k_cache, v_cache, *rest):
    B, D = q.shape[0], k_cache.shape[-1]
    return q.new_empty(B, q.shape[1] // D, D), q.new_empty(B, q.shape[1] // D, dtype=torch.float32)


def rope_attention_ref(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k_cache: Tensor,
                       v_cache: Tensor, scale: float | None = None, *,
                       options: AttentionOptions = DEFAULT.attention) -> tuple[Tensor, Tensor]:
    """`rope_attention` in plain PyTorch: `rope_cache_ref`, then `split_k_ref` over [0, pos + 1)."""
    _check_options(options)
    q_rot = rope_cache_ref(q, k, v, cos, sin, pos, k_cache, v_cache)  # (B, Hq, D); the caches hold the entry
    return split_k_ref(q_rot, k_cache, v_cache, pos, scale=scale, end_offset=1, options=options)


def rope_attention(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k_cache: Tensor,
                   v_cache: Tensor, scale: float | None = None, num_splits: int | None = None,
                   config: tuple[int, int, int] | None = None, *,
                   options: AttentionOptions = DEFAULT.attention) -> tuple[Tensor, Tensor]:
    """One decode token per sequence, RoPE to attention output in one launch: q (B, Hq * D) and
    k (B, Hkv * D) as the projection left them are rotated by the angles of position pos (a
    1-element integer tensor, read on the device) in the tables cos, sin (T, D) of
    `models.rope.rope_tables`; the rotated k and v (B, Hkv * D) go to position pos of k_cache,
    v_cache (B, Hkv, T, D), and the rotated queries attend over [0, pos + 1).

    The one program whose chunk holds pos leaves that cache row (the last step's) out of its
    loop, adds the new entry to its softmax after the loop and stores the entry (no program of
    the launch reads pos from memory). The rotation is `rope_cache`'s: float32, rounded once to
    the cache dtype. `num_splits`, `config` and `options` as in `split_k_attention`. Returns
    (out (B, Hq, D), lse (B, Hq) float32) as `split_k_attention` does. CUDA, or CPU under
    TRITON_INTERPRET=1; `rope_attention_ref` elsewhere.
    """
    B, Hq, Hkv, D = check_rope(q, k, v, cos, sin, pos, k_cache, v_cache)
    if Hq % Hkv:
        raise InputError(f"{Hq} query heads are not a multiple of {Hkv} KV heads")
    _check_kernel_args(D, num_splits, options)
    if triton is None or not (q.is_cuda or _interpreting()):
        raise InputError("the rope_attention kernel runs on CUDA (or on CPU with TRITON_INTERPRET=1) with Triton; "
                         "use rope_attention_ref")
    block_n, num_warps, num_stages = config or (0, 0, 0)
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    return _rope_split_k_op(q, k, v, cos, sin, pos.reshape(1), k_cache, v_cache, float(scale), num_splits or 0,
                            block_n, num_warps, num_stages, options.programs_per_sm, options.min_split_keys or 0)


__all__ = ["rope_attention", "rope_attention_ref"]
