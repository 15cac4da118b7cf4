"""Reproduce the ByteCross paper's measured crossings and Figure 3 speedups from its own records.

Crossings: Table 2 and Tables 12/13 of App. E (K = 1,024 tokens, §3). Speedups:
§4.2 / Figure 3. The records live in data/bytecross in this repository (a copy of the
paper's records/, see its SOURCE.md); the tests skip when that folder is absent.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sparsedecode.timing import paper, stats

RECORDS = Path(__file__).resolve().parents[2] / "data/bytecross"
K = 1024


@pytest.fixture(scope="module")
def records() -> Path:
    if not RECORDS.is_dir():
        pytest.skip(f"ByteCross records not found at {RECORDS} (data/bytecross in the checkout)")
    return RECORDS


A100_8B = ("crossing_a100_1", "crossing_a100_2")  # two launches of one protocol (App. E)
CROSSINGS = [
    # campaigns, group, crossing, low, high in K tokens (Table 12 / 13); resamples
    (("crossing_3b",), "p50_s30", 16.5, 15.6, 17.2, 3125),
    (A100_8B, "p70_s30", 25.1, 23.6, 28.7, 3125),
    (A100_8B, "p50_s30", 50.4, 47.4, 52.5, 3125),
    (A100_8B, "p50_s50", 68.3, 66.9, 70.4, 3125),
    (("crossing_a6000",), "p70_s30", 39.3, 38.9, 40.3, 256),
    (("crossing_a6000",), "p50_s30", 68.7, 68.5, 68.9, 256),
]


@pytest.mark.parametrize(("campaigns", "group", "point", "low", "high", "n_resamples"), CROSSINGS)
def test_measured_crossing_matches_paper(records, campaigns, group, point, low, high, n_resamples):
    est = stats.measured_crossing(
        stats.difference_curve(paper.load_records(records, campaigns), group)
    )
    assert est.n_resamples == n_resamples and est.n_undefined == 0
    assert est.value / K == pytest.approx(point, abs=0.1)
    assert est.low / K == pytest.approx(low, abs=0.2)
    assert est.high / K == pytest.approx(high, abs=0.2)


def test_table12_difference_row(records):
    # Llama-3.1-8B 0.7/0.3 at 32K: 0.212 [0.126, 0.337], selection faster in 5/5 blocks.
    curve = stats.difference_curve(paper.load_records(records, A100_8B), "p70_s30")
    (row,) = [i for i, n in enumerate(curve.contexts) if n == 32 * K]
    est = stats.resampled_mean(curve.diffs[row])
    assert (est.value, est.low, est.high) == pytest.approx((0.212, 0.126, 0.337), abs=0.0015)
    assert (curve.diffs[row] > 0).sum() == 5


@pytest.mark.parametrize(
    ("cell", "context", "expected"),
    [("proj50", 2048, 1.36), ("sel30", 131072, 1.54), ("p50_s30", 131072, 1.91)],
)
def test_figure3_speedups_a100(records, cell, context, expected):
    est = stats.speedup(paper.load_campaign(records / "sweep_a100"), cell, context)
    assert est.n_resamples == 27
    assert est.value == pytest.approx(expected, abs=0.005)
    assert est.low <= est.value <= est.high
