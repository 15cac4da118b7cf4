"""Timing records are input (issue 48): one validator (`cells.check_ok_record`, through
`folder.finished`) serves report, dispatch, merge, a resume and `campaign status`. NaN,
infinity and non-positive times are refused everywhere; a record that only says
{"status": "ok"} is not a finished cell: a resume moves it to failed/ and runs the cell again."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_campaign import FakeCells, toml, write_spec
from test_report import _write

from conftest import run_cli
from sparsedecode.errors import InputError
from sparsedecode.timing import campaign
from sparsedecode.timing.campaign import load_spec, plan, record_path, run_campaign, status
from sparsedecode.timing.cells import load_cells
from sparsedecode.timing.folder import finished
from sparsedecode.timing.merge import merge_campaigns
from sparsedecode.timing.plan import crossing_spec

QUIET = dict(progress=False, echo=lambda line: None)
EXAMPLES = Path(__file__).resolve().parents[2] / "examples/campaigns"

BAD = [  # field overrides of an ok record, and the words of the refusal
    ({"ms_per_token": float("nan")}, "'ms_per_token' is nan"),
    ({"ms_per_token": float("inf")}, "'ms_per_token' is inf"),
    ({"ms_per_token": 0.0}, "'ms_per_token' is 0.0, expected a positive number"),
    ({"ms_per_token": -2.0}, "'ms_per_token' is -2.0"),
    ({"tokens_per_sec": 0}, "'tokens_per_sec' is 0"),
    ({"tokens_per_sec": float("-inf")}, "'tokens_per_sec' is -inf"),
    ({"tokens_per_sec_runs": [100.0, float("nan")]}, "tokens_per_sec_runs"),
    ({"tokens_per_sec_runs": [100.0, float("inf")]}, "tokens_per_sec_runs"),
    ({"step_ms_median": float("nan")}, "'step_ms_median' is nan"),
    ({"step_ms_median": -1.0}, "'step_ms_median' is -1.0"),
    ({"byte_bound": float("inf")}, "'byte_bound' is inf"),
    ({"one_time": {"select_s": float("nan")}}, "'one_time.select_s' is nan"),
    ({"ms_per_token": None}, "lacks field 'ms_per_token'"),
    ({"ms_per_token": True}, "'ms_per_token' is True"),
]


def _folder(tmp_path: Path, **over) -> tuple[Path, Path]:
    root = tmp_path / "camp"
    for b in range(2):
        _write(root, "sweep", "dense", 2048, b, 10.0)
    bad = _write(root, "sweep", "proj50", 2048, 0, 8.0, **over)
    _write(root, "sweep", "proj50", 2048, 1, 8.0)
    return root, bad


@pytest.mark.parametrize("over, words", BAD, ids=[next(iter(o)) + "=" + repr(next(iter(o.values())))[:20]
                                                  for o, _ in BAD])
def test_report_and_dispatch_refuse_a_spoiled_record_in_one_line(tmp_path, capsys, over, words):
    root, bad = _folder(tmp_path, **over)
    with pytest.raises(InputError) as e:
        load_cells(root)
    assert str(e.value).startswith(str(bad)) and words in str(e.value) and "\n" not in str(e.value)
    assert finished(bad)[1].startswith("incomplete record: ")  # a resume retries it
    for args in (("report", str(root), "--out", str(tmp_path / "rep")),
                 ("dispatch", "table", str(root), "--select-seconds", "0.2", "--out", str(tmp_path / "g.json"))):
        r = run_cli(capsys, *args)
        assert r.returncode == 2 and "Traceback" not in r.stderr and words in r.stderr, (args, r.stderr)
        assert r.stderr.count("\n") == 1, r.stderr


def test_the_papers_records_refuse_nan_too(tmp_path):
    src = Path(__file__).resolve().parents[2] / "data/bytecross/sweep_a100"
    if not src.is_dir():
        pytest.skip("the paper's records are not next to the checkout")
    folder = tmp_path / "sweep"
    shutil.copytree(src, folder)
    first = sorted(folder.glob("*.json"))[0]
    rec = json.loads(first.read_text())
    first.write_text(json.dumps({**rec, "ms_per_token": float("nan")}))
    with pytest.raises(InputError, match="'ms_per_token' is nan"):
        load_cells(folder)


@pytest.fixture
def tiny_spec(tmp_path):
    from test_campaign import TINY

    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(TINY))
    return write_spec(tmp_path, toml(str(cfg)))


def test_an_ok_record_without_timings_is_rerun_on_resume(tiny_spec, tmp_path, monkeypatch):
    out = tmp_path / "run"
    cells = plan(load_spec(tiny_spec))
    monkeypatch.setattr(campaign, "launch", FakeCells())
    run_campaign(tiny_spec, out, **QUIET)
    bare, nan = record_path(out, cells[1]), record_path(out, cells[2])
    bare.write_text(json.dumps({"status": "ok"}))
    nan.write_text(json.dumps({**json.loads(nan.read_text()), "ms_per_token": float("nan")}))
    st = status(out)  # status counts them as failed, with why
    errors = {f["path"]: f["error"] for f in st["failed"]}
    assert st["groups"]["sweep"]["failed"] == 2 and set(errors) == {str(bare), str(nan)}
    assert errors[str(nan)].startswith("incomplete record: ") and "ms_per_token" in errors[str(nan)]
    fake = FakeCells()
    monkeypatch.setattr(campaign, "launch", fake)
    s = run_campaign(tiny_spec, out, **QUIET)
    assert (s.retried, s.ok, s.skipped) == (2, 2, len(cells) - 2)
    assert sorted(fake.calls) == sorted([bare.name, nan.name])
    kept = sorted(p.name for p in (out / "failed").rglob("*.json"))  # moved aside, never deleted
    assert kept == sorted([bare.stem + ".1.json", nan.stem + ".1.json"])
    assert finished(bare)[1] is None and status(out)["groups"]["sweep"]["done"] == len(cells)


def test_a_cell_process_that_writes_an_incomplete_ok_record_counts_as_failed(tiny_spec, tmp_path, monkeypatch):
    class Bare(FakeCells):
        def __call__(self, argv, log, env=None, running=None, nice=None):
            out = Path(argv[argv.index("--out") + 1])
            self.calls.append(out.name)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"kind": "timing_cell", "status": "ok"}))
            return 0

    monkeypatch.setattr(campaign, "launch", Bare())
    s = run_campaign(tiny_spec, tmp_path / "run", **QUIET)
    assert s.ok == 0 and s.failed == len(plan(load_spec(tiny_spec)))
    assert "incomplete record" in s.failures[0]


def test_merge_puts_a_complete_record_over_an_incomplete_one(tiny_spec, tmp_path, monkeypatch):
    monkeypatch.setattr(campaign, "launch", FakeCells())
    a, b = tmp_path / "a", tmp_path / "b"
    run_campaign(tiny_spec, a, **QUIET)
    run_campaign(tiny_spec, b, **QUIET)
    cell = record_path(a, plan(load_spec(tiny_spec))[0])
    cell.write_text(json.dumps({"kind": "timing_cell", "status": "ok"}))  # 'a' holds an incomplete record
    s = merge_campaigns([b], a)
    assert s.replaced == 1 and finished(cell)[1] is None
    assert len(list((a / "failed").rglob("*.json"))) == 1  # the incomplete one kept as history


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.toml")))
def test_campaign_status_of_every_example_grid(tmp_path, example, capsys):
    """Grids with kernel variants are groups of their own (h200_dense_gemv*.toml raised KeyError)."""
    folder = tmp_path / "c"
    folder.mkdir()
    shutil.copy(EXAMPLES / example, folder / "spec.toml")
    st = status(folder)
    assert st["total"] == sum(g["pending"] for g in st["groups"].values()) == len(st["pending"])
    r = run_cli(capsys, "campaign", "status", str(folder), "--json")
    assert r.returncode == 0, r.stderr


def test_campaign_status_counts_variant_groups(tmp_path):
    folder = tmp_path / "c"
    folder.mkdir()
    shutil.copy(EXAMPLES / "h200_dense_gemv.toml", folder / "spec.toml")
    groups = status(folder)["groups"]
    assert {"short", "short.gemv.dense-false", "long", "long.gemv.dense-false"} <= set(groups)


def test_plan_crossing_refuses_names_a_spec_cannot_hold(tmp_path, capsys):
    root = tmp_path / "sweep"
    bad = 'llama"\n[[grid]]'
    for b in range(2):
        for n, (tp, ts) in {32768: (8.0, 9.0), 65536: (9.0, 8.0)}.items():
            _write(root, "sweep", "dense", n, b, 10.0, mode_spec="dense", model_name=bad)
            _write(root, "sweep", "proj50", n, b, tp, bytes_per_step=0.6e10, mode_spec="proj0.5", model_name=bad)
            _write(root, "sweep", "sel30", n, b, ts, bytes_per_step=0.7e10, mode_spec="sel0.3", model_name=bad)
    pred, spec = tmp_path / "p.json", tmp_path / "c.toml"
    r = run_cli(capsys, "campaign", "plan-crossing", str(root), "--prediction", str(pred), "--spec", str(spec),
                "--half-width", "16K")
    assert r.returncode == 2 and "cannot hold" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not pred.exists() and not spec.exists()  # nothing written


@pytest.mark.parametrize("field, value, words", [
    ("proj", "sel0.5", "one proj and one sel"),
    ("sel", "nonsense", "modes"),
    ("model", "", "cannot hold"),
    ("model", "a\\b", "cannot hold"),
])
def test_crossing_spec_checks_what_it_writes(field, value, words):
    pred = {"proj": "proj0.5", "sel": "sel0.3", "model": "llama-3.1-8b", "predicted_tokens": 49152.0,
            "source": "sweep", "group": "sweep", field: value}
    cell = {"dtype": "bfloat16", "device": "cuda", "model": {"init": "random"}}
    with pytest.raises(InputError, match=words):
        crossing_spec(pred, "crossing", [40960, 49152, 57344], 3, cell)
    with pytest.raises(InputError, match="dtype"):
        crossing_spec({**pred, field: {"proj": "proj0.5", "sel": "sel0.3", "model": "llama-3.1-8b"}[field]},
                      "crossing", [40960, 49152, 57344], 3, {**cell, "dtype": 'x"\ny'})


def test_records_whose_dims_describe_no_model_are_refused_not_replaced(tmp_path):
    from test_report import DIMS

    root, _ = _folder(tmp_path)
    for p in (root / "cells").rglob("*.json"):
        rec = json.loads(p.read_text())
        rec["model"]["dims"] = {**DIMS.to_dict(), "n_kv_heads": 0}
        p.write_text(json.dumps(rec))
    with pytest.raises(InputError, match="n_kv_heads' is 0"):
        load_cells(root)  # never the known llama-3.1-8b dims in their place
