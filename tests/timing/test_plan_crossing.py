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
    from sparsedecode.report.timing_report import build_report, render_markdown
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
