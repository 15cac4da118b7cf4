"""Admissibility (ByteCross §5.1, §5.3, App. H; issue 7): verdicts on synthetic records whose
answers are known, and the `eval admit` command."""

from __future__ import annotations

import copy
import json

import pytest

from sparsedecode.cli import main
from sparsedecode.errors import InputError
from sparsedecode.quality.admit import admit

MODEL = {"name": "smollm2-135m", "source": "/cache/smollm2.gguf", "init": "pretrained",
         "dims": {"n_layers": 30, "d": 576, "d_ff": 1536}}
PROJ = {"method": "teal", "keep": 0.5, "model": "smollm2-135m", "dims": MODEL["dims"], "keep_metric": "param_keep",
        "calibration": {"text": "wiki.valid.raw[:8192]", "tokens": 8192}, "extras": {}}
CONFIG = {"mode": "both", "projection": PROJ, "kv": {"method": "snapkv", "keep": 0.3, "params": {"window": 64}}}
DEPTHS = [0.05, 0.25, 0.5, 0.75, 0.95]


def retrieval(test: str, outcomes: dict | None = None, trials: int = 2, model=MODEL, config=CONFIG) -> dict:
    """A 'retrieval_eval' record; every placement correct for both unless `outcomes` maps
    (depth, trial) to (dense verdict, configured verdict)."""
    outcomes = outcomes or {}
    placements = []
    for d in DEPTHS:
        for t in range(trials):
            dv, cv = outcomes.get((d, t), ("correct", "correct"))
            code = f"{100000 + 10 * t:06d}"
            out = {"correct": code, "distractor": "999999", "miss": "I do not know"}
            placements.append({"depth": d, "trial": t, "expected": code, "needle_span": [10, 14],
                               "dense": {"output": out[dv], "verdict": dv},
                               "configured": {"output": out[cv], "verdict": cv, "in_window": d > 0.9}})
    dense_ok = sum(p["dense"]["verdict"] == "correct" for p in placements)
    conf = [p["configured"]["verdict"] for p in placements]
    return {"kind": "retrieval_eval", "test": test, "model": copy.deepcopy(model), "device": "cpu",
            "dtype": "float32", "context": 2048, "depths": DEPTHS, "trials": trials, "seed": 0,
            "config": {**copy.deepcopy(config), "projection": copy.deepcopy(config["projection"]),
                       "variant": None},
            "placements": placements, "dense": {"correct": dense_ok, "total": len(placements)},
            "configured": {"correct": conf.count("correct"), "total": len(conf),
                           "distractor": conf.count("distractor"), "miss": conf.count("miss")},
            "matches_dense": all(p["dense"]["verdict"] == p["configured"]["verdict"] for p in placements)}


def ppl(point: float, low: float, high: float, model=MODEL, config=CONFIG) -> dict:
    """A 'ppl_eval' record as `eval ppl` writes it (the fields admit reads, and a few more)."""
    proj = None if config["projection"] is None else {**config["projection"], "source": "cached_teal",
                                                      "runtime": "masked reference"}
    iv = lambda p: {"point": p, "low": p - 0.1, "high": p + 0.1}  # noqa: E731
    return {"kind": "ppl_eval", "protocol": "decode", "model": copy.deepcopy(model),
            "config": {**copy.deepcopy(config), "projection": proj, "same_as_dense": False},
            "bootstrap": {"dense": iv(9.0), "config": iv(9.0 + point),
                          "delta": {"point": point, "low": low, "high": high},
                          "windows": 8, "resamples": 20000, "seed": 0, "level": 0.95}}


def test_all_placements_answered_within_budget_is_admissible():
    v = admit(ppl(0.12, 0.05, 0.18), retrieval("passkey"), retrieval("multikey"), 0.2)
    assert v.admissible and v.reasons == []
    assert [(r.test, r.total, r.dense_correct, r.kept) for r in v.retrieval] == [
        ("passkey", 10, 10, 10), ("multikey", 10, 10, 10)]
    assert v.ppl.estimate == "point" and v.ppl.value == 0.12
    assert v.text().splitlines()[-1] == "verdict: admissible"


