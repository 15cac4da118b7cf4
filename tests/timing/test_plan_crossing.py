"""Predictions before measurements: `campaign plan-crossing` writes the App. D prediction of a
sweep's crossing as a record and the campaign that measures it around the prediction."""

from __future__ import annotations

import json

import pytest
from test_report import _write

from conftest import run_cli
from sparsedecode.errors import InputError
from sparsedecode.timing.plan import crossing_contexts, predict_crossing
from sparsedecode.timing.spec import load_spec


@pytest.fixture
def sweep(tmp_path):
    """proj - sel = -1 ms at 32K and +1 ms at 64K in every block, dense flat: crossing at 48K."""
    root = tmp_path / "sweep"
    for b in range(2):
        for n, (tp, ts) in {32768: (8.0, 9.0), 65536: (9.0, 8.0)}.items():
            _write(root, "sweep", "dense", n, b, 10.0, mode_spec="dense")
            _write(root, "sweep", "proj50", n, b, tp, bytes_per_step=0.6e10, mode_spec="proj0.5")
            _write(root, "sweep", "sel30", n, b, ts, bytes_per_step=0.7e10, mode_spec="sel0.3")
    return root


def test_the_prediction_is_a_record_of_the_sweep(sweep):
    p = predict_crossing(sweep, "sweep")
    assert p["kind"] == "crossing_prediction" and (p["proj"], p["sel"]) == ("proj0.5", "sel0.3")
    assert p["predicted_tokens"] == pytest.approx(49152.0, rel=1e-6)
    assert p["model"] == "llama-3.1-8b" and p["contexts"] == [32768, 65536] and "env" in p
    with pytest.raises(InputError, match="no group 'other'"):
        predict_crossing(sweep, "other")


def test_contexts_are_spaced_around_the_prediction_inside_the_window():
    assert crossing_contexts(49152.0, 8192, 16384, None) == [32768, 40960, 49152, 57344, 65536]
    assert crossing_contexts(120000.0, 8192, 16384, 131008) == [98304, 106496, 114688, 122880]  # 131072 is past it
    with pytest.raises(InputError, match="fewer than two contexts"):
        crossing_contexts(140000.0, 8192, 8192, 131008)


def test_the_cli_writes_both_and_never_overwrites(sweep, tmp_path, capsys):
    pred, spec = tmp_path / "p.json", tmp_path / "crossing.toml"
    args = ["campaign", "plan-crossing", str(sweep), "--prediction", str(pred), "--spec", str(spec),
            "--half-width", "16K"]
    r = run_cli(capsys, *args)
    assert r.returncode == 0, r.stderr
    rec = json.loads(pred.read_text())
    c = load_spec(spec)  # a campaign the harness runs
    (g,) = c.grids
    assert g.contexts == tuple(rec["planned_contexts"]) == (32768, 40960, 49152, 57344, 65536)
    assert set(g.modes) == {"proj0.5", "sel0.3"} and c.blocks == 3 and c.name == "crossing"
    again = run_cli(capsys, *args)
    assert again.returncode == 2 and "never overwritten" in again.stderr
    wide = run_cli(capsys, *args[:-2], "--spacing", "16K", "--prediction", str(tmp_path / "q.json"),
                   "--spec", str(tmp_path / "q.toml"))
    assert wide.returncode == 2 and "at most 8K apart" in wide.stderr


def test_a_crossing_grid_pairs_proj_with_sel_only(tmp_path):
    head = 'name = "c"\nmodel = "llama-3.1-8b"\nblocks = 3\n[[grid]]\ngroup = "g"\ncontexts = [4096, 8192]\n'
    for modes, pairs, needle in ((["proj0.5", "proj0.7"], "crossing", "one proj and one sel"),
                                 (["dense", "proj0.5", "sel0.3"], "crossing", "one proj and one sel"),
                                 (["proj0.5", "sel0.3"], "magic", "not 'dense' or 'crossing'"),
                                 (["proj0.5", "sel0.3"], "dense", "lacks 'dense'")):
        f = tmp_path / "c.toml"
        f.write_text(head + f"modes = {json.dumps(modes)}\npairs = \"{pairs}\"\n")
        with pytest.raises(InputError, match=needle):
            load_spec(f)


