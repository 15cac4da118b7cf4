"""RoPE of one decode token's queries and keys, and its keys and values stored in the cache, in one
launch (ByteCross §4.1: the decode step's fixed costs).

A compiled decode step ran this as three small kernels per layer on the H200 (the queries'
rotation, the keys' rotation with their cache write, and the values' cache write), 3.8 us a
layer and 0.12 ms a step at 2K for llama-3.1-8b dims, in the dense and the sparse step alike
(profile in records h200/kernels/sparse_gemv/sparse_gemv_20261130T1738Z_fused_norms). Here one
program handles one head: a query head is rotated into the output, a key head rotated into its
cache row, a value head copied into its cache row. The position and the tables' rows are read on
the device, so the launch can be captured in a CUDA graph and replayed at every position, and no
gather of the rows runs before it.

The rotation is the 'rotate_half' convention of `models.rope` (x' = x cos + rotate_half(x)
sin), computed in float32 and rounded once to the cache dtype, as the compiled step rounds it
(Inductor computes the pointwise chain in float32); eager PyTorch rounds each product, so
the two differ by at most a unit in the last place.

`rope_cache_ref` is the same in plain PyTorch (the CPU path and the tests' oracle).
"""

from __future__ import annotations

import torch
from torch import Tensor

from sparsedecode.errors import InputError
from sparsedecode.kernels.sparse_gemv import _interpreting, _pow2

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def usable(x: Tensor) -> bool:
    """Whether a decode step on x's device runs the one-launch kernels (`rope_cache`,
    `kernels.rope_attention`): Triton installed, and CUDA (or TRITON_INTERPRET=1). The decoder
    uses them wherever this holds (docs/kernels/decode_attention.md#rope-cache)."""
    return triton is not None and (x.is_cuda or _interpreting())