def test_a_miss_where_dense_answers_fails_and_is_listed():
    mk = retrieval("multikey", {(0.25, 1): ("correct", "distractor"), (0.75, 0): ("correct", "miss")})
    v = admit(ppl(0.01, 0.0, 0.02), retrieval("passkey"), mk, 0.2)
    assert not v.admissible
    assert v.reasons == ["multikey misses 2 of the 10 placements dense answers"]
    failed = v.retrieval[1].failures
    assert [(f.depth, f.trial, f.verdict, f.output) for f in failed] == [
        (0.25, 1, "distractor", "999999"), (0.75, 0, "miss", "I do not know")]
    text = v.text()
    assert "multikey  FAIL: 8/10" in text and "depth 0.25 trial 1: distractor (expected 100010" in text
    assert "passkey   pass: 10/10" in text and "verdict: NOT admissible" in text


def test_a_placement_dense_misses_does_not_count():
    # dense and the configuration both miss (0.5, 0); dense misses (0.95, 1), the configuration answers
    pk = retrieval("passkey", {(0.5, 0): ("miss", "miss"), (0.95, 1): ("distractor", "correct")})
    v = admit(ppl(0.01, 0.0, 0.02), pk, retrieval("multikey"), 0.2)
    assert v.admissible
    assert (v.retrieval[0].total, v.retrieval[0].dense_correct, v.retrieval[0].kept) == (10, 8, 8)
    # ... but the same miss where dense answers fails
    pk = retrieval("passkey", {(0.5, 0): ("correct", "miss")})
    assert not admit(ppl(0.01, 0.0, 0.02), pk, retrieval("multikey"), 0.2).admissible


def test_dense_answering_nothing_is_said():
    pk = retrieval("passkey", {(d, t): ("miss", "miss") for d in DEPTHS for t in range(2)})
    v = admit(ppl(0.01, 0.0, 0.02), pk, retrieval("multikey"), 0.2)
    assert v.admissible  # no placement dense answers: nothing the configuration could lose
    assert "dense answers none, so this test says nothing" in v.text()


def test_budget_exceeded():
    v = admit(ppl(0.35, 0.2, 0.5), retrieval("passkey"), retrieval("multikey"), 0.2)
    assert not v.admissible and v.reasons == ["ΔPPL point +0.3500 exceeds the budget 0.2"]
    assert "ΔPPL      FAIL: point estimate +0.3500 > budget 0.2" in v.text()
    # exactly at the budget passes
    assert admit(ppl(0.2, 0.1, 0.3), retrieval("passkey"), retrieval("multikey"), 0.2).admissible


def test_point_estimate_or_upper_end():
    rec = ppl(0.15, 0.08, 0.26)  # point within 0.2, upper end beyond it
    point = admit(rec, retrieval("passkey"), retrieval("multikey"), 0.2)
    upper = admit(rec, retrieval("passkey"), retrieval("multikey"), 0.2, use_upper=True)
    assert point.admissible and "the paper selects on point estimates" in point.text()
    assert not upper.admissible and upper.ppl.value == 0.26
    assert upper.reasons == ["ΔPPL upper +0.2600 exceeds the budget 0.2"]
    assert "upper end of the 95% interval +0.2600 > budget 0.2" in upper.text()
    # a retrieval failure and a budget failure are both reasons
    mk = retrieval("multikey", {(0.05, 0): ("correct", "miss")})
    assert len(admit(rec, retrieval("passkey"), mk, 0.2, use_upper=True).reasons) == 2


def test_records_of_another_model_or_configuration_are_refused():
    other = {**MODEL, "name": "qwen2.5-coder-0.5b"}
    with pytest.raises(InputError, match=r"multikey is a record of another model: model.name = 'qwen2.5-coder-0.5b'"):
        admit(ppl(0.1, 0.0, 0.2), retrieval("passkey"), retrieval("multikey", model=other), 0.2)
    wider = {**MODEL, "dims": {**MODEL["dims"], "d_ff": 2048}}
    with pytest.raises(InputError, match=r"passkey is a record of another model: model.dims.d_ff = 2048"):
        admit(ppl(0.1, 0.0, 0.2), retrieval("passkey", model=wider), retrieval("multikey"), 0.2)
    sel2 = {**CONFIG, "kv": {**CONFIG["kv"], "keep": 0.2}}
    with pytest.raises(InputError, match=r"passkey is a record of another configuration: config.kv.keep = 0.2, "
                                         r"the ppl record has 0.3"):
        admit(ppl(0.1, 0.0, 0.2), retrieval("passkey", config=sel2), retrieval("multikey"), 0.2)
    obs = {**CONFIG, "kv": {**CONFIG["kv"], "params": {"window": 32}}}
    with pytest.raises(InputError, match=r"config.kv.params.window = 32"):
        admit(ppl(0.1, 0.0, 0.2), retrieval("passkey"), retrieval("multikey", config=obs), 0.2)
    calib = {**CONFIG, "projection": {**PROJ, "calibration": {"text": "other.txt", "tokens": 8192}}}
    with pytest.raises(InputError, match=r"config.projection.calibration.text = 'other.txt'"):
        admit(ppl(0.1, 0.0, 0.2), retrieval("passkey"), retrieval("multikey", config=calib), 0.2)
    # a record without keep_metric or calibration in its header is still the same configuration
    bare = {**CONFIG, "projection": {"method": "teal", "keep": 0.5}}
    assert admit(ppl(0.1, 0.0, 0.2), retrieval("passkey", config=bare), retrieval("multikey"), 0.2).admissible