def test_the_report_sets_the_committed_prediction_beside_the_measurement(tmp_path, sweep):
    from sparsedecode.records import write_record
    from sparsedecode.report.timing_markdown import render_markdown
    from sparsedecode.timing.analysis import build_report
    from sparsedecode.timing.cells import load_cells

    root = tmp_path / "crossing"
    for b in range(3):
        for n, (tp, ts) in {40960: (8.5, 9.0), 57344: (9.0, 8.5)}.items():
            _write(root, "crossing", "proj50", n, b, tp, bytes_per_step=0.6e10, mode_spec="proj0.5")
            _write(root, "crossing", "sel30", n, b, ts, bytes_per_step=0.7e10, mode_spec="sel0.3")
    write_record(root / "prediction.json", predict_crossing(sweep, "sweep"))
    rep = build_report(load_cells(root))
    (g,) = rep["groups"]
    assert g["crossing"]["committed"]["tokens"] == pytest.approx(49152.0, rel=1e-6)
    assert g["crossing"]["measured"]["value"] == pytest.approx(49152.0)
    assert "prediction committed before the campaign ran: 48K" in render_markdown(rep)
    pytest.importorskip("matplotlib")
    from sparsedecode.report.figures import fig4_advantage

    drawn = fig4_advantage(rep, tmp_path / "fig4.png")  # Figure 4 marks the committed prediction too
    assert "prediction committed before the run 48.0K" in drawn.get("labels", []), drawn


# -- a keep the sweep lacks (App. D): its cost at 32K from the keep-ratio campaign ---------------
def _bytes(n, rp, kv):
    from test_report import DIMS

    from sparsedecode.timing.cell import timed_step_bytes

    return timed_step_bytes(DIMS, n, rp, kv, 2, 2)


@pytest.fixture
def account_sweep(tmp_path):
    """8B-dims sweep whose step times follow App. D's model exactly: t_D = 10/12/14 ms at
    16K/32K/64K, costs proj 0.5/0.6/0.8 ms and sel 0.1/0.1/0.2 ms, bytes from the account."""
    root = tmp_path / "sweep"
    for b in range(2):
        for n, td, cp, cs in ((16384, 10.0, 0.5, 0.1), (32768, 12.0, 0.6, 0.1), (65536, 14.0, 0.8, 0.2)):
            bd, bp, bs = _bytes(n, 1, 1), _bytes(n, 0.5, 1), _bytes(n, 1, 0.3)
            _write(root, "sweep", "dense", n, b, td, mode_spec="dense", bytes_per_step=bd)
            _write(root, "sweep", "proj50", n, b, td * bp / bd + cp, bytes_per_step=bp, mode_spec="proj0.5")
            _write(root, "sweep", "sel30", n, b, td * bs / bd + cs, bytes_per_step=bs, mode_spec="sel0.3")
    return root


def _keep_campaign(tmp_path, costs: dict, gpu="NVIDIA H200"):
    """A keep campaign at 32K whose dense step is 11 ms (not the sweep's: only costs travel)."""
    root, n, td = tmp_path / "keep", 32768, 11.0
    bd = _bytes(n, 1, 1)
    for b in range(3):
        _write(root, "keep", "dense", n, b, td, mode_spec="dense", bytes_per_step=bd, gpu=gpu)
        for spec, c in costs.items():
            keep = float(spec[4:] if spec.startswith("proj") else spec[3:])
            proj = spec.startswith("proj")
            by = _bytes(n, keep, 1) if proj else _bytes(n, 1, keep)
            _write(root, "keep", spec.replace(".", ""), n, b, td * by / bd + c, gpu=gpu,
                   mode="proj" if proj else "sel", mode_spec=spec, bytes_per_step=by,
                   projection_keep=keep if proj else 1.0, kv_keep=1.0 if proj else keep,
                   realized_projection_keep=keep if proj else 1.0, kv_read_fraction=1.0 if proj else keep)
    return root


def _gap(rec, x):
    """t_proj - t_sel of the record's own model (App. D) at context x."""
    import numpy as np

    n = np.array(rec["contexts"], dtype=float)
    td = np.exp(np.interp(np.log(x), np.log(n), np.log(rec["dense_ms"])))
    rp = float(rec["proj"][4:]) if "substituted" not in rec or "proj" not in rec["substituted"] else \
        rec["substituted"]["proj"]["realized_keep"]
    kv = float(rec["sel"][3:])
    bd = _bytes(x, 1, 1)
    return (td * _bytes(x, rp, 1) / bd + np.interp(x, n, rec["cost_proj_ms"])
            - td * _bytes(x, 1, kv) / bd - np.interp(x, n, rec["cost_sel_ms"]))


