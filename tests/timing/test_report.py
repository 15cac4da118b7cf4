"""`sparsedecode report DIR` on synthetic campaigns with known answers and on the paper's records.

Speedups, bounds and kernel costs follow ByteCross App. A and App. D, crossings
§4.3 / App. E, the figures Figures 3-5; the paper's sweep_a100 speedups are the
ones tests/timing/test_paper_records.py checks (§4.2).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sparsedecode.account import ModelDims, crossover
from sparsedecode.errors import InputError
from sparsedecode.report import figures
from sparsedecode.report.timing_markdown import render_markdown
from sparsedecode.report.timing_report import write_report
from sparsedecode.timing.analysis import build_report
from sparsedecode.timing.cells import load_cells
from sparsedecode.timing.costs import nominal_peak

RECORDS = Path(__file__).resolve().parents[2] / "data/bytecross"
DIMS = ModelDims.known("llama-3.1-8b")
PNG = b"\x89PNG\r\n\x1a\n"


def _write(root: Path, group: str, cell: str, context: int, block: int, ms: float | None = 10.0,
           *, mode: str | None = None, status: str = "ok", **over) -> Path:
    """One record in the harness's layout and format (kind 'timing_cell')."""
    mode = mode or {"d": "dense", "p": "proj", "s": "sel", "w": "window"}[cell[0]]
    rec = {
        "kind": "timing_cell", "status": status, "campaign": root.name, "block": block,
        "group": group, "cell": cell, "order": 0,
        "model": {"name": "llama-3.1-8b", "dims": DIMS.to_dict(), "init": "random"},
        "model_name": "llama-3.1-8b", "dtype": "bfloat16", "device": "cuda", "gpu": "NVIDIA H200",
        "mode": mode, "mode_spec": mode, "projection_keep": 0.5 if mode == "proj" else 1.0,
        "kv_keep": 0.3 if mode in ("sel", "window") else 1.0, "attention": "split_k",
        "compile_mode": "max-autotune-no-cudagraphs", "context": context, "generated": 64,
        "timestamp": "2026-01-01T00:00:00+00:00", "env": {"git_commit": "abc", "torch": "2.13"},
    }
    if status == "ok":
        rec.update(
            step_ms_runs=[ms] * 5, tokens_per_sec_runs=[1000 / ms] * 5, tokens_per_sec=1000 / ms,
            ms_per_token=ms, step_ms_median=ms, bytes_per_step=1e10, byte_bound=1.0,
            achieved_gbps=1e10 / ms / 1e6, peak_memory_bytes=2 * 10**9,
            realized_projection_keep=0.5 if mode == "proj" else 1.0,
            kv_read_fraction=0.3 if mode in ("sel", "window") else 1.0,
            one_time={"load_s": 1.0, "prefill_s": 2.0, "select_s": 0.25},
        )
    else:
        rec["error"] = "CUDA out of memory"
    rec.update(over)
    path = root / "cells" / group / f"{cell}_{context}_b{block}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec))
    return path


def _row(rep: dict, group: str, cell: str, context: int) -> dict:
    (g,) = [g for g in rep["groups"] if g["name"] == group]
    (r,) = [r for r in g["rows"] if r["cell"] == cell and r["context"] == context]
    return r


@pytest.fixture
def simple(tmp_path) -> Path:
    """Dense 10 ms and proj 8 ms in every block at 2K and 4K: speedup 1.25 exactly."""
    root = tmp_path / "simple"
    for n in (2048, 4096):
        for b in range(3):
            _write(root, "sweep", "dense", n, b, 10.0)
            _write(root, "sweep", "proj50", n, b, 8.0, bytes_per_step=0.7e10, byte_bound=1 / 0.7)
    return root


def test_paired_speedup_bound_cost_and_bandwidth(simple):
    rep = build_report(load_cells(simple))
    r = _row(rep, "sweep", "proj50", 2048)
    sp = r["speedup"]
    assert (sp["value"], sp["low"], sp["high"]) == pytest.approx((1.25, 1.25, 1.25))
    assert sp["n_resamples"] == 27
    assert r["fraction_of_bound"] == pytest.approx(1.25 * 0.7)
    assert r["kernel_cost_ms"]["value"] == pytest.approx(8.0 - 10.0 * 0.7)  # c_b = t_b - t_D B_b/B_D
    d = _row(rep, "sweep", "dense", 2048)
    assert d["achieved_gbps"] == pytest.approx(1000.0)
    assert d["fraction_of_peak"] == pytest.approx(1000.0 / 4800)  # nominal H200 peak
    assert rep["label"] is None and rep["missing"] == [] and rep["failed"] == []
    md = render_markdown(rep)
    assert "1.250× [1.250, 1.250]" in md and "| 2K | proj50 | proj | 3 | 8.000 |" in md


