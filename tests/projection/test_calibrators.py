"""Calibrators: bad input, quantiles, and the acceptance test of issue 4.

Acceptance: thresholds calibrated on WikiText-2 validation keep their target on
held-out WikiText-2 test text, measured with the sparsity applied (masked
reference): within 0.03 of 0.7, 0.5 and 0.4 for TEAL uniform and greedy
(parameter-weighted over the seven projections) and CATS (SiLU(gate) channels),
on smollm2-135m and qwen2.5-coder-0.5b. One activation collection per model
serves every method and target.
"""

from __future__ import annotations

import os

import pytest
import torch

from sparsedecode.corpus import wikitext_ids
from sparsedecode.errors import InputError
from sparsedecode.projection.calibrate import (
    CALIBRATORS,
    MIN_TOKENS,
    collect_activations,
    get_calibrator,
    measure_keep,
    quantile_threshold,
)
from sparsedecode.projection.thresholds import INPUT_SITES

KEEPS = (0.7, 0.5, 0.4)
CAL_TOKENS, EVAL_TOKENS, GREEDY_TOKENS = 4096, 2048, 128
# Smaller than the CLI defaults to keep the file within minutes on 2 CPU cores.
FAST = {"refine_tokens": 1024}
GREEDY = {"greedy": True, "greedy_tokens": GREEDY_TOKENS, "step": 0.05}


def test_registry_and_close_match():
    assert set(CALIBRATORS) >= {"teal", "cats"}
    assert CALIBRATORS["teal"].name == "teal"
    with pytest.raises(InputError, match="did you mean 'teal'"):
        get_calibrator("teel", keep=0.5)
    with pytest.raises(InputError, match="cats has no option greedy"):
        get_calibrator("cats", keep=0.5, greedy=True)


@pytest.mark.parametrize("keep", [0.0, -0.1, 1.5, "half"])
@pytest.mark.parametrize("method", ["teal", "cats"])
def test_keep_outside_unit_interval_is_refused(method, keep):
    with pytest.raises(InputError, match=r"\(0, 1\]"):
        get_calibrator(method, keep=keep)


def test_bad_teal_fields_are_refused():
    with pytest.raises(InputError, match="step"):
        get_calibrator("teal", keep=0.5, step=0.0)
    with pytest.raises(InputError, match="greedy_tokens"):
        get_calibrator("teal", keep=0.5, greedy=True, greedy_tokens=3)
    with pytest.raises(InputError, match="refine"):
        get_calibrator("cats", keep=0.5, refine=-1)


def test_too_short_calibration_text_is_refused():
    with pytest.raises(InputError, match=f"fewer than the {MIN_TOKENS} needed"):
        collect_activations(None, list(range(MIN_TOKENS - 1)))


def test_quantile_threshold_keeps_the_target_fraction():
    s = torch.arange(1001, dtype=torch.float32) / 1000  # sorted |x| in [0, 1]
    for keep in (0.9, 0.5, 0.25, 0.01):
        t = quantile_threshold(s, keep)
        assert t == pytest.approx(1 - keep, abs=1e-6)
        assert float((s > t).float().mean()) == pytest.approx(keep, abs=2e-3)
    assert quantile_threshold(s, 1.0) is None  # keep 1: the site stays dense


def test_missing_text_names_text_file(tmp_path):
    with pytest.raises(InputError, match="text=FILE"):
        wikitext_ids(None, "test", tmp_path / "nowhere")
    with pytest.raises(InputError, match="'test' or 'valid'"):
        wikitext_ids(None, "train")


# -- acceptance on the embedded models ----------------------------------------------
# qwen2.5-coder-0.5b runs when SPARSEDECODE_FULL_CALIBRATION is set: its three calibrations
# take about 5 of CI's 20 minutes on 2 cores. smollm2-135m runs every time, at keep 0.5 (all
# three keeps with SPARSEDECODE_FULL_CALIBRATION: 8 minutes of a loaded CI run otherwise).
FULL = "SPARSEDECODE_FULL_CALIBRATION" in os.environ
QWEN = pytest.param("qwen2.5-coder-0.5b", marks=pytest.mark.skipif(
    "SPARSEDECODE_FULL_CALIBRATION" not in os.environ,
    reason="set SPARSEDECODE_FULL_CALIBRATION=1 to calibrate qwen2.5-coder-0.5b too (about 5 min)"))


@pytest.fixture(scope="module", params=["smollm2-135m", QWEN])
def calibrated(request, embedded_engine):
    """(engine, activations of 4K validation tokens, 2K held-out test ids) per model."""
    eng = embedded_engine(request.param)
    val = wikitext_ids(eng.tokenizer, "valid")[:CAL_TOKENS]
    test = wikitext_ids(eng.tokenizer, "test")[:EVAL_TOKENS]
    acts = collect_activations(eng, val, hidden_tokens=GREEDY_TOKENS)
    return eng, acts, test


@pytest.mark.slow
@pytest.mark.parametrize(
    "method,params",
    [("teal", FAST), ("teal", {**FAST, **GREEDY}), ("cats", FAST)],
    ids=["teal-uniform", "teal-greedy", "cats"],
)
def test_realized_keep_hits_target_on_held_out_text(calibrated, method, params):
    eng, acts, test = calibrated
    n = eng.dims.n_layers
    realized = {}
    for keep in KEEPS if FULL else KEEPS[1:2]:  # 0.5 every run; 0.7 and 0.4 with the full calibration
        th = get_calibrator(method, keep=keep, **params).fit(eng, acts, text="wiki.valid.raw")
        assert th.validate(eng.dims) is None
        m = measure_keep(eng, th, test)
        realized[keep] = m["keep"]
        if method == "cats":
            assert th.keep_metric == "act_keep" and th.sites == ["act"] and len(th.values) == n
            assert m["keep"] == m["act_keep"]
        else:
            assert th.keep_metric == "param_keep" and th.sites == list(INPUT_SITES)
            assert m["keep"] == m["param_keep"]
    off = {k: round(v - k, 4) for k, v in realized.items()}
    assert all(abs(d) <= 0.03 for d in off.values()), f"{eng.name} {method} {params}: {realized}"


@pytest.mark.slow
def test_greedy_allocates_unevenly_and_ff_only_leaves_attention_dense(calibrated):
    eng, acts, test = calibrated
    greedy = get_calibrator("teal", keep=0.5, refine=0, **GREEDY)
    keeps = greedy.layer_keeps(eng, acts, 1)
    w = greedy._weights(eng.dims)
    assert sum(w[s] * keeps[s] for s in keeps) == pytest.approx(0.5, abs=1e-9)
    assert max(keeps.values()) - min(keeps.values()) > 0.05  # an allocation, not uniform
    ff = get_calibrator("teal", keep=0.5, ff_only=True, refine=0).fit(eng, acts)
    assert ff.sites == ["gate", "up", "down"] and ff.keep_metric == "ff_keep"
    m = measure_keep(eng, ff, test[:512], ff_only=True)
    assert set(m["sites"]) == {"gate", "up", "down"}
    assert m["param_keep"] > m["ff_keep"]  # attention read in full
