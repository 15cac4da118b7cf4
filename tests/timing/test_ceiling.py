"""The measured bandwidth ceiling (`sparsedecode bench ceiling`) and the report's share of it."""

from __future__ import annotations

import pytest
from test_report import _row, _write

from sparsedecode.errors import InputError
from sparsedecode.records import write_record
from sparsedecode.report.timing_markdown import render_markdown
from sparsedecode.timing.analysis import build_report
from sparsedecode.timing.ceiling import measure_ceiling, read_ceiling
from sparsedecode.timing.cells import load_cells


def test_a_cpu_ceiling_is_a_record_of_what_it_read(tmp_path):
    rec = measure_ceiling(device="cpu", dtype="float32", gib=1 / 64, replays=3, calls=2)
    assert rec["kind"] == "bandwidth_ceiling" and rec["label"] == "CPU" and rec["gpu"] == "CPU"
    assert rec["bytes_per_call"] >= 2**30 / 64 and len(rec["gbps_runs"]) == 3
    assert min(rec["gbps_runs"]) <= rec["gbps"] <= max(rec["gbps_runs"]) and rec["gbps"] > 0
    assert rec["gpu_neighbors"] == {"before": [], "after": []}  # a CPU run has no GPU to share
    path = write_record(tmp_path / "ceiling.json", rec)
    assert read_ceiling(path)["gbps"] == rec["gbps"]


def _ceiling(path, gbps: float, gpu: str = "NVIDIA H200"):
    write_record(path, {"kind": "bandwidth_ceiling", "gpu": gpu, "gbps": gbps, "method": "test"})


def test_the_report_gives_every_mode_its_share_of_the_ceiling(tmp_path):
    root = tmp_path / "c"
    for b in range(2):
        _write(root, "g", "dense", 2048, b, 10.0, bytes_per_step=1.6e10, achieved_gbps=1600.0)
        _write(root, "g", "proj50", 2048, b, 8.0, bytes_per_step=0.8e10, byte_bound=2.0, achieved_gbps=1000.0)
    cc = load_cells(root)
    rep = build_report(cc)
    assert rep["ceiling_gbps"] is None and "bench ceiling" in rep["ceiling_note"]
    assert _row(rep, "g", "proj50", 2048)["fraction_of_ceiling"] is None
    _ceiling(root / "ceiling.json", 4000.0)  # the folder's own ceiling is read by default
    rep = build_report(cc)
    assert _row(rep, "g", "dense", 2048)["fraction_of_ceiling"] == pytest.approx(1600 / 4000)
    assert _row(rep, "g", "proj50", 2048)["fraction_of_ceiling"] == pytest.approx(1000 / 4000)
    assert _row(rep, "g", "proj50", 2048)["fraction_of_peak"] == pytest.approx(1000 / 4800)
    assert "% of ceiling" in render_markdown(rep) and "| 25.0 |" in render_markdown(rep)
    other = tmp_path / "other.json"
    _ceiling(other, 2000.0)
    assert _row(build_report(cc, ceiling=other), "g", "dense", 2048)["fraction_of_ceiling"] == pytest.approx(0.8)
    _ceiling(tmp_path / "a100.json", 1800.0, gpu="NVIDIA A100-SXM4-80GB")
    with pytest.raises(InputError, match="measured on NVIDIA A100"):
        build_report(cc, ceiling=tmp_path / "a100.json")
    write_record(tmp_path / "cell.json", {"kind": "timing_cell"})
    with pytest.raises(InputError, match="not a bandwidth ceiling record"):
        build_report(cc, ceiling=tmp_path / "cell.json")
