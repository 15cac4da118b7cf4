"""The CPU smoke campaign of the timing protocol, end to end (ByteCross App. A 'Timing'):
examples/campaigns/cpu_smoke.toml — smollm2-135m, 2 contexts x 3 modes x 2 blocks, each
cell a fresh process after a dense prefill of WikiText-2 test — and its report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import require_embedded
from sparsedecode.cli import app
from sparsedecode.timing.campaign import load_spec, plan, run_campaign

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "campaigns"


@pytest.mark.slow
def test_cpu_smoke_campaign_runs_and_its_report_renders(tmp_path):
    require_embedded("smollm2-135m")  # each cell loads it: a GPU machine without network skips
    text = (EXAMPLES / "cpu_smoke.toml").read_text()
    assert "\nseed = 0\n" in text
    assert "contexts = [256, 512]" in text
    spec = tmp_path / "cpu_smoke.toml"
    # one context of the example's two: each cell is a process of its own, and CI runs on 2 cores
    # no text line: the cells read the WikiText-2 the package ships
    spec.write_text(text.replace("contexts = [256, 512]", "contexts = [256]"))
    out = tmp_path / "run"
    summary = run_campaign(spec, out, progress=False, echo=lambda line: None)
    assert (summary.ok, summary.failed, summary.pending) == (6, 0, 0), summary.failures
    cells = plan(load_spec(spec))
    for c in cells:
        rec = json.loads((out / "cells" / c.group / f"{c.cell}_{c.context}_b{c.block}.json").read_text())
        assert rec["status"] == "ok" and rec["label"] == "CPU" and rec["stream"] == "wiki.test.raw"
        assert rec["ms_per_token"] > 0 and len(rec["step_ms_runs"]) == 2

    res = CliRunner().invoke(app, ["report", str(out), "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["label"] == "CPU"
    (group,) = rep["groups"]
    speedups = [r for r in group["rows"] if r["cell"] != "dense"]
    assert len(speedups) == 2  # proj50 and sel30, each paired over 2 blocks
    assert all(r["blocks"] == [0, 1] and r["speedup"]["n_resamples"] == 4 and r["speedup"]["value"] > 0 for r in speedups)
    assert (out / "report" / "report.md").read_text().count("CPU") >= 1
    assert (out / "report" / "fig3_speedup.png").stat().st_size > 0
