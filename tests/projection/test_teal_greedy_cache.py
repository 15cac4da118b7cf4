"""TEAL greedy allocation (TEAL §4.2; ByteCross App. A 'greedy'): the probe's cached
projection outputs give the same scores, steps and keeps as re-running each
candidate's whole block through the module (`_LayerProbe(cache=False)`).

A tiny random engine with its projections scaled up, so attention is peaked and the
walk interleaves attention and MLP steps; llama, and qwen3 for q/k norms.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

import sparsedecode
from sparsedecode.projection import teal
from sparsedecode.projection.calibrate import collect_activations
from sparsedecode.projection.thresholds import INPUT_SITES

TINY = dict(hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=2, vocab_size=100, max_position_embeddings=512, rope_theta=10000.0,
            eos_token_id=None)
TOKENS = 64  # greedy_tokens: layer inputs that score the steps


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request):
    """(engine, activations of 512 random tokens with TOKENS layer inputs kept)."""
    eng = sparsedecode.load(dict(TINY, model_type=request.param), init="random", dtype="float32",
                            max_len=256)
    with torch.no_grad():
        for layer in eng.model.layers:
            for name, scale in (("q_proj", 12.0), ("k_proj", 12.0), ("v_proj", 20.0), ("o_proj", 20.0)):
                getattr(layer.self_attn, name).weight.mul_(scale)
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.mlp, name).weight.mul_(20.0)
    ids = torch.randint(0, 100, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    return eng, collect_activations(eng, ids, hidden_tokens=TOKENS)


def _greedy(eng, acts, monkeypatch, cache: bool) -> list:
    """(keeps, paths, thresholds) at keep 0.5, then 0.3 resuming the 0.5 walk (set_state
    with attention already sparse), through probes with or without the cache."""
    acts.cache.clear()  # the walked paths live here; each mode walks its own
    out = []
    with monkeypatch.context() as m:
        m.setattr(teal, "_LayerProbe", functools.partial(teal._LayerProbe, cache=cache))
        for keep in (0.5, 0.3):
            cal = teal.Teal(keep=keep, greedy=True, greedy_tokens=TOKENS, step=0.05, refine=0)
            keeps = cal.site_keeps(eng, acts)
            paths = [list(acts.cache[k]) for k in sorted(acts.cache, key=lambda k: k[1])]
            out.append((keeps, paths, cal.fit(eng, acts).values))
    return out


def test_cached_greedy_equals_recomputed(tiny, monkeypatch):
    eng, acts = tiny
    ref = _greedy(eng, acts, monkeypatch, False)
    for (keeps, paths, values), (ref_keeps, ref_paths, ref_values) in zip(
            _greedy(eng, acts, monkeypatch, True), ref, strict=True):
        assert paths == ref_paths
        assert keeps == pytest.approx(ref_keeps, rel=1e-9, abs=0)
        assert values.keys() == ref_values.keys()
        for k, t in values.items():
            assert t == pytest.approx(ref_values[k], rel=1e-5), k
    # The walks exercised the attention cache: q/k/v and o steps among MLP steps.
    stepped = {s for path in paths for s, _ in path}
    assert stepped == set(INPUT_SITES)


def test_probe_scores_match_the_module_after_any_steps(tiny):
    """Random steps across all seven sites: every candidate's score from the cache equals
    the module's, so no cached output goes stale when another site moves."""
    eng, acts = tiny
    x = acts.hidden[1]
    probes = [teal._LayerProbe(eng.model, 1, x, acts, cache=c) for c in (True, False)]
    keeps = dict.fromkeys(INPUT_SITES, 1.0)
    keeps["v"] = 0.8
    for p in probes:
        p.set_state(keeps)
    assert probes[0].err == pytest.approx(probes[1].err, rel=1e-5)
    rng = random.Random(0)
    for _ in range(40):
        tried = {}
        for s in rng.sample(INPUT_SITES, 4):
            new = keeps[s] - 0.05 if keeps[s] > 0.1 else keeps[s]
            tried[s] = [p.try_step(s, new) for p in probes]
            (err, _), (ref, _) = tried[s]
            assert err == pytest.approx(ref, rel=1e-5, abs=1e-9), s
        s = rng.choice(sorted(tried))
        new = keeps[s] - 0.05 if keeps[s] > 0.1 else keeps[s]
        keeps[s] = new
        for p, (err, payload) in zip(probes, tried[s], strict=True):
            p.take(s, new, err, payload)
        assert probes[0].err == pytest.approx(probes[1].err, rel=1e-5, abs=1e-9)