def _check(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k_cache: Tensor,
           v_cache: Tensor) -> tuple[int, int, int, int]:
    """(B, Hq, Hkv, D) of a valid call, or a clear error."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise InputError(f"k_cache and v_cache must be contiguous (B, Hkv, T, D) of one shape; got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    B, Hkv, _, D = k_cache.shape
    if D % 2:
        raise InputError(f"RoPE needs an even head dim; got {D}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 2 or t.shape[0] != B or t.shape[1] % D or t.stride(1) != 1:
            raise InputError(f"{name} must be (B={B}, heads * {D}) with unit stride along its last dim (one "
                             f"token per sequence); got {tuple(t.shape)} with strides {t.stride()}")
        if t.dtype != k_cache.dtype or t.device != k_cache.device:
            raise InputError(f"{name} must be {k_cache.dtype} on {k_cache.device} like the cache; got "
                             f"{t.dtype} on {t.device}")
    if k.shape[1] != Hkv * D or v.shape[1] != Hkv * D:
        raise InputError(f"k and v must hold the cache's {Hkv} heads of {D}; got {k.shape[1]} and {v.shape[1]} "
                         "columns")
    if cos.dim() != 2 or cos.shape[1] != D or cos.shape != sin.shape or not (cos.is_contiguous() and sin.is_contiguous()):
        raise InputError(f"cos and sin must be contiguous (T, {D}) tables of one shape (models.rope.rope_tables); "
                         f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.dtype != k_cache.dtype or sin.dtype != k_cache.dtype or cos.device != k_cache.device:
        raise InputError(f"cos and sin must be {k_cache.dtype} on {k_cache.device} like the cache; got "
                         f"{cos.dtype} on {cos.device}")
    if pos.numel() != 1 or pos.dtype not in (torch.int32, torch.int64):
        raise InputError(f"pos must be the token's position as a 1-element integer tensor; got {pos.dtype} "
                         f"{tuple(pos.shape)}")
    return B, q.shape[1] // D, Hkv, D


def rope_cache_ref(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k_cache: Tensor,
                   v_cache: Tensor) -> Tensor:
    """`rope_cache` in plain PyTorch: the same float32 rotation, rounded once."""
    B, Hq, Hkv, D = _check(q, k, v, cos, sin, pos, k_cache, v_cache)
    half = D // 2

    def rotate(x: Tensor, heads: int) -> Tensor:  # (B, heads * D) -> (B, heads, D), float32, rounded once
        xf = x.reshape(B, heads, D).float()
        rot = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
        return (xf * c + rot * s).to(x.dtype)

    p = pos.reshape(1).long()
    c, s = cos[p].float(), sin[p].float()  # (1, D): the token's rows
    k_cache.index_copy_(2, p, rotate(k, Hkv)[:, :, None])
    v_cache.index_copy_(2, p, v.reshape(B, Hkv, 1, D))
    return rotate(q, Hq)


if triton is not None:

    @triton.jit
    def _rope_cache_kernel(Q, K, V, Cos, Sin, Pos, Out, Kc, Vc, stride_qb, stride_kb, stride_vb, stride_cb,
                           stride_ch, stride_ct, HQ, HKV, D: tl.constexpr, HALF: tl.constexpr,
                           BLOCK: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)  # query heads, then key heads, then value heads
        offs = tl.arange(0, BLOCK)
        m = offs < HALF
        pos = tl.load(Pos).to(tl.int64)
        if h < HQ + HKV:
            if h < HQ:
                src = Q + b * stride_qb + h * D
                dst = Out + (b * HQ + h) * D
            else:
                src = K + b * stride_kb + (h - HQ) * D
                dst = Kc + b * stride_cb + (h - HQ) * stride_ch + pos * stride_ct
            lo = tl.load(src + offs, mask=m, other=0.0).to(tl.float32)
            hi = tl.load(src + HALF + offs, mask=m, other=0.0).to(tl.float32)
            row = pos * D  # the token's rows of the tables
            c_lo = tl.load(Cos + row + offs, mask=m, other=0.0).to(tl.float32)
            c_hi = tl.load(Cos + row + HALF + offs, mask=m, other=0.0).to(tl.float32)
            s_lo = tl.load(Sin + row + offs, mask=m, other=0.0).to(tl.float32)
            s_hi = tl.load(Sin + row + HALF + offs, mask=m, other=0.0).to(tl.float32)
            # rotate_half([lo, hi]) = [-hi, lo]
            tl.store(dst + offs, (lo * c_lo - hi * s_lo).to(dst.dtype.element_ty), mask=m)
            tl.store(dst + HALF + offs, (hi * c_hi + lo * s_hi).to(dst.dtype.element_ty), mask=m)
        else:
            src = V + b * stride_vb + (h - HQ - HKV) * D
            dst = Vc + b * stride_cb + (h - HQ - HKV) * stride_ch + pos * stride_ct
            tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)
            tl.store(dst + HALF + offs, tl.load(src + HALF + offs, mask=m), mask=m)


@torch.library.custom_op("sparsedecode::rope_cache", mutates_args=("k_cache", "v_cache"))
def _rope_cache_op(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k_cache: Tensor,
                   v_cache: Tensor) -> Tensor:
    B, Hkv, _, D = k_cache.shape
    Hq = q.shape[1] // D
    out = torch.empty(B, Hq, D, device=q.device, dtype=q.dtype)
    _rope_cache_kernel[(B, Hq + 2 * Hkv)](
        q, k, v, cos, sin, pos, out, k_cache, v_cache, q.stride(0), k.stride(0), v.stride(0), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), Hq, Hkv, D=D, HALF=D // 2, BLOCK=_pow2(D // 2), num_warps=1)
    return out


@_rope_cache_op.register_fake
def _(q, k, v, cos, sin, pos, k_cache, v_cache):
    D = k_cache.shape[-1]
    return q.new_empty(q.shape[0], q.shape[1] // D, D)


def rope_cache(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k_cache: Tensor,
               v_cache: Tensor) -> Tensor:
    """One decode token per sequence: q (B, Hq * D) and k (B, Hkv * D) rotated by the angles of
    position pos (a 1-element integer tensor, read on the device) in the tables cos, sin (T, D)
    of `models.rope.rope_tables`, k and v (B, Hkv * D) stored at position pos of k_cache,
    v_cache (B, Hkv, T, D); returns the rotated queries (B, Hq, D). One launch (CUDA, or CPU under
    TRITON_INTERPRET=1); `rope_cache_ref` elsewhere."""
    _check(q, k, v, cos, sin, pos, k_cache, v_cache)
    if triton is None or not (q.is_cuda or _interpreting()):
        raise InputError("the rope_cache kernel runs on CUDA (or on CPU with TRITON_INTERPRET=1) with Triton; "
                         "use rope_cache_ref")
    return _rope_cache_op(q, k, v, cos, sin, pos, k_cache, v_cache)
