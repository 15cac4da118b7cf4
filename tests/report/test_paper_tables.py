"""The paper's Tables 2 and 4 and Figure 6 (left) on our records: crossings beside their
committed predictions, kernel costs against keep beside the paper's A100 values, and the
composition under ΔPPL budgets (ByteCross §4.3, §5.3, App. D, App. H)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "timing"))
from test_report import _write  # noqa: E402

from sparsedecode.errors import InputError  # noqa: E402
from sparsedecode.report import composition  # noqa: E402
from sparsedecode.report.crossings import crossings_table, keep_costs_table  # noqa: E402
from sparsedecode.report.results import render  # noqa: E402
from sparsedecode.timing.paper_tables import crossing_row, keep_costs  # noqa: E402

N = 32768


def _grid(path: Path, deltas: dict[tuple[float, float], float], context: int = N) -> Path:
    """A grid in the paper's grid_ppl.json format: dense PPL 6, each setting 6 + ΔPPL."""
    res = [{"context": context, "projection_keep": p, "kv_keep": k, "ppl": 6.0 + d}
           for (p, k), d in {(1.0, 1.0): 0.0, **deltas}.items()]
    path.write_text(json.dumps({"results": res}))
    return path


def _timing(root: Path, ms: dict[str, list[float]], group: str = "keep") -> Path:
    """Cells at 32K: name -> step ms per block; 'dense' plus proj0.7, sel0.3, both0.7/0.3 style names."""
    for name, per_block in ms.items():
        for b, t in enumerate(per_block):
            if name == "dense":
                _write(root, group, "dense", N, b, t, mode_spec="dense")
                continue
            kind = "both" if name.startswith("both") else name[:4] if name.startswith("proj") else "sel"
            keeps = name.removeprefix("both").removeprefix("proj").removeprefix("sel")
            p, k = (keeps.split("/") if kind == "both" else (keeps, "1") if kind == "proj" else ("1", keeps))
            _write(root, group, name.replace("/", "_").replace(".", ""), N, b, t, mode=kind, mode_spec=name,
                   projection_keep=float(p), kv_keep=float(k))
    return root


def test_each_budget_picks_the_fastest_admissible_single_and_composition(tmp_path):
    grid = _grid(tmp_path / "g.json", {(0.7, 1.0): 0.15, (0.5, 1.0): 0.9, (1.0, 0.3): 0.01,
                                       (0.7, 0.3): 0.16, (0.5, 0.3): 0.95})
    t = _timing(tmp_path / "t", {"dense": [10.0, 10.0, 10.0], "proj0.7": [8.0, 8.0, 8.0],
                                 "proj0.5": [6.0, 6.0, 6.0], "sel0.3": [9.0, 9.0, 9.0],
                                 "both0.7/0.3": [7.0, 6.4, 7.0], "both0.5/0.3": [5.0, 5.0, 5.0]})
    rep = composition.build(grid, [t])
    by = {r["budget"]: r for r in rep["rows"]}
    assert by[0.1]["single"]["setting"] == "sel0.3" and by[0.1]["composition"] is None
    assert (by[0.2]["single"]["setting"], by[0.2]["composition"]["setting"]) == ("proj0.7", "both0.7/0.3")
    # paired per block: t_single / t_comp = 8/7, 8/6.4, 8/7
    assert by[0.2]["over_single"]["value"] == pytest.approx((8 / 7 * 2 + 8 / 6.4) / 3)
    assert by[0.2]["over_single"]["low"] < by[0.2]["over_single"]["high"] and "paired" in by[0.2]["how"]
    assert (by[1.0]["single"]["setting"], by[1.0]["composition"]["setting"]) == ("proj0.5", "both0.5/0.3")
    assert by[1.0]["over_single"]["value"] == pytest.approx(6 / 5) and all(r["complete"] for r in rep["rows"])
    md = composition.markdown(rep)
    assert "| 0.2 | proj0.7 (ΔPPL +0.150; 1.250×" in md and "†" not in md


