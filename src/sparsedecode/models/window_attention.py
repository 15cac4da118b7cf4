"""Sink+recent window attention read in place (ByteCross App. A, §4.4).

The KV window keeps the first `sinks` cache entries (attention sinks) and the
`recent` entries before the current length. ByteCross reads it without copying
a single entry: "the window reads the full cache in place. Its kernel call
starts at the first retained recent entry through a left-padding offset, and
the four sink tokens form a second call over the cache head merged by
log-sum-exp" (App. A). Here the two calls are the split-K decode attention
(kernels/decode_attention.py) over

    sinks   [0, min(sinks, end))
    recent  [max(sinks, end - recent), end)

each returning its output and log-sum-exp, combined by `merge_lse`. Softmax
over a union of disjoint ranges is exactly the LSE merge of softmax over each,
so the result equals attention over a gathered copy of the retained entries,
while a step reads only those entries from the allocated cache.

Choices the paper leaves open:
- Overlap. While end <= sinks + recent the two ranges would overlap; the
  recent range then starts at `sinks`, so no entry is counted twice and the
  window is the whole valid prefix. If end < sinks the recent range is empty
  (start > end gives an empty read: output 0, LSE -inf) and the sink range
  alone covers [0, end).
- Bounds on the device. With a tensor `end` (what the captured decode step
  passes, so a CUDA graph follows the length) the sink end and the recent
  start are derived from it by two elementwise ops on its device: no host
  sync, no Python branch on tensor values, so the call captures and compiles
  with fullgraph. Python-int bounds stay ints (baked into a graph, as in
  decode_attention).
- sinks == 0 or recent == 0 (static ints) drop that call; at least one entry
  must be kept.

Every attention path of the engine has a window here, so the attention-path
comparison (§4.4, App. D Table 11: the same window under masked, fused and
split-K attention) runs the same policy on each:
- split_k: the two in-place calls merged by LSE, the only path that reads just
  the window. split_k_kernel / split_k_ref force the Triton kernel (CUDA, or CPU
  under TRITON_INTERPRET=1) or the PyTorch reference, for tests and benchmarks.
- sdpa_masked: one SDPA over all T allocated entries with the window as mask
  (gpt-fast style): capturable, but reads the whole cache.
- sdpa_fused: unmasked SDPA over a torch.cat copy of each row's two slices:
  needs the bounds on the host (the engine's `host_len`, or a sync on a tensor;
  never in a CUDA graph) and copies the window, a baseline labelled as such. Neither SDPA path returns an LSE.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import sdpa_kernel

from sparsedecode.errors import InputError
from sparsedecode.kernels.decode_attention import (
    check_inputs,
    merge_lse,
    split_k_attention,
    split_k_ref,
)
from sparsedecode.kernels.options import DEFAULT, AttentionOptions
from sparsedecode.models.attention import UNMASKED_BACKENDS, _host_bounds, _in_range, split_k_lse

__all__ = ["WINDOW_BACKENDS", "window_attention", "window_bounds"]


def _check_sizes(sinks, recent) -> None:
    for name, x in (("sinks", sinks), ("recent", recent)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise InputError(f"{name} must be a Python int >= 0 (a static window size); got {x!r}")
    if sinks + recent == 0:
        raise InputError("a window with sinks=0 and recent=0 keeps nothing: keep at least one entry")


def window_bounds(end, sinks: int, recent: int):
    """(sink_end, recent_start) of the window at valid length `end` (int or integer tensor).

    Sinks are [0, sink_end) with sink_end = min(sinks, end); recent entries are
    [recent_start, end) with recent_start = max(sinks, end - recent), so the two never
    overlap. Tensors in give tensors of end's shape and device out (no host sync).
    """
    _check_sizes(sinks, recent)
    if isinstance(end, Tensor):
        return end.clamp_max(sinks), (end - recent).clamp_min(sinks)
    # no int(end): a SymInt from torch.compile stays symbolic (int() would specialize it)
    return min(sinks, end), max(sinks, end - recent)


def _in_place(attend, q, k_cache, v_cache, end, sinks, recent, scale, options):
    """Two calls of an LSE backend, fn(q, k, v, end, start, scale, options=) -> (out, lse), merged."""
    sink_end, recent_start = window_bounds(end, sinks, recent)
    parts = []  # [(out (B, Hq, D), lse (B, Hq))]
    if sinks:
        parts.append(attend(q, k_cache, v_cache, sink_end, 0, scale, options=options))
    if recent:
        parts.append(attend(q, k_cache, v_cache, end, recent_start, scale, options=options))
    if len(parts) == 1:
        return parts[0]
    return merge_lse([p[0] for p in parts], [p[1] for p in parts])


def _masked(q, k_cache, v_cache, end, sinks, recent, scale, options=None):
    """SDPA over all T entries, masked to the window; a row needs end >= 1."""
    B, Hq, Hkv, G, T, D = check_inputs(q, k_cache, v_cache)
    sink_end, recent_start = window_bounds(end, sinks, recent)
    mask = _in_range(sink_end, 0, T, q.device) | _in_range(end, recent_start, T, q.device)
    qg = q.view(B, Hkv, G, D)  # (B, Hkv, G, D): a KV group's heads ride as query rows
    out = F.scaled_dot_product_attention(qg, k_cache, v_cache, attn_mask=mask, scale=scale)
    return out.reshape(B, Hq, D), None  # (B, Hq, D)


def _gathered(q, k_cache, v_cache, end, sinks, recent, scale, options=None):
    """Unmasked SDPA over a copy of each row's window (host bounds); a row needs end >= 1."""
    B, Hq, Hkv, G, T, D = check_inputs(q, k_cache, v_cache)
    qg = q.view(B, Hkv, G, D)  # (B, Hkv, G, D)
    rows = []
    for b, e in enumerate(_host_bounds(end, B)):  # a tensor: .tolist(), a device sync
        sink_end, recent_start = window_bounds(e, sinks, recent)
        k = torch.cat([k_cache[b : b + 1, :, :sink_end], k_cache[b : b + 1, :, recent_start:e]], 2)
        v = torch.cat([v_cache[b : b + 1, :, :sink_end], v_cache[b : b + 1, :, recent_start:e]], 2)
        with sdpa_kernel(UNMASKED_BACKENDS):  # flash first: see models.attention.UNMASKED_BACKENDS
            rows.append(F.scaled_dot_product_attention(qg[b : b + 1], k, v, scale=scale))  # (1, Hkv, G, D)
    return torch.cat(rows).reshape(B, Hq, D), None