def test_a_swept_keep_taken_from_the_keep_campaign_gives_the_swept_prediction(account_sweep, tmp_path):
    swept = predict_crossing(account_sweep, "sweep")
    assert swept["cost_proj_ms"] == pytest.approx([0.5, 0.6, 0.8]) and "substituted" not in swept
    assert _gap(swept, swept["predicted_tokens"] - 512) < 0 < _gap(swept, swept["predicted_tokens"] + 512)
    # the keep campaign says proj0.5 costs what the sweep says at 32K, sel0.3 0.1 ms more there
    keep = _keep_campaign(tmp_path, {"proj0.5": 0.6, "sel0.3": 0.2})
    same = predict_crossing(account_sweep, "sweep", proj="proj0.5", sel="sel0.3", keep_folder=keep)
    assert same["predicted_tokens"] == swept["predicted_tokens"]  # both swept: the sweep alone decides


def test_a_lacking_keep_shifts_the_swept_cost_by_its_32k_difference(account_sweep, tmp_path):
    keep = _keep_campaign(tmp_path, {"proj0.7": 0.35, "sel0.5": 0.05})
    rec = predict_crossing(account_sweep, "sweep", proj="proj0.7", keep_folder=keep)
    assert (rec["proj"], rec["sel"]) == ("proj0.7", "sel0.3")
    # c'(n) = 0.35 + c(n) - c(32K): the sweep's context dependence, the keep campaign's level
    assert rec["cost_proj_ms"] == pytest.approx([0.25, 0.35, 0.55])
    assert rec["cost_sel_ms"] == pytest.approx([0.1, 0.1, 0.2])
    sub = rec["substituted"]["proj"]
    assert (sub["swept"], sub["context"], sub["realized_keep"]) == ("proj0.5", 32768, pytest.approx(0.7))
    assert sub["cost_keep_campaign_ms"] == pytest.approx(0.35) and "additive" in rec["method"]
    x = rec["predicted_tokens"]
    assert _gap(rec, x - 512) < 0 < _gap(rec, x + 512)
    assert x < predict_crossing(account_sweep, "sweep")["predicted_tokens"]  # more keep: crosses sooner
    both = predict_crossing(account_sweep, "sweep", proj="proj0.7", sel="sel0.5", keep_folder=keep)
    assert both["cost_sel_ms"] == pytest.approx([0.05, 0.05, 0.15]) and set(both["substituted"]) == {"proj", "sel"}


def test_a_lacking_keep_without_its_cost_is_refused(account_sweep, tmp_path):
    with pytest.raises(InputError, match="keep_folder=DIR"):
        predict_crossing(account_sweep, "sweep", proj="proj0.7")
    keep = _keep_campaign(tmp_path, {"proj0.6": 0.4})
    with pytest.raises(InputError, match=r"no kernel cost of proj0.7 \(costed modes: proj0.6\)"):
        predict_crossing(account_sweep, "sweep", proj="proj0.7", keep_folder=keep)
    with pytest.raises(InputError, match="give a proj mode"):
        predict_crossing(account_sweep, "sweep", proj="sel0.5", keep_folder=keep)
    other = _keep_campaign(tmp_path / "a100", {"proj0.7": 0.4}, gpu="NVIDIA A100-SXM4-80GB")
    with pytest.raises(InputError, match="its own campaigns"):
        predict_crossing(account_sweep, "sweep", proj="proj0.7", keep_folder=other)
    with pytest.raises(InputError, match="no such folder"):
        predict_crossing(account_sweep, "sweep", keep_folder=tmp_path / "nope")


def test_the_cli_plans_a_pair_the_sweep_lacks(account_sweep, tmp_path, capsys):
    keep = _keep_campaign(tmp_path, {"proj0.7": 0.35})
    pred, spec = tmp_path / "p.json", tmp_path / "c70.toml"
    r = run_cli(capsys, "campaign", "plan-crossing", str(account_sweep), "--proj", "proj0.7",
                "--keep-campaign", str(keep), "--prediction", str(pred), "--spec", str(spec), "--half-width", "8K")
    assert r.returncode == 0, r.stderr
    rec = json.loads(pred.read_text())
    (g,) = load_spec(spec).grids
    assert set(g.modes) == {"proj0.7", "sel0.3"} and rec["keep_campaign"] == str(keep)
    bad = run_cli(capsys, "campaign", "plan-crossing", str(account_sweep), "--proj", "proj0.7",
                  "--prediction", str(tmp_path / "q.json"), "--spec", str(tmp_path / "q.toml"))
    assert bad.returncode == 2 and "--keep-campaign" in bad.stderr and "Traceback" not in bad.stderr
