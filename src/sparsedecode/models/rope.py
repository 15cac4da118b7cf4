"""Rotary position embeddings, bit-compatible with Hugging Face checkpoints.

HF-layout q/k weights use the 'rotate_half' convention: the two halves of a
head (not even/odd pairs) form the rotated pairs, so
    x' = x * cos + rotate_half(x) * sin,   rotate_half([a, b]) = [-b, a].
The inverse frequencies are computed in float32 exactly as transformers does
(including Llama 3.1's 'llama3' smoothing between a low- and a high-frequency
band, which ByteCross App. A keeps enabled for its 128K runs), and the
cos/sin tables are built once for the whole cache and cast to the model dtype
before use, as HF casts them, so positions index a table instead of
recomputing trig inside the decode step.
"""

from __future__ import annotations

import math

import torch

from sparsedecode.models.args import ModelArgs


def inv_frequencies(args: ModelArgs, device=None) -> torch.Tensor:
    """Inverse frequencies of one head, (head_dim // 2,) float32."""
    dim = args.head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (args.rope_theta**exponent)  # (D/2,)
    sc = args.rope_scaling or {}
    kind = args.rope_type
    if kind == "linear":
        return inv_freq / sc["factor"]
    if kind != "llama3":
        return inv_freq
    factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    old_len = sc["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq  # (D/2,)
    # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept,
    # and the band in between interpolated smoothly.
    scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / hi) & ~(wavelen > old_len / lo)
    return torch.where(medium, smoothed, scaled)


def rope_tables(args: ModelArgs, length: int, device=None, dtype=torch.float32):
    """cos and sin for positions 0..length-1, each (length, head_dim) in `dtype`."""
    inv_freq = inv_frequencies(args, device)  # (D/2,)
    pos = torch.arange(length, device=device, dtype=torch.int64).float()  # (T,)
    freqs = pos[:, None] * inv_freq[None, :]  # (T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, L, D) by the angles of its L positions; cos, sin are (L, D)."""
    return x * cos + rotate_half(x) * sin


__all__ = ["apply_rope", "inv_frequencies", "rope_tables", "rotate_half"]