def test_peak_option_unknown_gpu_and_cpu_label(tmp_path):
    root = tmp_path / "odd"
    for b in range(2):
        _write(root, "g", "dense", 1024, b, 10.0, gpu="Mystery GPU 9000")
        _write(root, "g", "proj50", 1024, b, 5.0, gpu="Mystery GPU 9000")
    cc = load_cells(root)
    rep = build_report(cc)
    assert rep["peak_gbps"] is None and "Mystery GPU 9000" in rep["peak_note"]
    assert _row(rep, "g", "dense", 1024)["fraction_of_peak"] is None
    rep = build_report(cc, peak_gbps=2000.0)
    assert _row(rep, "g", "dense", 1024)["fraction_of_peak"] == pytest.approx(0.5)

    cpu = tmp_path / "cpu"
    for b in range(2):
        _write(cpu, "g", "dense", 1024, b, 10.0, gpu="CPU", device="cpu", label="CPU")
        _write(cpu, "g", "proj50", 1024, b, 5.0, gpu="CPU", device="cpu", label="CPU")
    rep = build_report(load_cells(cpu))
    assert rep["label"] == "CPU" and rep["peak_gbps"] is None
    assert render_markdown(rep).startswith("# Timing report: cpu — CPU")


@pytest.mark.parametrize(("gpu", "peak"), [
    ("NVIDIA H200", 4800), ("NVIDIA H100 80GB HBM3", 3350), ("NVIDIA A100-SXM4-80GB", 2039),
    ("NVIDIA A100-SXM4-40GB", 1555), ("NVIDIA RTX A6000", 768), ("NVIDIA GeForce RTX 4090", None),
])
def test_nominal_peaks(gpu, peak):
    assert nominal_peak(gpu)[0] == peak


@pytest.fixture
def crossing(tmp_path) -> Path:
    """proj - sel = -1 ms at 4K and +1 ms at 8K in every block, dense flat: crossing at 6K exactly."""
    root = tmp_path / "cross"
    for b in range(3):
        for n, (tp, ts) in {4096: (8.0, 9.0), 8192: (9.0, 8.0)}.items():
            _write(root, "sweep", "dense", n, b, 10.0)
            _write(root, "sweep", "proj50", n, b, tp, bytes_per_step=0.6e10, byte_bound=1 / 0.6)
            _write(root, "sweep", "sel30", n, b, ts, bytes_per_step=0.7e10, byte_bound=1 / 0.7)
    return root


def test_measured_and_predicted_crossing(crossing):
    rep = build_report(load_cells(crossing))
    (g,) = rep["groups"]
    x = g["crossing"]
    m = x["measured"]
    assert (m["value"], m["low"], m["high"]) == pytest.approx((6144.0, 6144.0, 6144.0))
    assert [r["difference_ms"]["value"] for r in x["rows"]] == pytest.approx([-1.0, 1.0])
    assert [r["sel_faster_blocks"] for r in x["rows"]] == [0, 3]
    # flat t_D and byte ratios, linear costs: the App. D prediction crosses where the data do
    assert x["predicted"]["tokens"] == pytest.approx(6144.0, rel=1e-6)
    assert x["predicted"]["source_group"] == "sweep"
    assert x["predicted"]["cost_proj_ms"] == pytest.approx([8.0 - 6.0, 9.0 - 6.0])
    assert x["byte_crossover"]["tokens"] == pytest.approx(crossover(DIMS, 0.5, 0.3))
    md = render_markdown(rep)
    assert "measured crossing: 6K [6K, 6K]" in md and "cost-aware prediction: 6K" in md


