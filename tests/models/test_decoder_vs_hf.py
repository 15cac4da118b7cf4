"""Tiny random models of each family against transformers with the same weights (float32)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import sparsedecode
from sparsedecode.models.rope import inv_frequencies

BASE = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=101, rms_norm_eps=1e-6, max_position_embeddings=512,
    initializer_range=0.25, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)
CONFIGS = {
    # Qwen3: per-head q/k RMSNorm, head_dim not equal to hidden/heads.
    "qwen3": dict(BASE, model_type="qwen3", head_dim=24, rope_theta=1e6, tie_word_embeddings=False),
    # Llama 3.1 RoPE scaling with a short original window so all three bands occur.
    "llama3.1": dict(
        BASE, model_type="llama", num_key_value_heads=1, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64),
        tie_word_embeddings=False,
    ),
    "qwen2": dict(BASE, model_type="qwen2", rope_theta=1e6, tie_word_embeddings=True),
    "mistral": dict(BASE, model_type="mistral", num_key_value_heads=4, sliding_window=None,
                    rope_theta=1e6, tie_word_embeddings=False),
}


def _pair(family: str, folder, shard: bool = False):
    cfg = dict(CONFIGS[family])
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg)).float().eval()
    with torch.no_grad():  # non-trivial norm weights and biases, so they are tested too
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0, 0.5)
    hf.save_pretrained(folder, max_shard_size="100KB" if shard else "5GB")
    ours = sparsedecode.load(str(folder), device="cpu", dtype="float32", max_len=160)
    return hf, ours


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, *_pair(request.param, folder, shard=request.param == "qwen3")


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 101, (n,), generator=torch.Generator().manual_seed(seed))


def test_loaded_shapes_and_flags(pair):
    family, hf, ours = pair
    a = ours.args
    assert a.qk_norm == (family == "qwen3")
    assert a.qkv_bias == (family == "qwen2")
    assert a.tie_embeddings == (family == "qwen2")
    assert (a.rope_type == "llama3") == (family == "llama3.1")
    n_hf = sum(p.numel() for p in hf.parameters())
    # a fused one-token launch (qkv, gate_up: the dense CPU/GPU GEMV) holds the storage its sites'
    # weights are column slices of: counted once, through the sites
    n_ours = sum(p.numel() for name, p in ours.model.named_parameters()
                 if not any(f".{fused}." in name for fused in ("qkv", "gate_up")))
    assert n_hf == n_ours


def test_rope_frequencies_match_hf(pair):
    _, hf, ours = pair
    ref = hf.model.rotary_emb.inv_freq
    torch.testing.assert_close(inv_frequencies(ours.args), ref, rtol=0, atol=0)


def test_forward_logits_match_hf(pair):
    _, hf, ours = pair
    ids = _ids(150)
    got = ours.forward_logits(ids)  # (L, V)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    err = (got - ref).abs().max().item()
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert err <= 1e-3 * ref.abs().max().item(), f"max |dlogit| {err:.3g}"


def test_chunked_prefill_equals_one_shot(pair):
    _, _, ours = pair
    ids = _ids(150, seed=2)
    one = ours.forward_logits(ids, chunk=150)
    for chunk in (1, 7, 64):
        got = ours.forward_logits(ids, chunk=chunk)
        err = (got - one).abs().max().item()
        assert err <= 1e-4 * one.abs().max().item(), f"chunk {chunk}: max |dlogit| {err:.3g}"


@pytest.mark.parametrize("backend", ["split_k", "sdpa_masked", "sdpa_fused"])
def test_decode_steps_equal_forward(pair, backend):
    _, _, ours = pair
    ids = _ids(40, seed=3)
    full = ours.forward_logits(ids)  # (40, V)
    for layer in ours.model.layers:
        layer.self_attn.backend = backend
    try:
        last = ours.prefill(ids[:30])
        rows = [last] + [ours.decode_step(int(t)).clone() for t in ids[30:]]
    finally:
        for layer in ours.model.layers:
            layer.self_attn.backend = ours.attention
    got = torch.stack(rows[:-1])  # logits at positions 29..38
    err = (got - full[29:39]).abs().max().item()
    assert ours.pos == 40
    assert err <= 1e-4 * full.abs().max().item(), f"{backend}: max |dlogit| {err:.3g}"


def test_greedy_generation_matches_hf(pair):
    _, hf, ours = pair
    prompt = _ids(12, seed=4)
    out = ours.generate(prompt.tolist(), max_new_tokens=40)
    with torch.no_grad():
        ref = hf.generate(prompt[None], max_new_tokens=40, do_sample=False, min_new_tokens=40)
    ref_new = ref[0, prompt.numel():].tolist()
    assert len(out.ids) == 40
    agree = next((i for i, (a, b) in enumerate(zip(out.ids, ref_new, strict=False)) if a != b), 40)
    assert agree >= 32, f"first disagreement at token {agree}: {out.ids} vs {ref_new}"
