"""SATS (SATS paper §3.1, §4): local errors, the budget search, the header, bad input,
and the realized keep against CATS.

The fast Err path (one sparse down product over the bands between candidates) must
equal running the masked MLP (`masks`) per candidate; t*(b) must be the largest
candidate within budget; the coarse-to-fine search must find the exact optimum over
the candidate errors. On smollm2-135m, SATS at keep 0.5 must realize, on held-out
WikiText-2 test text under the masked reference, an act_keep within 0.01 of CATS's
at the same target (0.7 and 0.5, and qwen2.5-coder-0.5b, with
SPARSEDECODE_FULL_CALIBRATION=1).
"""

from __future__ import annotations

import os

import pytest
import torch

import sparsedecode
from sparsedecode.corpus import wikitext_ids
from sparsedecode.errors import InputError
from sparsedecode.projection.calibrate import (
    CALIBRATORS,
    collect_activations,
    get_calibrator,
    masks,
    measure_keep,
    run_layers,
)
from sparsedecode.projection.sats import Sats, pick
from sparsedecode.projection.thresholds import Thresholds

TINY = dict(model_type="llama", hidden_size=96, intermediate_size=160, num_hidden_layers=4,
            num_attention_heads=6, num_key_value_heads=2, vocab_size=100,
            max_position_embeddings=512, rope_theta=10000.0, eos_token_id=None)
ERR_TOKENS = 64
TINY_FIELDS = dict(error_tokens=ERR_TOKENS, refine_tokens=256)