def test_crossing_group_predicted_from_sweep_group(crossing):
    # A crossing campaign (proj and sel only, App. E) borrows t_D and costs from the sweep.
    for b in range(3):
        for n, (tp, ts) in {5120: (8.0, 8.5), 7168: (9.0, 8.5)}.items():
            _write(crossing, "p50_s30", "proj50", n, b, tp)
            _write(crossing, "p50_s30", "sel30", n, b, ts)
    rep = build_report(load_cells(crossing))
    (g,) = [g for g in rep["groups"] if g["name"] == "p50_s30"]
    assert g["crossing"]["measured"]["value"] == pytest.approx(6144.0)
    assert g["crossing"]["predicted"]["source_group"] == "sweep"
    assert rep["groups_without_dense"] == ["p50_s30"]
    assert len(rep["missing"]) == 12
    assert "group `p50_s30` has no dense cells" in render_markdown(rep)


def test_failed_cell_and_missing_pair_are_reported(simple):
    _write(simple, "sweep", "dense", 8192, 0, status="failed", ms=None)
    _write(simple, "sweep", "proj50", 8192, 0, 8.0)
    _write(simple, "sweep", "dense", 8192, 1, 10.0)
    _write(simple, "sweep", "proj50", 8192, 1, 8.0)
    cc = load_cells(simple)
    assert [(f.cell, f.context, f.block) for f in cc.failed] == [("dense", 8192, 0)]
    assert [(m.cell, m.context, m.block) for m in cc.missing] == [("proj50", 8192, 0)]
    rep = build_report(cc)
    r = _row(rep, "sweep", "proj50", 8192)
    assert r["speedup"]["n_resamples"] == 1 and r["speedup"]["value"] == pytest.approx(1.25)
    assert "1 block(s) without a dense partner" in r["note"]
    md = render_markdown(rep)
    assert "CUDA out of memory" in md
    assert "`sweep` proj50 at 8K, block 0 (proj50_8192_b0.json)" in md


def test_retried_failures_are_counted(simple):
    retired = simple / "failed" / "sweep" / "dense_2048_b0.1.json"
    retired.parent.mkdir(parents=True)
    retired.write_text(json.dumps({"kind": "timing_cell", "status": "failed", "error": "OOM"}))
    rep = build_report(load_cells(simple))
    assert rep["retired"] == 1 and rep["failed"] == []
    assert "1 earlier failed attempt(s) were retried" in render_markdown(rep)


def test_figures_are_pngs(crossing, tmp_path):
    for n in (4096, 8192):
        for b in range(3):
            for group, att, window_ms in (("attn_masked", "sdpa_masked", 2.0),
                                          ("attn_splitk", "split_k", 8.0)):
                _write(crossing, group, "dense", n, b, 10.0 + (5.0 if att == "sdpa_masked" else 0.0),
                       attention=att, runtime="CUDA graph")
                _write(crossing, group, "window30", n, b, window_ms, attention=att, byte_bound=1.4,
                       runtime="CUDA graph")
    rep, md = write_report(crossing, tmp_path / "out")
    assert [{k: v for k, v in cl.items() if k != "against_dense"} for cl in rep["attention_paths"]] == [
        {"cells": ["dense", "window30"], "groups": [
        {"group": "attn_masked", "attention": "sdpa_masked", "runtime": ["CUDA graph"]},
        {"group": "attn_splitk", "attention": "split_k", "runtime": ["CUDA graph"]}]}]
    assert "`attn_masked` (sdpa_masked, CUDA graph)" in md
    # the split-K window (8 ms) priced against each path's dense cell: 15 ms masked, 10 ms split-K
    got = {(a["context"], a["dense_attention"]): a["speedup"]["value"]
           for a in rep["attention_paths"][0]["against_dense"]}
    assert got == {(n, att): pytest.approx(v) for n in (4096, 8192)
                   for att, v in (("sdpa_masked", 15 / 8), ("split_k", 10 / 8))}
    for name in figures.FIGURES:
        path = Path(rep["figures"][name]["path"])
        data = path.read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, name
    assert (tmp_path / "out" / "report.md").read_text() == md
    assert "![fig5_attention.png](fig5_attention.png)" in md


def test_figures_skip_with_reason(simple, tmp_path):
    rep, md = write_report(simple, tmp_path / "out")
    assert "path" in rep["figures"]["fig3_speedup.png"]
    assert "proj and one sel" in rep["figures"]["fig4_advantage.png"]["skipped"]
    assert "attention path" in rep["figures"]["fig5_attention.png"]["skipped"]
    assert not (tmp_path / "out" / "fig4_advantage.png").exists()
    assert "fig4_advantage.png: skipped" in md


