"""The KV branch in the engine's decode step (ByteCross §4.1, App. A): selection into a
compact buffer, the window read in place, keep 1.0 as dense, and the modes."""

from __future__ import annotations

import pytest
import torch

import sparsedecode
from sparsedecode.config import KVConfig, SparsityConfig
from sparsedecode.errors import InputError
from sparsedecode.kv.select import get_selector

TINY = dict(model_type="llama", hidden_size=96, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, vocab_size=100, max_position_embeddings=512,
            rope_theta=10000.0, eos_token_id=None)
PROMPT = torch.randint(0, 100, (150,), generator=torch.Generator().manual_seed(0)).tolist()


def engine():
    """A tiny random engine whose attention matters: q/k/v/o scaled up, so scores are peaked
    and the attended entries change the logits (at init std 0.02 attention is near uniform)."""
    eng = sparsedecode.load(dict(TINY), init="random", dtype="float32", max_len=256)
    with torch.no_grad():
        for layer in eng.model.layers:
            for name, scale in (("q_proj", 12.0), ("k_proj", 12.0), ("v_proj", 20.0), ("o_proj", 20.0)):
                getattr(layer.self_attn, name).weight.mul_(scale)
    return eng


def decode(eng, tokens):
    return torch.stack([eng.decode_step(t).clone() for t in tokens])


def test_keep_one_is_dense_exactly():
    eng = engine()
    eng.prefill(PROMPT)
    dense = decode(eng, [3, 4, 5])
    eng.prefill(PROMPT)
    sel = eng.select_kv("snapkv", 1.0, max_new=3, window=16)
    assert sel.mode == "dense" and sel.budget == len(PROMPT)
    got = decode(eng, [3, 4, 5])
    if eng.device.type == "cpu":
        assert torch.equal(got, dense)
    else:  # the default CUDA dense step adds its GEMVs' split-K partials with atomics, in any order
        torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunks", [[150], [100, 30, 20], [140, 10]])
def test_the_prefill_keeps_the_observation_window(chunks):
    """The last 64 prefill queries per layer are the ones a re-run of the window computes, across
    chunks and prefill calls that continue each other; a wider window re-runs; the selections agree."""
    from sparsedecode.kv.apply import observation_queries
    from sparsedecode.models.decoder import RECENT_QUERIES

    eng = engine()
    start = 0
    for size in chunks:  # consecutive prefills, each in chunks of 30 (the last ones shorter than 64)
        eng.prefill(PROMPT[start:start + size], chunk=30, start=start)
        start += size
    kept, observed = observation_queries(eng, RECENT_QUERIES)
    assert observed == "prefill" and all(q.shape == (1, 6, RECENT_QUERIES, 16) for q in kept)
    for layer in eng.model.layers:  # forget what the prefill kept: the window is run again
        layer.self_attn.recent = None
    if chunks[-1] < RECENT_QUERIES:  # the last prefill holds too few tokens to run the window again
        with pytest.raises(InputError, match="observation window is the last 64 prompt tokens"):
            observation_queries(eng, RECENT_QUERIES)
        eng.prefill(PROMPT[-RECENT_QUERIES:], start=len(PROMPT) - RECENT_QUERIES)
        for layer in eng.model.layers:
            layer.self_attn.recent = None
    rerun, observed = observation_queries(eng, RECENT_QUERIES)
    assert observed == "re-run"
    for a, b in zip(kept, rerun, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    eng.prefill(PROMPT)
    sel = eng.select_kv("snapkv", 0.5, max_new=4, window=16)
    assert sel.observed == "prefill" and sel.phases["observe"] >= 0
    idx = eng.select_kv("snapkv", 0.5, max_new=4, window=16, indices=True).kept
    wide = eng.select_kv("snapkv", 0.8, max_new=4, window=100)
    assert wide.observed == "re-run" and wide.budget == round(0.8 * 150) - 4
    for layer in eng.model.layers:
        layer.self_attn.recent = None
    again = eng.select_kv("snapkv", 0.5, max_new=4, window=16, indices=True)
    assert again.observed == "re-run"
    assert all(torch.equal(a, b) for a, b in zip(idx, again.kept, strict=True))


def test_observation_pass_leaves_the_cache_and_selection_gathers_it():
    eng = engine()
    eng.prefill(PROMPT)
    n = len(PROMPT)
    caches = [layer.self_attn.cache for layer in eng.model.layers]
    before = [c.k[:, :, :n].clone() for c in caches]
    sel = eng.select_kv("snapkv", 0.5, max_new=4, window=16)
    assert sel.mode == "sel" and sel.budget == round(0.5 * n) - 4 and sel.select_s > 0
    for c, k0 in zip(caches, before, strict=True):
        assert torch.equal(c.k[:, :, :n], k0), "the observation pass must leave the prefilled cache as it was"
        ck, cv, offset = c.compact
        assert ck.shape[2] == sel.budget + 4 and int(offset) == n - sel.budget
        # every kept key is a cache row, sinks and window included
        for h in range(ck.shape[1]):
            rows = (ck[0, h, :sel.budget, None] == c.k[0, h, None, :n]).all(-1)  # (budget, n)
            pos = rows.float().argmax(1)
            assert rows.any(1).all() and pos.unique().numel() == sel.budget
            assert set(range(4)) <= set(pos.tolist()) and set(range(n - 16, n)) <= set(pos.tolist())
    logits = eng.decode_step(7)
    assert torch.isfinite(logits).all()
    for c in caches:  # the new entry went to the full cache and to the compact slot `budget`
        assert torch.equal(c.compact[0][:, :, sel.budget], c.k[:, :, n])


def test_window_in_place_equals_the_same_entries_gathered():
    """max_new=1: the compact buffer of the window's positions plus the new token holds exactly
    the entries the in-place window reads at the first step."""
    eng = engine()
    eng.prefill(PROMPT)
    in_place = eng.select_kv("window", 0.4, max_new=1, window=16)
    assert in_place.mode == "window"
    a = eng.decode_step(9).clone()
    eng.prefill(PROMPT)
    sel = get_selector("window", window=16)
    caches = [layer.self_attn.cache for layer in eng.model.layers]
    n = len(PROMPT)
    for c in caches:
        idx = sel.select(None, c.k, n, 0.4, 1)
        k, v = sel.gather(c.k, c.v, idx, extra=1)
        c.read_compact(k, v, torch.tensor([n - idx.shape[-1]], device=k.device))
    eng.invalidate_step()
    b = eng.decode_step(9)
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)  # prints the greatest differences
    assert not torch.allclose(a, decode_dense(eng, 9), atol=1e-3), "the window must change the logits"


