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


@torch.library.custom_op("sparsedecode::rope_split_k_decode_compact",
                         mutates_args=("k_buf", "v_buf", "k_cache", "v_cache"))
def _rope_split_k_compact_op(
    q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k_buf: Tensor, v_buf: Tensor,
    offset: Tensor, k_cache: Tensor, v_cache: Tensor, scale: float, num_splits: int, block_n: int,
    num_warps: int, num_stages: int, programs_per_sm: int, min_split_keys: int,
) -> tuple[Tensor, Tensor]:
    # Writes the new entry at slot pos - offset of the buffers and at pos of the caches (declared),
    # reads the buffers' [0, pos - offset + 1).
    return _launch(q, k_buf, v_buf, None, pos, None, 0, 1, scale, num_splits, block_n, num_warps, num_stages,
                   True, programs_per_sm, min_split_keys, rope=(k, v, cos, sin), full=(offset, k_cache, v_cache))


@_rope_split_k_compact_op.register_fake
def _(q, k, v, cos, sin, pos, k_buf, v_buf, *rest):
    B, D = q.shape[0], k_buf.shape[-1]
    return q.new_empty(B, q.shape[1] // D, D), q.new_empty(B, q.shape[1] // D, dtype=torch.float32)


def rope_attention_ref(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k_cache: Tensor,
                       v_cache: Tensor, scale: float | None = None, *,
                       options: AttentionOptions = DEFAULT.attention,
                       compact: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """`rope_attention` in plain PyTorch: `rope_cache_ref`, then `split_k_ref` over [0, pos + 1);
    with `compact` = (k_buf, v_buf, offset), the entry also goes to slot pos - offset of the
    buffers, and the attention reads the buffers' [0, pos - offset + 1)."""
    _check_options(options)
    q_rot = rope_cache_ref(q, k, v, cos, sin, pos, k_cache, v_cache)  # (B, Hq, D); the caches hold the entry
    if compact is None:
        return split_k_ref(q_rot, k_cache, v_cache, pos, scale=scale, end_offset=1, options=options)
    k_buf, v_buf, offset = _check_compact(compact, k_cache)
    p = pos.reshape(1).long()
    slot = p - offset.reshape(1).long()
    k_buf.index_copy_(2, slot, k_cache.index_select(2, p))
    v_buf.index_copy_(2, slot, v_cache.index_select(2, p))
    return split_k_ref(q_rot, k_buf, v_buf, slot, scale=scale, end_offset=1, options=options)


def _check_compact(compact, k_cache: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(k_buf, v_buf, offset) of a compact buffer beside the cache k_cache (B, Hkv, T, D)."""
    if not isinstance(compact, tuple) or len(compact) != 3:
        raise InputError("compact must be a (k_buf, v_buf, offset) tuple")
    k_buf, v_buf, offset = compact
    B, Hkv, _, D = k_cache.shape
    if (k_buf.shape != v_buf.shape or k_buf.dim() != 4 or k_buf.shape[:2] != (B, Hkv) or k_buf.shape[3] != D
            or k_buf.dtype != k_cache.dtype or k_buf.device != k_cache.device):
        raise InputError(f"compact buffers {tuple(k_buf.shape)} and {tuple(v_buf.shape)} must both be "
                         f"({B}, {Hkv}, slots, {D}) {k_cache.dtype} on {k_cache.device}, like the cache")
    if offset.numel() != 1 or offset.dtype not in (torch.int32, torch.int64) or offset.device != k_cache.device:
        raise InputError(f"the compact offset must be a 1-element integer tensor on {k_cache.device}")
    return k_buf, v_buf, offset


def _check_full_strides(k_cache: Tensor, v_cache: Tensor) -> None:
    if k_cache.stride() != v_cache.stride():  # the kernel stores both at one set of strides
        raise InputError(f"k_cache and v_cache must share strides beside a compact buffer, got "
                         f"{k_cache.stride()} and {v_cache.stride()}")


def rope_attention(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k_cache: Tensor,
                   v_cache: Tensor, scale: float | None = None, num_splits: int | None = None,
                   config: tuple[int, int, int] | None = None, *,
                   options: AttentionOptions = DEFAULT.attention,
                   compact: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
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

    `compact` = (k_buf, v_buf, offset): decode reads a KV selection's compact buffer (B, Hkv,
    slots, D) instead of the cache (ByteCross App. A: the kept entries gathered once, each step
    appending its own). The entry then goes to slot pos - offset of the buffers as well as to
    position pos of the caches (a later turn can score it), and the queries attend over the
    buffers' [0, pos - offset + 1); the angles stay those of pos. Still one launch, where the
    compiled step took two (the rotation with both writes, then the attention).
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
    if compact is not None:
        k_buf, v_buf, offset = _check_compact(compact, k_cache)
        _check_full_strides(k_cache, v_cache)
        return _rope_split_k_compact_op(q, k, v, cos, sin, pos.reshape(1), k_buf, v_buf, offset.reshape(1), k_cache,
                                        v_cache, float(scale), num_splits or 0, block_n, num_warps, num_stages,
                                        options.programs_per_sm, options.min_split_keys or 0)
    return _rope_split_k_op(q, k, v, cos, sin, pos.reshape(1), k_cache, v_cache, float(scale), num_splits or 0,
                            block_n, num_warps, num_stages, options.programs_per_sm, options.min_split_keys or 0)


__all__ = ["rope_attention", "rope_attention_ref"]
