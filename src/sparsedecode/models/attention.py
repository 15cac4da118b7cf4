"""Decode attention behind one interface, chosen by name (ByteCross §4.1, §4.4, App. A).

Every mode of the engine (dense, projection, selection, window, both) reads
its cache through the backend named here, so a speedup is never an artifact
of a slow baseline: §4.4 shows a masked or fused dense baseline inflating the
gain of the same KV window at 128K from 1.29x to 6.92x.

Shapes: q (B, Hq, D) is the one query of the step; k_cache, v_cache
(B, Hkv, T, D) are allocated caches; entries [start, end) are read, where
`end` (and `start`) are int or 0-d/(1,)/(B,) integer tensors so the call can live
inside a captured decode step. Query heads of a GQA group are heads
g*Hq/Hkv .. (g+1)*Hq/Hkv-1 (Hugging Face's repeat_kv order).

Backends:
- split_k: flash-decoding, the KV range split across programs and merged by
  log-sum-exp (kernels/decode_attention.py: our Triton kernel on CUDA, the same
  math in PyTorch on CPU). Capturable with tensor bounds; reads only [start, end).
  Launched with the `AttentionOptions` passed as `options` (the attention layer's
  `kernel_options`); the SDPA backends take none.
  An eager CPU step (never captured) reads its bounds on the host and attends over
  the valid entries only, through PyTorch's fused SDPA where no LSE is needed.
- sdpa_masked: attention over the whole allocated cache with a length mask
  (gpt-fast style): capturable, but reads all T entries whatever the valid
  length. A masked-but-read baseline, labelled as such.
- sdpa_fused: unmasked PyTorch SDPA over the valid slice [start, end): reads
  only valid entries but needs the bounds on the host (see `_fused`); compiled
  with the length as a dynamic size, never inside a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from sparsedecode.errors import InputError
from sparsedecode.kernels.decode_attention import (
    check_inputs,
    merge_lse,
    split_k_attention,
    split_k_ref,
)
from sparsedecode.kernels.options import DEFAULT, AttentionOptions

__all__ = ["BACKENDS", "decode_attention", "get_backend", "merge_lse", "rows_attention", "rows_split_k",
           "split_k_lse"]


def _in_range(end, start, T: int, device) -> Tensor:
    """Boolean (B|1, 1, 1, T) mask of positions in [start, end), from ints or tensors."""
    # Python ints stay ints: a host->device copy is illegal inside graph capture.
    if isinstance(end, Tensor):
        end = end.to(device).reshape(-1, 1, 1, 1)  # (B|1, 1, 1, 1)
    if isinstance(start, Tensor):
        start = start.to(device).reshape(-1, 1, 1, 1)
    pos = torch.arange(T, device=device).view(1, 1, 1, T)
    return (pos >= start) & (pos < end)  # (B|1, 1, 1, T)


def _masked(q, k_cache, v_cache, end, start=0, scale=None):
    """SDPA over all T allocated entries with a length mask (gpt-fast style).

    The G query heads of a KV group ride as G query rows of one SDPA head, so K/V
    are not repeated. Reads the whole cache whatever `end` is. Needs end > start.
    """
    B, Hq, Hkv, G, T, D = check_inputs(q, k_cache, v_cache)
    qg = q.view(B, Hkv, G, D)  # (B, Hkv, G, D)
    mask = _in_range(end, start, T, q.device)  # (B|1, 1, 1, T)
    out = F.scaled_dot_product_attention(qg, k_cache, v_cache, attn_mask=mask, scale=scale)
    return out.reshape(B, Hq, D)  # (B, Hq, D)


def _host_bounds(x, B: int) -> list:
    """Per-row bounds on the host: a tensor is read with `.tolist()` (a device sync); an int,
    or the SymInt torch.compile traces for one, is kept as is (int() would specialize it)."""
    if isinstance(x, Tensor):
        vals = x.reshape(-1).tolist()
        return vals * B if len(vals) == 1 else vals
    return [x] * B


# The SDPA backends of the unmasked (fused) path. PyTorch would pick cuDNN attention for a
# decode token on the H200, which reads a cache at ~360 GB/s against ~3,600 GB/s for its flash
# kernel (records h200/kernels/decode_attention/sdpa_decode_bench-20261130T072336Z.json), and
# cuDNN builds a plan for every new length; flash goes first so the baseline is the primitive at
# its best.
UNMASKED_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _fused(q, k_cache, v_cache, end, start=0, scale=None):
    """Unmasked SDPA over the valid slice [start, end) of each row.

    Slicing needs the bounds on the host. Python-int bounds (the engine passes the
    valid length as `host_len`) compile with torch.compile as a dynamic size, one graph
    for every length; tensor bounds are read with `.tolist()`, a device sync. Either
    way the slice changes shape every step, so no CUDA graph can hold this backend.
    Rows with different bounds are attended one at a time. Needs 0 <= start < end <= T.
    """
    B, Hq, Hkv, G, T, D = check_inputs(q, k_cache, v_cache)
    starts, ends = _host_bounds(start, B), _host_bounds(end, B)
    qg = q.view(B, Hkv, G, D)  # (B, Hkv, G, D)
    with sdpa_kernel(UNMASKED_BACKENDS):
        if B == 1 or (len(set(starts)) == 1 and len(set(ends)) == 1):
            return _sdpa_slice(q, k_cache, v_cache, starts[0], ends[0], scale)
        rows = [
            F.scaled_dot_product_attention(
                qg[b : b + 1], k_cache[b : b + 1, :, s:e], v_cache[b : b + 1, :, s:e], scale=scale,
            )
            for b, (s, e) in enumerate(zip(starts, ends, strict=True))
        ]
    return torch.cat(rows).reshape(B, Hq, D)


def _sdpa_slice(q, k_cache, v_cache, s: int, e: int, scale=None) -> Tensor:
    """Unmasked SDPA of q (B, Hq, D) over cache entries [s, e) of every row: (B, Hq, D)."""
    B, Hq, Hkv, G, T, D = check_inputs(q, k_cache, v_cache)
    out = F.scaled_dot_product_attention(q.view(B, Hkv, G, D), k_cache[:, :, s:e], v_cache[:, :, s:e], scale=scale)
    return out.reshape(B, Hq, D)  # from (B, Hkv, G, D)


def split_k_lse(q, k_cache, v_cache, end, start=0, scale=None, end_offset: int = 0, *,
                options: AttentionOptions = DEFAULT.attention):
    """Split-K attention over [start, end + end_offset) and its log-sum-exp.

    Returns (out (B, Hq, D) in q's dtype, lse (B, Hq) float32, natural log of the
    scaled scores; an empty range gives 0 and -inf). The Triton kernel on CUDA,
    `split_k_ref` elsewhere, launched with `options`. Merge calls over disjoint ranges
    with `merge_lse`.
    """
    if q.is_cuda:
        return split_k_attention(q, k_cache, v_cache, end, start, scale, end_offset=end_offset, options=options)
    valid = _valid_slice(k_cache.shape[2], start, end, end_offset)
    if valid is not None:  # eager CPU: read the valid entries only, not the allocated cache
        lo, hi = valid
        return split_k_ref(q, k_cache[:, :, lo:hi], v_cache[:, :, lo:hi], hi - lo, 0, scale, options=options)
    return split_k_ref(q, k_cache, v_cache, end, start, scale, end_offset=end_offset, options=options)


def _valid_slice(T: int, start, end, end_offset: int) -> tuple[int, int] | None:
    """[lo, hi) on the host where the bounds are one int or one-element tensor each and the
    call runs eagerly (a CPU step is never captured: reading a tensor bound costs nothing);
    None inside torch.compile or for per-row bounds. Without it a CPU decode step attends over
    all T allocated slots (4,096 by default) whatever the length (issue 26: 23% of the step)."""
    if torch.compiler.is_compiling():
        return None
    bounds = []
    for x in (start, end):
        if isinstance(x, Tensor):
            if x.numel() != 1 or x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
                return None  # per-row bounds, or a bad one that the checked path refuses
        bounds.append(int(x))
    lo, hi = max(bounds[0], 0), min(bounds[1] + end_offset, T)
    return (lo, hi) if hi > lo else None


def _split_k(q, k_cache, v_cache, end, start=0, scale=None, end_offset: int = 0, *,
             options: AttentionOptions = DEFAULT.attention):
    if q.is_cuda:
        return split_k_attention(q, k_cache, v_cache, end, start, scale, end_offset=end_offset, options=options)[0]
    valid = _valid_slice(k_cache.shape[2], start, end, end_offset)
    if valid is None:
        return split_k_ref(q, k_cache, v_cache, end, start, scale, end_offset=end_offset, options=options)[0]
    return _sdpa_slice(q, k_cache, v_cache, *valid, scale)  # eager CPU, output only: no LSE to keep


BACKENDS = {"split_k": _split_k, "sdpa_masked": _masked, "sdpa_fused": _fused}


def get_backend(name: str):
    """The attention function registered under `name`."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise InputError(
            f"unknown attention backend '{name}': choose one of {', '.join(BACKENDS)}"
        ) from None


