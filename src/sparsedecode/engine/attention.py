"""Decode attention behind one interface, chosen by name (ByteCross §4.1, §4.4, App. A).

Every mode of the engine (dense, projection, selection, window, both) reads
its cache through the backend named here, so a speedup is never an artifact
of a slow baseline.

Shapes: q (B, Hq, D) is the one query of the step; k_cache, v_cache
(B, Hkv, T, D) are allocated caches; entries [start, end) are read, where
`end` (and `start`) are int or 0-d/(B,) integer tensors so the call can live
inside a captured decode step. Query heads of a GQA group are heads
g*Hq/Hkv .. (g+1)*Hq/Hkv-1 (Hugging Face's repeat_kv order).

Backends:
- split_k: flash-decoding, the KV range split across programs and merged by
  log-sum-exp (our Triton kernel on CUDA, the same math in PyTorch on CPU).
- sdpa_masked: attention over the whole allocated cache with a length mask
  (gpt-fast style): reads all T entries whatever the valid length.
- sdpa_fused: unmasked PyTorch SDPA over the valid slice [start, end).

NOTE: placeholder implementation in plain PyTorch; the split-K kernel
replaces `_split_k` (see kernels/decode_attention.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from sparsedecode.errors import InputError


def _bounds(end, start, T, device):
    end = torch.as_tensor(end, device=device).reshape(-1, 1, 1)  # (B|1, 1, 1)
    start = torch.as_tensor(start, device=device).reshape(-1, 1, 1)
    pos = torch.arange(T, device=device).view(1, 1, T)
    return (pos >= start) & (pos < end)  # (B|1, 1, T)


def _masked(q, k_cache, v_cache, end, start=0, scale=None):
    B, Hq, D = q.shape
    Hkv, T = k_cache.shape[1], k_cache.shape[2]
    g = Hq // Hkv
    qg = q.view(B, Hkv, g, D)
    mask = _bounds(end, start, T, q.device).unsqueeze(1)  # (B|1, 1, 1, T)
    out = F.scaled_dot_product_attention(
        qg, k_cache, v_cache, attn_mask=mask, scale=scale, enable_gqa=False
    )  # (B, Hkv, g, D)
    return out.reshape(B, Hq, D)


def _fused(q, k_cache, v_cache, end, start=0, scale=None):
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    s, e = int(start), int(end)  # host values: this path slices the valid prefix
    qg = q.view(B, Hkv, Hq // Hkv, D)
    out = F.scaled_dot_product_attention(qg, k_cache[:, :, s:e], v_cache[:, :, s:e], scale=scale)
    return out.reshape(B, Hq, D)


def _split_k(q, k_cache, v_cache, end, start=0, scale=None):
    return split_k_lse(q, k_cache, v_cache, end, start, scale)[0]


def split_k_lse(q, k_cache, v_cache, end, start=0, scale=None):
    """Attention over [start, end) and its log-sum-exp (B, Hq), float32."""
    B, Hq, D = q.shape
    Hkv, T = k_cache.shape[1], k_cache.shape[2]
    g = Hq // Hkv
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    qg = q.view(B, Hkv, g, D).float()
    s = torch.einsum("bhgd,bhtd->bhgt", qg, k_cache.float()) * scale  # (B, Hkv, g, T)
    mask = _bounds(end, start, T, q.device).unsqueeze(1)
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, Hkv, g)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.einsum("bhgt,bhtd->bhgd", p, v_cache.float())
    return out.reshape(B, Hq, D).to(q.dtype), lse.reshape(B, Hq)


BACKENDS = {"split_k": _split_k, "sdpa_masked": _masked, "sdpa_fused": _fused}


def get_backend(name: str):
    """The attention function registered under `name`."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise InputError(
            f"unknown attention backend '{name}': choose one of {', '.join(BACKENDS)}"
        ) from None


def decode_attention(q, k_cache, v_cache, end, *, start=0, backend="split_k", scale=None):
    """Attention of one query per sequence over cache entries [start, end).

    q: (B, Hq, D); k_cache, v_cache: (B, Hkv, T, D). Returns (B, Hq, D) in q's dtype.
    """
    return get_backend(backend)(q, k_cache, v_cache, end, start, scale)
