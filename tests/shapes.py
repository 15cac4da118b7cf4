"""Random decode-attention operands shared by the kernel and KV tests."""

from __future__ import annotations

import torch


def random_qkv(B, Hkv, G, T, D, dtype, device="cpu", seed=0):
    """q (B, Hkv*G, D) and caches k, v (B, Hkv, T, D) drawn in float32, then cast."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, D, generator=gen)  # (B, Hq, D)
    k = torch.randn(B, Hkv, T, D, generator=gen)  # (B, Hkv, T, D)
    v = torch.randn(B, Hkv, T, D, generator=gen)
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v))
