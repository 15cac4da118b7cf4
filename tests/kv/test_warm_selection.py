"""The load-time warm-up of the KV selection (kv.apply.warm_selection, issue 26 item 4): it
runs nothing off CUDA, and on CUDA it leaves the engine's cache and selection as they were."""

from __future__ import annotations

import pytest
import torch

import sparsedecode
from sparsedecode.kv.apply import warm_selection

TINY = dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=64, max_position_embeddings=512,
            rope_theta=10000.0, eos_token_id=None)


def test_off_cuda_nothing_runs():
    eng = sparsedecode.load(dict(TINY), device="cpu", dtype="float32", init="random", max_len=64, quiet=True)
    assert warm_selection(eng) == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_it_touches_no_state():
    eng = sparsedecode.load(dict(TINY), device="cuda", dtype="bfloat16", init="random", max_len=64,
                            compile=False, quiet=True)
    eng.prefill(list(range(32)))
    before = [layer.self_attn.cache.k.clone() for layer in eng.model.layers]
    pos, kv = eng.pos, eng.kv
    assert warm_selection(eng) > 0
    assert (eng.pos, eng.kv) == (pos, kv)
    for layer, k in zip(eng.model.layers, before, strict=True):
        assert torch.equal(layer.self_attn.cache.k, k)
