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


def tiny_llama(**changes) -> dict:
    """The HF config of a tiny random llama (`sparsedecode.load(cfg, init="random")`), fields changed."""
    return {**dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                   max_position_embeddings=512, rope_theta=10000.0, eos_token_id=None), **changes}