def test_an_admissible_setting_nobody_timed_is_named_not_skipped(tmp_path):
    grid = _grid(tmp_path / "g.json", {(0.7, 1.0): 0.15, (0.7, 0.2): 0.14, (0.7, 0.3): 0.15})
    t = _timing(tmp_path / "t", {"dense": [10.0] * 2, "proj0.7": [8.0] * 2, "both0.7/0.3": [7.0] * 2})
    rep = composition.build(grid, [t])
    r = next(r for r in rep["rows"] if r["budget"] == 0.2)
    assert r["untimed"] == ["both0.7/0.2"] and not r["complete"]
    assert "| 0.2 † |" in composition.markdown(rep) and "0.2: both0.7/0.2" in composition.markdown(rep)


def test_across_campaigns_the_ratio_says_it_is_unpaired(tmp_path):
    grid = _grid(tmp_path / "g.json", {(0.7, 1.0): 0.15, (0.7, 0.3): 0.15})
    a = _timing(tmp_path / "a", {"dense": [10.0] * 2, "proj0.7": [8.0] * 2})
    b = _timing(tmp_path / "b", {"dense": [12.0] * 2, "both0.7/0.3": [8.0] * 2})
    r = next(r for r in composition.build(grid, [a, b])["rows"] if r["budget"] == 0.2)
    assert r["over_single"]["value"] == pytest.approx(1.5 / 1.25) and r["over_single"]["low"] is None
    assert "ratio of speedups" in r["how"]


def test_a_grid_is_priced_at_its_own_context(tmp_path):
    grid = _grid(tmp_path / "g.json", {(0.7, 1.0): 0.15}, context=4096)
    t = _timing(tmp_path / "t", {"dense": [10.0] * 2, "proj0.7": [8.0] * 2})
    with pytest.raises(InputError, match="at its own context"):
        composition.build(grid, [t], context=N)
    with pytest.raises(InputError, match="no sparse cell with a dense partner at context 4096"):
        composition.build(grid, [t])
    with pytest.raises(InputError, match="no such grid"):
        composition.build(tmp_path / "nope", [t])


def test_our_grid_records_are_read_as_eval_grid_writes_them(tmp_path):
    root = tmp_path / "grid"
    root.mkdir()
    for name, proj, kv, d in (("dense", None, None, 0.0), ("proj0.7", 0.7, None, 0.12),
                              ("proj0.7_snapkv0.3", 0.7, 0.3, 0.13)):
        cfg = {"mode": name, "projection": None if proj is None else {"keep": proj},
               "kv": None if kv is None else {"method": "snapkv", "keep": kv}}
        rec = {"kind": "ppl_eval", "config": cfg, "model": {"name": "qwen2.5-coder-0.5b"}, "protocol": "decode",
               "protocol_params": {"length": N}, "device": "cuda",
               "bootstrap": {"config": {"point": 6 + d}, "dense": {"point": 6.0}, "level": 0.95,
                             "delta": {"point": d, "low": d - 0.01, "high": d + 0.01}}}
        (root / f"{name}.json").write_text(json.dumps(rec))
    q, about = composition.load_quality(root)
    assert {x.label: round(x.delta, 3) for x in q} == {"dense": 0.0, "proj0.7": 0.12, "both0.7/0.3": 0.13}
    assert (about["model"], about["context"]) == ("qwen2.5-coder-0.5b", N)


def _crossing(root: Path, diffs: dict[int, float], blocks: int, with_prediction=True) -> Path:
    """proj0.5 10 ms, sel0.3 10 - diff ms at each context in every block; spec of 3 blocks."""
    from sparsedecode.records import write_record

    for b in range(blocks):
        for n, d in diffs.items():
            _write(root, "crossing", "proj50", n, b, 10.0, bytes_per_step=0.6e10, mode_spec="proj0.5")
            _write(root, "crossing", "sel30", n, b, 10.0 - d, bytes_per_step=0.7e10, mode_spec="sel0.3")
    ctx = ", ".join(str(n) for n in diffs)
    (root / "spec.toml").write_text(f'name = "c"\nmodel = "llama-3.1-8b"\nblocks = 3\n[[grid]]\ngroup = "crossing"\n'
                                    f'contexts = [{ctx}]\nmodes = ["proj0.5", "sel0.3"]\npairs = "crossing"\n')
    if with_prediction:
        write_record(root / "prediction.json", {"kind": "crossing_prediction", "proj": "proj0.5", "sel": "sel0.3",
                                                "predicted_tokens": 50000.0})
    return root