# name -> fn(q, k_cache, v_cache, end, sinks, recent, scale, options) -> (out, lse or None), options
# the split-K kernel's AttentionOptions (the SDPA paths ignore them); every name of
# models.attention.BACKENDS is here, so any engine path can run the window.
WINDOW_BACKENDS = {
    "split_k": functools.partial(_in_place, split_k_lse),  # kernel on CUDA, split_k_ref elsewhere
    "split_k_kernel": functools.partial(_in_place, split_k_attention),
    "split_k_ref": functools.partial(_in_place, split_k_ref),
    "sdpa_masked": _masked,
    "sdpa_fused": _gathered,
}


def window_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, end, sinks: int, recent: int,
    backend: str = "split_k", *, scale: float | None = None, return_lse: bool = False,
    options: AttentionOptions = DEFAULT.attention,
):
    """Attention of one query per sequence over the sink+recent window.

    q (B, Hq, D); k_cache, v_cache (B, Hkv, T, D); `end` the valid length, an int or a
    0-d/(1,)/(B,) integer tensor (per-row lengths). The window is [0, min(sinks, end))
    and [max(sinks, end - recent), end); with backend "split_k" (or split_k_kernel,
    split_k_ref) they are read in place by two calls and merged by log-sum-exp
    (ByteCross App. A); see the module docstring for the SDPA baselines. `scale`
    defaults to 1/sqrt(D). Returns out (B, Hq, D) in q's dtype, or (out, lse) with lse
    (B, Hq) float32 (natural log of the scaled scores) if `return_lse` (split-K only).
    On the split-K paths a row with end <= 0 gives output 0 and LSE -inf. `options` (the
    attention layer's `kernel_options`) reaches the split-K kernel.
    """
    try:
        fn = WINDOW_BACKENDS[backend]
    except KeyError:
        raise InputError(
            f"unknown window backend '{backend}': choose one of {', '.join(WINDOW_BACKENDS)}"
        ) from None
    _check_sizes(sinks, recent)
    out, lse = fn(q, k_cache, v_cache, end, sinks, recent, scale, options)
    if return_lse and lse is None:
        raise InputError(f"backend '{backend}' returns no LSE: use a split_k backend for return_lse")
    return (out, lse) if return_lse else out