def test_bad_folders(tmp_path):
    with pytest.raises(InputError, match="not found"):
        load_cells(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no timing records"):
        load_cells(tmp_path / "empty")
    bad = tmp_path / "bad"
    p = _write(bad, "g", "dense", 1024, 0)
    rec = json.loads(p.read_text())
    del rec["ms_per_token"]
    p.write_text(json.dumps(rec))
    with pytest.raises(InputError, match=r"dense_1024_b0\.json: timing record lacks field 'ms_per_token'"):
        load_cells(bad)
    p.write_text(json.dumps({**rec, "ms_per_token": "fast"}))
    with pytest.raises(InputError, match=r"dense_1024_b0\.json: field 'ms_per_token' is 'fast'"):
        load_cells(bad)
    p.write_text("{not json")
    with pytest.raises(InputError, match=r"dense_1024_b0\.json: not a JSON"):
        load_cells(bad)
    p.write_text(json.dumps({**rec, "ms_per_token": 10.0, "status": "maybe"}))
    with pytest.raises(InputError, match="'status' is 'maybe'"):
        load_cells(bad)
    p.write_text(json.dumps({**rec, "ms_per_token": 10.0, "kind": "ppl_chunked"}))
    with pytest.raises(InputError, match="field 'kind' is 'ppl_chunked'"):
        load_cells(bad)


def test_mixed_gpus_models_and_duplicates(tmp_path):
    mixed = tmp_path / "mixed"
    _write(mixed, "g", "dense", 1024, 0)
    _write(mixed, "g", "dense", 1024, 1, gpu="NVIDIA A100-SXM4-80GB")
    with pytest.raises(InputError, match="several GPUs.*A100.*H200"):
        load_cells(mixed)
    models = tmp_path / "models"
    _write(models, "g", "dense", 1024, 0)
    _write(models, "g", "dense", 1024, 1, model_name="qwen3-8b", status="failed", ms=None)
    with pytest.raises(InputError, match="several models"):
        load_cells(models)
    dup = tmp_path / "dup"
    _write(dup, "g", "dense", 1024, 0)
    other = dup / "cells" / "g" / "copy.json"
    other.write_text((dup / "cells" / "g" / "dense_1024_b0.json").read_text())
    with pytest.raises(InputError, match="also recorded in"):
        load_cells(dup)


@pytest.fixture(scope="module")
def sweep_a100() -> Path:
    folder = RECORDS / "sweep_a100"
    if not folder.is_dir():
        pytest.skip(f"ByteCross records not found at {folder}")
    return folder


def test_paper_sweep_renders_figure3_speedups(sweep_a100, tmp_path):
    rep, md = write_report(sweep_a100, tmp_path)
    assert rep["source"] == "bytecross" and rep["missing"] == [] and rep["n_ok"] == 96
    for cell, n, expected in (("proj50", 2048, 1.36), ("sel30", 131072, 1.54), ("p50_s30", 131072, 1.91)):
        sp = _row(rep, "sweep", cell, n)["speedup"]
        assert sp["value"] == pytest.approx(expected, abs=0.005) and sp["n_resamples"] == 27
    # App. D: the projection branch costs 1.9-2.3 ms beyond its byte time on A100, the selection < 0.8 ms
    (g,) = rep["groups"]
    costs = {r["cell"]: [] for r in g["rows"]}
    for r in g["rows"]:
        if r["kernel_cost_ms"]:
            costs[r["cell"]].append(r["kernel_cost_ms"]["value"])
    assert len(costs["proj50"]) == 8 and all(1.85 < c < 2.3 for c in costs["proj50"])
    assert all(c < 0.8 for c in costs["sel30"])
    x = g["crossing"]
    assert x["byte_crossover"]["tokens"] / 1024 == pytest.approx(74.3, abs=0.05)  # Table 2 n*
    assert 32768 < x["measured"]["value"] < 65536  # §4.2: the selection overtakes between 32K and 64K
    assert abs(x["predicted"]["tokens"] - 50.4 * 1024) < 4.1 * 1024  # within 4.1K of Table 2's 50.4K
    assert _row(rep, "sweep", "dense", 131072)["fraction_of_peak"] == pytest.approx(0.739, abs=0.005)
    assert (tmp_path / "fig3_speedup.png").read_bytes().startswith(PNG)
    assert "| 128K | sel30 | sel | 3 | 13.853 | 1.543× [" in md


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "sparsedecode", "report", *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_json_and_errors(simple, tmp_path):
    r = _cli(str(simple), "--json", "--no-figures", "--peak-gbps", "2000")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["kind"] == "timing_report" and out["peak_gbps"] == 2000
    assert _row(out, "sweep", "proj50", 4096)["speedup"]["value"] == pytest.approx(1.25)
    assert (simple / "report" / "report.md").is_file() and "figures" not in out
    r = _cli(str(tmp_path / "missing_dir"))
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "not found" in r.stderr
    r = _cli(str(simple), "--peak-gbps", "-3")
    assert r.returncode == 2 and "--peak-gbps must be positive" in r.stderr


def test_dense_steps_set_every_dense_step_beside_the_fastest_of_ours(tmp_path):
    """Two of our dense steps (F.linear, our GEMV) and a peer at 2K: the GEMV is the fastest of
    ours, the others are divided by it block by block; a context with one dense step has no rows."""
    root = tmp_path / "dense_steps"
    for b, (gemv, linear, peer) in enumerate([(4.0, 5.0, 6.0), (4.0, 4.8, 6.6)]):
        _write(root, "short", "dense", 2048, b, gemv, dense_step="our GEMV reading every row")
        _write(root, "short.gemv.dense-false", "dense", 2048, b, linear, dense_step="F.linear under inductor")
        _write(root, "transformers", "dense", 2048, b, peer, impl="transformers", dense_step="transformers forward")
        _write(root, "long", "dense", 131072, b, 9.0)
    rep = build_report(load_cells(root))
    rows = rep["dense_steps"]
    assert [(r["group"], r["impl"], r["fastest_ours"]) for r in rows] == [
        ("short", "ours", True), ("short.gemv.dense-false", "ours", False), ("transformers", "transformers", False)]
    assert rows[0]["fastest_ours_speedup"] is None
    assert rows[1]["fastest_ours_speedup"]["value"] == pytest.approx((5.0 / 4 + 4.8 / 4) / 2)
    assert rows[2]["fastest_ours_speedup"]["value"] == pytest.approx((6.0 / 4 + 6.6 / 4) / 2)
    md = render_markdown(rep)
    assert "## Dense steps" in md and "| 2K | short | dense | ours | our GEMV reading every row | 4.000 |" in md
    assert "| transformers forward | 6.300 |" in md and "| 1.575× [" in md


def test_a_peer_alone_at_a_context_is_not_a_dense_steps_row(tmp_path):
    root = tmp_path / "peer_only"
    for b in range(2):
        _write(root, "graph", "dense", 2048, b, 5.0, impl="graph")
        _write(root, "transformers", "dense", 2048, b, 6.0, impl="transformers")
    assert build_report(load_cells(root))["dense_steps"] == []


def test_the_report_says_where_each_cells_device_time_went(tmp_path):
    """Means over cells of the recorded one-time parts and their phases, the timed steps at the
    measured step time, the median gap between records and what the records do not account for."""

    root = tmp_path / "overhead"
    spec = {"warmup": 5, "repeats": 5, "steps": 50}  # 255 steps: 2.55 s at 10 ms
    for k, (cell, cap) in enumerate((("dense", 10.0), ("proj50", 20.0))):
        _write(root, "g", cell, 4096, 0, 10.0, spec=spec, timestamp=f"2026-01-01T00:00:{30 * k:02d}+00:00",
               one_time={"load_s": 6.0, "prefill_s": 0.5, "capture_s": cap},
               phases={"load": {"build_s": 4.0, "engine_s": 2.0}, "capture": {"first_call_s": cap - 1}})
    o = build_report(load_cells(root))["overhead"]
    parts = {name: v for name, v, _ in o["parts"]}
    assert parts["capture"] == 15.0 and parts["capture: first_call"] == 14.0 and parts["load: build"] == 4.0
    assert [name for name, _, _ in o["parts"]][:3] == ["load", "load: build", "load: engine"]
    assert o["timed_s"] == pytest.approx(2.55) and o["gap_s"] == 30.0
    assert o["rest_s"] == pytest.approx(30.0 - 6.0 - 0.5 - 15.0 - 2.55)
    md = render_markdown(build_report(load_cells(root)))
    assert "| capture: first_call | 14.00 | 2 |" in md and "| the rest of the gap" in md
    assert build_report(load_cells(RECORDS / "crossing_a100_1"))["overhead"] is None  # the paper's keep none