def test_wrong_records_and_budget():
    with pytest.raises(InputError, match="passkey: expected the passkey test, this record holds the 'multikey' test"):
        admit(ppl(0.1, 0.0, 0.2), retrieval("multikey"), retrieval("multikey"), 0.2)
    with pytest.raises(InputError, match="ppl: expected a 'ppl_eval' record, got 'retrieval_eval'"):
        admit(retrieval("passkey"), retrieval("passkey"), retrieval("multikey"), 0.2)
    with pytest.raises(InputError, match="finite number >= 0"):
        admit(ppl(0.1, 0.0, 0.2), retrieval("passkey"), retrieval("multikey"), float("nan"))
    pk = retrieval("passkey")
    pk["placements"][3]["configured"]["verdict"] = "maybe"
    with pytest.raises(InputError, match="passkey placement 3: unknown verdict 'maybe'"):
        admit(ppl(0.1, 0.0, 0.2), pk, retrieval("multikey"), 0.2)


# -- CLI ------------------------------------------------------------------------------
def _cli(capsys, *args) -> tuple[int, str, str]:
    try:
        main(["eval", "admit", *args])
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def _files(tmp_path, p: dict, pk: dict, mk: dict) -> list[str]:
    paths = []
    for name, rec in (("ppl", p), ("pk", pk), ("mk", mk)):
        (tmp_path / f"{name}.json").write_text(json.dumps(rec))
        paths.append(str(tmp_path / f"{name}.json"))
    return ["--ppl", paths[0], "--passkey", paths[1], "--multikey", paths[2]]


def test_cli_verdicts_and_exit_status(capsys, tmp_path):
    args = _files(tmp_path, ppl(0.15, 0.08, 0.26), retrieval("passkey"),
                  retrieval("multikey", {(0.5, 1): ("correct", "distractor")}))
    code, out, _ = _cli(capsys, *args, "--budget", "0.2")
    assert code == 3
    assert out.splitlines()[0] == "smollm2-135m, both: projection teal keep 0.5, kv snapkv keep 0.3"
    assert "multikey  FAIL: 9/10" in out and "depth 0.5 trial 1: distractor" in out
    code, out, _ = _cli(capsys, *args, "--budget", "0.2", "--json")
    v = json.loads(out)
    assert code == 3 and v["kind"] == "admissibility" and v["admissible"] is False
    assert [r["passed"] for r in v["retrieval"]] == [True, False] and v["ppl"]["passed"] is True
    assert v["retrieval"][1]["failures"][0]["depth"] == 0.5

    args = _files(tmp_path, ppl(0.15, 0.08, 0.26), retrieval("passkey"), retrieval("multikey"))
    code, out, _ = _cli(capsys, *args, "--budget", "0.2")
    assert code == 0 and out.rstrip().endswith("verdict: admissible")
    code, out, _ = _cli(capsys, *args, "--budget", "0.2", "--use-upper", "--json")
    assert code == 3 and json.loads(out)["reasons"] == ["ΔPPL upper +0.2600 exceeds the budget 0.2"]


def test_cli_errors(capsys, tmp_path):
    args = _files(tmp_path, ppl(0.1, 0.0, 0.2), retrieval("passkey"),
                  retrieval("multikey", model={**MODEL, "init": "random"}))
    code, _, err = _cli(capsys, *args, "--budget", "0.2")
    assert code == 2 and "error: --multikey is a record of another model: model.init = 'random'" in err
    code, _, err = _cli(capsys, *args, "--budget", "lots")
    assert code == 2 and "--budget 'lots' is not a number" in err
    code, _, err = _cli(capsys, "--ppl", str(tmp_path / "none.json"), *args[2:], "--budget", "0.2")
    assert code == 2 and "cannot read record" in err