def decode_dense(eng, tok):
    eng.prefill(PROMPT)
    return eng.decode_step(tok)


def test_modes_generate_and_a_new_prompt_returns_to_dense():
    eng = engine()
    assert SparsityConfig().mode == "dense"
    assert SparsityConfig(kv=KVConfig("window", 0.3)).mode == "window"
    assert SparsityConfig(kv=KVConfig("snapkv", 1.0)).mode == "dense"
    assert eng.configure(SparsityConfig(kv=KVConfig("snapkv", 0.5, {"window": 16}))).mode == "sel"
    out = eng.generate(PROMPT, max_new_tokens=5)
    assert len(out.ids) == 5 and out.kv_select_s > 0 and eng.kv.mode == "sel"
    eng.configure(SparsityConfig())
    dense = eng.generate(PROMPT, max_new_tokens=5)
    assert eng.kv is None and dense.kv_select_s == 0.0


def test_bad_input():
    eng = engine()
    with pytest.raises(InputError, match="after the prefill"):
        eng.select_kv("snapkv", 0.5, max_new=2)
    eng.prefill(PROMPT)
    with pytest.raises(InputError, match=r"outside \(0, 1\]"):
        eng.select_kv("snapkv", 0.0, max_new=2)
    with pytest.raises(InputError, match="cannot hold"):
        eng.select_kv("snapkv", 0.05, max_new=2)
    with pytest.raises(InputError):
        eng.select_kv("nosuch", 0.5, max_new=2)
    with pytest.raises(InputError, match=r"outside \(0, 1\]"):
        KVConfig("snapkv", 1.5)


def test_rescore_after_a_new_turn_scores_the_full_history():
    eng = engine()
    eng.prefill(PROMPT)
    first = eng.select_kv("snapkv", 0.5, max_new=3, window=16)
    decode(eng, [3, 4, 5])
    turn = [7, 8, 9, 10] * 5  # 20 tokens, more than the 16-token window
    start = eng.pos
    eng.prefill(turn, start=start)  # a continuation: the selection is not voided
    assert eng.kv is first
    full = [layer.self_attn.cache.k[:, :, : eng.pos].clone() for layer in eng.model.layers]
    again = eng.rescore(max_new=2)
    assert again.n == len(PROMPT) + 3 + len(turn) and again.method == "snapkv"
    for layer, k0 in zip(eng.model.layers, full, strict=True):
        cache = layer.self_attn.cache
        assert torch.equal(cache.k[:, :, : eng.pos], k0), "the history is not recomputed"
        ck = cache.compact[0]
        tail = ck[:, :, again.budget - 16 : again.budget]  # the last kept: the new turn's window
        assert torch.equal(tail, cache.k[:, :, eng.pos - 16 : eng.pos])
    assert torch.isfinite(eng.decode_step(11)).all()
    with pytest.raises(InputError, match="select_kv first"):
        engine().rescore(2)


def test_a_selection_that_fits_reuses_the_buffers_and_matches_a_fresh_one():
    other = torch.randint(0, 100, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    eng = engine()
    eng.prefill(PROMPT)
    eng.select_kv("snapkv", 0.5, max_new=4, window=16)
    bufs = [layer.self_attn.cache.compact[0] for layer in eng.model.layers]
    decode(eng, [3, 4])
    eng.prefill(other, start=0)  # a new prompt: back to dense, buffers kept
    assert all(layer.self_attn.cache.compact is None for layer in eng.model.layers)
    eng.select_kv("snapkv", 0.4, max_new=4, window=16)  # a smaller budget fits
    assert all(layer.self_attn.cache.compact[0] is b for layer, b in zip(eng.model.layers, bufs, strict=True))
    reused = decode(eng, [5, 6, 7])
    fresh = engine()
    fresh.prefill(other)
    fresh.select_kv("snapkv", 0.4, max_new=4, window=16)
    assert torch.allclose(reused, decode(fresh, [5, 6, 7]), atol=1e-6, rtol=1e-6)