@pytest.fixture(scope="module")
def tiny():
    """(engine, activations of 512 random tokens) of a 4-layer random llama whose MLP
    weights are scaled up, so layers differ in how much a dropped channel costs."""
    eng = sparsedecode.load(dict(TINY), init="random", dtype="float32", max_len=256, seed=3)
    with torch.no_grad():
        for i, layer in enumerate(eng.model.layers):
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.mlp, name).weight.mul_(8.0 * (i + 1))
    ids = torch.randint(0, 100, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    return eng, collect_activations(eng, ids)


def _brute_errs(eng, acts, i: int, ts: list[float], eps: float) -> torch.Tensor:
    """Eq. 1 the slow way: one dense pass over the error tokens records layer i's MLP input
    and output; then, per candidate, that MLP runs again under `masks` (the masked
    reference of the CATS runtime) and its outputs are compared."""
    seen = []
    mlp = eng.model.layers[i].mlp
    hook = mlp.register_forward_hook(lambda m, a, out: seen.append((a[0].clone(), out.clone())))
    try:
        with torch.inference_mode():
            run_layers(eng.model, acts.ids[:ERR_TOKENS].to(eng.device))  # the samples stay on the CPU
            x, y = seen[0]  # (1, T, d) each
            errs = [0.0]
            for t in ts:
                with masks(eng.model, {f"layers.{i}.act": t}, layers={i}):
                    y_t = mlp(x)
                errs.append(float(((y - y_t).norm(dim=-1) / (y.norm(dim=-1) + eps)).mean()))
    finally:
        hook.remove()
        eng.reset()
    return torch.tensor(errs)


def test_fast_local_errors_equal_the_masked_mlp(tiny):
    eng, acts = tiny
    sats = Sats(keep=0.5, **TINY_FIELDS)
    errs, sps = sats.curves(eng, acts)
    assert errs.shape == sps.shape == (4, len(sats.grid) + 1)
    for i in range(4):
        ts = sats._candidates(acts, i, sats.grid)
        ref = _brute_errs(eng, acts, i, ts, sats.eps)
        torch.testing.assert_close(errs[i], ref, rtol=1e-4, atol=1e-5)
        assert (errs[i].diff() >= -1e-6).all(), f"layer {i}: Err not nondecreasing in t: {errs[i]}"
        assert (sps[i].diff() > 0).all()  # higher threshold, more sparsity
    assert errs[:, -1].min() > 0.05  # the curves are not trivially flat


def test_pick_is_the_largest_candidate_within_budget(tiny):
    # a curve that exceeds the budget at index 2 but comes back under it at index 3
    errors = torch.tensor([[0.0, 0.1, 0.3, 0.2, 0.5], [0.0, 0.4, 0.6, 0.7, 0.8]])
    assert pick(errors, 0.25).tolist() == [3, 0]
    assert pick(errors, 0.0).tolist() == [0, 0]  # nothing within budget: keep everything
    assert pick(errors, 1.0).tolist() == [4, 4]
    eng, acts = tiny
    errs, _ = Sats(keep=0.5, **TINY_FIELDS).curves(eng, acts)
    for b in (0.0, 0.01, 0.05, 0.2, 1.0, 10.0):
        idx = pick(errs, b)
        for i, k in enumerate(idx.tolist()):
            assert errs[i, k] <= b and bool((errs[i, k + 1 :] > b).all()), (b, i, k)


@pytest.mark.parametrize("keep", [0.7, 0.5, 0.3])
@pytest.mark.parametrize("last_cats", [True, False])
def test_search_finds_the_closest_sparsity(tiny, keep, last_cats):
    eng, acts = tiny
    sats = Sats(keep=keep, last_layer_cats=last_cats, **TINY_FIELDS)
    errs, sps = sats.curves(eng, acts)
    found = sats.search(eng, acts)
    free = 3 if last_cats else 4
    last_sp = (1.0 - keep) if last_cats else 0.0

    def S(b):
        idx = pick(errs[:free], b)
        return (float(sps[:free].gather(1, idx[:, None]).sum()) + (4 - free) * last_sp) / 4

    # S(b) only moves where b crosses a candidate's error: the exact optimum is among them.
    best = min(abs(S(float(b)) - (1 - keep)) for b in errs[:free].unique())
    assert abs(found.sparsity - (1 - keep)) <= best + 1e-3  # last layer: quantile vs exact keep
    assert found.sparsity == pytest.approx(S(found.budget), abs=1e-3)
    assert all(e <= found.budget for e in found.errors[:free])
    assert found.keeps == [sats.levels[int(k)] for k in pick(errs[:free], found.budget)] + (
        [keep] if last_cats else [])
    assert len(set(found.keeps[:free])) > 1  # layers differ in sensitivity: not uniform


def test_last_layer_keeps_cats_threshold_and_header_round_trips(tiny, tmp_path):
    eng, acts = tiny
    th = get_calibrator("sats", keep=0.5, **TINY_FIELDS).fit(eng, acts, text="random")
    cats = get_calibrator("cats", keep=0.5, refine_tokens=256).fit(eng, acts)
    assert sorted(th.values) == [f"layers.{i}.act" for i in range(4)]  # one per layer: the CATS runtime runs it
    assert th.values["layers.3.act"] == cats.values["layers.3.act"]
    assert th.values["layers.0.act"] != cats.values["layers.0.act"]
    assert th.method == "sats" and th.keep_metric == "act_keep"
    back = Thresholds.load(th.save(tmp_path / "s.safetensors"))
    assert back.values == pytest.approx(th.values)
    for k in ("budget", "sparsity", "target_sparsity", "layer_errors", "layer_keeps", "error_tokens"):
        assert back.extras[k] == th.extras[k], k
    assert len(back.extras["layer_errors"]) == len(back.extras["layer_keeps"]) == 4
    assert back.extras["sparsity"] == pytest.approx(0.5, abs=0.05)
    no_guard = get_calibrator("sats", keep=0.5, last_layer_cats=False, **TINY_FIELDS).fit(eng, acts)
    assert no_guard.extras["layer_errors"][3] <= no_guard.extras["budget"]


@pytest.mark.parametrize("params,match", [
    ({"keep": 0.0}, r"\(0, 1\]"),
    ({"keep": 1.5}, r"\(0, 1\]"),
    ({"keep": "half"}, "not a number"),
    ({"grid": (0.5, 0.6)}, "fewer than 8"),
    ({"grid": (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 1.0)}, r"in \(0, 1\)"),
    ({"grid": "dense"}, "keep levels"),
    ({"error_tokens": 8}, "error_tokens must be an integer >= 32"),
    ({"error_tokens": 64.5}, "error_tokens"),
    ({"coarse": 1}, "coarse"),
    ({"eps": 0.0}, "eps"),
    ({"last_layer_cats": "yes"}, "last_layer_cats"),
    ({"greedy": True}, "sats has no option greedy"),
])
def test_bad_fields_are_refused(params, match):
    assert "sats" in CALIBRATORS and CALIBRATORS["sats"].name == "sats"
    with pytest.raises(InputError, match=match):
        get_calibrator("sats", **{"keep": 0.5, **params})


def test_calibration_text_shorter_than_error_tokens_is_refused(tiny):
    eng, acts = tiny
    with pytest.raises(InputError, match="512 tokens, fewer than sats error_tokens 1024"):
        Sats(keep=0.5, error_tokens=1024).fit(eng, acts)


# -- realized keep against CATS on the embedded models ------------------------------------
FULL = "SPARSEDECODE_FULL_CALIBRATION" in os.environ
FULL_ONLY = pytest.mark.skipif(not FULL, reason="set SPARSEDECODE_FULL_CALIBRATION=1 (minutes)")
QWEN = pytest.param("qwen2.5-coder-0.5b", marks=FULL_ONLY)
# CI sizes: small, so the file stays near a minute on 2 cores; the full run uses CLI-like ones.
CI = dict(cal=1024, test=512, refine_tokens=512, error_tokens=128)
BIG = dict(cal=4096, test=2048, refine_tokens=1024, error_tokens=512)


@pytest.fixture(scope="module", params=["smollm2-135m", QWEN])
def real(request, embedded_engine):
    """(engine, activations of validation tokens, held-out test ids, sizes) per model."""
    size = BIG if FULL else CI
    eng = embedded_engine(request.param)
    val = wikitext_ids(eng.tokenizer, "valid")[: size["cal"]]
    test = wikitext_ids(eng.tokenizer, "test")[: size["test"]]
    return eng, collect_activations(eng, val), test, size


@pytest.mark.slow
@pytest.mark.parametrize("keep", [pytest.param(0.7, marks=FULL_ONLY), 0.5])
def test_realized_keep_matches_cats(real, keep):
    eng, acts, test, size = real
    fields = {k: size[k] for k in ("refine_tokens", "error_tokens")}
    sats = get_calibrator("sats", keep=keep, **fields).fit(eng, acts, text="wiki.valid.raw")
    cats = get_calibrator("cats", keep=keep, refine_tokens=size["refine_tokens"]).fit(eng, acts)
    last = f"layers.{eng.dims.n_layers - 1}.act"
    assert sats.values[last] == cats.values[last]  # §4: the final layer keeps its CATS threshold
    keeps = sats.extras["layer_keeps"]
    assert max(keeps) - min(keeps) > 0.1, keeps  # an allocation across layers, not CATS again
    assert abs(sats.extras["sparsity"] - (1 - keep)) < 0.005
    s, c = measure_keep(eng, sats, test)["act_keep"], measure_keep(eng, cats, test)["act_keep"]
    assert abs(s - c) <= 0.01, f"{eng.name} keep {keep}: SATS {s:.4f} vs CATS {c:.4f}"
    assert abs(s - keep) <= 0.03, f"{eng.name} keep {keep}: SATS realized {s:.4f}"