def decode_attention(q, k_cache, v_cache, end, *, start=0, backend="split_k", scale=None, end_offset: int = 0,
                     options: AttentionOptions = DEFAULT.attention):
    """Attention of one query per sequence over cache entries [start, end + end_offset).

    q: (B, Hq, D); k_cache, v_cache: (B, Hkv, T, D). Returns (B, Hq, D) in q's dtype.
    `scale` defaults to 1/sqrt(D). A decode step passes its position tensor as `end` with
    `end_offset=1`: split_k adds the offset in its kernel, so no kernel forms pos + 1 before
    each layer's call (the other backends add it here). `options` (the attention layer's
    `kernel_options`) reaches the split_k kernel; the SDPA backends ignore it.
    """
    fn = get_backend(backend)
    if fn is _split_k:
        return fn(q, k_cache, v_cache, end, start, scale, end_offset, options=options)
    return fn(q, k_cache, v_cache, end + end_offset if end_offset else end, start, scale)


def rows_attention(q, k_cache, v_cache, pos, compact=None, *, slots=None,
                   options: AttentionOptions = DEFAULT.attention):
    """A decode batch's attention, each sequence over its own entries (ByteCross §3.3, App. F):
    row b's query (q (B, Hq, D)) at position pos[b] reads cache entries [0, pos[b] + 1), or, where
    its sequence selected (`compact` = (k_buf, v_buf, offset (B,), selected (B,) bool), the
    per-slot compact buffers of `engine.batch`), its buffer's entries [0, pos[b] - offset[b] + 1)
    and nothing of the cache. `slots` (B,): the cache (and buffer) rows of the B queries (None:
    rows 0..B-1). Returns (B, Hq, D).

    Captured (CUDA, or under torch.compile): two split-K calls with per-row bounds, a row's bound
    in the source it does not read being 0 (an empty range reads no entry), merged by log-sum-exp;
    with no compact buffers, one call. Eager CPU: each row through PyTorch's SDPA over its valid
    slice, the same call a batch-1 step makes, so batched and single decoding agree bit for bit."""
    if q.is_cuda or torch.compiler.is_compiling():
        if slots is not None:
            raise InputError("a captured decode batch reads cache rows 0..B-1: run every slot (slots=None)")
        return rows_split_k(q, k_cache, v_cache, pos, compact, options=options)
    ends = pos.tolist()
    idx = list(range(len(ends))) if slots is None else slots.tolist()
    sel = [False] * k_cache.shape[0] if compact is None else compact[3].tolist()
    offs = None if compact is None else compact[2].tolist()
    rows = []
    for b, (e, r) in enumerate(zip(ends, idx, strict=True)):
        if sel[r]:
            rows.append(_sdpa_slice(q[b:b + 1], compact[0][r:r + 1], compact[1][r:r + 1], 0, e - offs[r] + 1))
        else:
            rows.append(_sdpa_slice(q[b:b + 1], k_cache[r:r + 1], v_cache[r:r + 1], 0, e + 1))
    return torch.cat(rows)


def rows_split_k(q, k_cache, v_cache, pos, compact=None, *, options: AttentionOptions = DEFAULT.attention):
    """`rows_attention` with every bound on the device (capturable): split-K over each row's
    cache entries [0, pos + 1), or, with `compact`, one split-K call over the cache and one over
    the compact buffers, a row's bound in the source it does not read being 0 (an empty range
    reads no entry), merged by log-sum-exp. Rows 0..B-1 of the caches and buffers."""
    if compact is None:
        return split_k_lse(q, k_cache, v_cache, pos, end_offset=1, options=options)[0]
    ck, cv, offset, sel = compact
    zero = torch.zeros_like(pos)
    o1, l1 = split_k_lse(q, k_cache, v_cache, torch.where(sel, zero, pos + 1), options=options)
    o2, l2 = split_k_lse(q, ck, cv, torch.where(sel, pos - offset + 1, zero), options=options)
    return merge_lse([o1, o2], [l1, l2])[0]