def test_table_2_sets_the_committed_prediction_beside_the_measured_crossing(tmp_path):
    done = _crossing(tmp_path / "done", {40960: -1.0, 57344: 1.0}, 3)
    r = crossing_row(done)
    assert r["measured"]["value"] == pytest.approx(49152.0) and r["predicted"] == 50000.0
    assert r["miss"] == pytest.approx(50000.0 - 49152.0) and (r["cells"], r["planned"], r["blocks"]) == (12, 12, 3)
    part = _crossing(tmp_path / "part", {40960: -1.0, 57344: 1.0}, 1)
    table = crossings_table([done, part])
    assert "| proj0.5 / sel0.3 |" in table and "+0.8K" in table and "12 of 12" in table
    assert "partial (4 of 12 cells)" in table
    ahead = tmp_path / "ahead"  # planned and predicted, no cell run yet: the prediction shows alone
    ahead.mkdir()
    (ahead / "prediction.json").write_text((done / "prediction.json").read_text())
    row = crossing_row(ahead)
    assert (row["predicted"], row["cells"], row["measured"]) == (50000.0, 0, None)
    assert "not run yet" in crossings_table([ahead])
    with pytest.raises(InputError, match="no prediction.json"):
        crossing_row(_crossing(tmp_path / "none", {40960: -1.0, 57344: 1.0}, 3, with_prediction=False))


def test_kernel_costs_against_keep_on_realized_and_nominal_bytes(tmp_path):
    from test_report import DIMS

    from sparsedecode.account import bounds

    root = tmp_path / "keep"
    for b in range(3):
        _write(root, "keep", "dense", N, b, 10.0, mode_spec="dense", bytes_per_step=1e10)
        _write(root, "keep", "proj70", N, b, 8.0 + 0.1 * b, mode_spec="proj0.7", projection_keep=0.7,
               bytes_per_step=0.7e10, realized_projection_keep=0.65)
    (cost,) = keep_costs(root).values()
    assert cost["records"].value == pytest.approx(8.1 - 10.0 * 0.7)
    nominal = bounds(DIMS, N, 0.7, 1.0).projection
    assert cost["nominal"].value == pytest.approx(8.1 - 10.0 / nominal) and cost["realized_keep"] == 0.65
    table = keep_costs_table(root)
    assert "| proj | 0.7 | 1.100 [" in table and "| 0.650 |" in table


def test_the_results_page_renders_the_three_kinds(tmp_path):
    _grid(tmp_path / "g.json", {(0.7, 1.0): 0.15, (0.7, 0.3): 0.15})
    _timing(tmp_path / "t", {"dense": [10.0] * 2, "proj0.7": [8.0] * 2, "both0.7/0.3": [7.0] * 2})
    _crossing(tmp_path / "c", {40960: -1.0, 57344: 1.0}, 3)
    (tmp_path / "docs").mkdir()
    m = tmp_path / "docs/results.toml"
    m.write_text('[[table]]\ntitle = "T4"\nconditions = "c"\nkind = "composition"\nquality = "g.json"\nrecords = ["t"]\n'
                 '[[table]]\ntitle = "T2"\nconditions = "c"\nkind = "crossings"\nrecords = ["c"]\n'
                 '[[table]]\ntitle = "keep"\nconditions = "c"\nkind = "keep_costs"\nrecords = "t"\n')
    page = render(m)
    assert "both0.7/0.3 (ΔPPL +0.150" in page and "| llama-3.1-8b | proj0.5 / sel0.3 |" in page
    assert "| proj | 0.7 |" in page and str(tmp_path) not in page
    assert "Figure 4 of each" not in page  # no report drawn for the crossing folder yet
    (tmp_path / "c/report").mkdir()
    (tmp_path / "c/report/fig4_advantage.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    assert "Figure 4 of each" in render(m) and "[c](../c/report/fig4_advantage.png)" in render(m)
    m.write_text('[[table]]\ntitle = "T2"\nconditions = "c"\nkind = "crossings"\nrecords = []\n')
    with pytest.raises(InputError, match="'records' must be a folder or a list"):
        render(m)
