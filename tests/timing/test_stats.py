"""Paired timing statistics on synthetic records with known answers (ByteCross §4.2-4.3, App. D-E)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sparsedecode.errors import InputError
from sparsedecode.timing import paper, stats


def _cell(campaign, *, mode, cell, group, block, context, ms) -> paper.PaperCell:
    return paper.PaperCell(
        campaign=campaign,
        path=Path(f"{campaign}/b{block}_{group}_{context}_{cell}.json"),
        gpu="GPU",
        model="M",
        mode=mode,
        cell=cell,
        group=group,
        block=block,
        context=context,
        projection_keep=1.0,
        kv_keep=1.0,
        ms_per_token=ms,
        tokens_per_sec=1000 / ms,
        tokens_per_sec_runs=(1000 / ms,) * 5,
    )


def _record(**overrides) -> dict:
    rec = {
        "mode": "proj",
        "context": 4096,
        "projection_keep": 0.5,
        "kv_keep": 1.0,
        "keep_tokens": None,
        "static_tokens": None,
        "allocated_tokens": 4352,
        "tokens_per_sec": 200.0,
        "tokens_per_sec_runs": [200.0] * 5,
        "ms_per_token": 5.0,
        "prefill_seconds": 1.0,
        "gather_seconds": None,
        "model": "M",
        "gpu": "GPU",
        "torch": "2.4.0",
        "block": 0,
        "group": "g",
        "cell": "proj50",
    }
    rec.update(overrides)
    return rec


def test_block_resamples_enumerates_b_to_the_b():
    for b in (1, 2, 3, 4, 5):
        idx = stats.block_resamples(b)
        assert idx.shape == (b**b, b)
        assert len({tuple(r) for r in idx}) == b**b
    assert stats.resampled_mean([1.0, 2.0, 3.0, 4.0]).n_resamples == 256


def test_interval_of_constant_blocks_is_a_point():
    est = stats.resampled_mean([1.7] * 5)
    assert (est.value, est.low, est.high) == pytest.approx((1.7, 1.7, 1.7))
    assert est.n_resamples == 3125


def test_interval_brackets_mean_and_matches_numpy_percentile():
    x = np.array([1.0, 2.0, 4.0])
    means = np.array([x[list(r)].mean() for r in stats.block_resamples(3)])
    est = stats.resampled_mean(x)
    assert est.value == pytest.approx(7 / 3)
    assert (est.low, est.high) == pytest.approx(tuple(np.percentile(means, [2.5, 97.5])))
    assert est.low < est.value < est.high


def test_paired_speedup_is_exact_per_block():
    dense = [10.0, 12.0, 8.0]
    sparse = [5.0, 8.0, 4.0]
    cells = [
        _cell("s", mode="dense", cell="dense", group="sweep", block=b, context=2048, ms=t)
        for b, t in enumerate(dense)
    ]
    cells += [
        _cell("s", mode="proj", cell="proj50", group="sweep", block=b, context=2048, ms=t)
        for b, t in enumerate(sparse)
    ]
    table = stats.paired_speedups(cells, "proj50")
    np.testing.assert_allclose(table[2048], [2.0, 1.5, 2.0])
    assert stats.speedup(cells, "proj50", 2048).value == pytest.approx(5.5 / 3)
    with pytest.raises(InputError, match="dense"):
        stats.paired_speedups(cells[1:], "proj50")


def test_crossing_of_two_straight_lines():
    # t_proj = 10 + 0.10 n/K, t_sel = 12 + 0.05 n/K cross at n = 40K; block noise cancels in the pair.
    contexts = [24576, 32768, 36864, 45056, 53248]
    cells = []
    for b, noise in enumerate([0.0, 0.3, -0.2, 0.1, 0.5]):
        for n in contexts:
            k = n / 1024
            cells.append(
                _cell(
                    "c",
                    mode="proj",
                    cell="proj50",
                    group="g",
                    block=b,
                    context=n,
                    ms=10 + 0.10 * k + noise,
                )
            )
            cells.append(
                _cell(
                    "c",
                    mode="sel",
                    cell="sel30",
                    group="g",
                    block=b,
                    context=n,
                    ms=12 + 0.05 * k + noise,
                )
            )
    est = stats.measured_crossing(stats.difference_curve(cells, "g"))
    assert est.value == pytest.approx(40 * 1024)
    assert (est.low, est.high) == pytest.approx((40 * 1024, 40 * 1024))
    assert est.n_resamples == 3125 and est.n_undefined == 0


def test_crossing_uses_last_context_where_projection_leads():
    contexts = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    # leads change sign twice; the crossing is after the last negative point (4 -> 5).
    d = np.array(
        [[-1.0, 1.0, 1.0, -1.0, 3.0], [1.0, 1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, -1.0, -1.0, -1.0]]
    )
    got = stats.crossing_points(contexts, d)
    assert got[0] == pytest.approx(4.25)
    assert np.isnan(got[1]) and np.isnan(got[2])


def test_kernel_cost_and_predicted_crossing():
    assert stats.kernel_cost([6.0, 7.0], [10.0, 12.0], 0.5) == pytest.approx([1.0, 1.0])
    # t_D = n / 4096 is a power law, so log-log interpolation is exact; costs are linear in n.
    n = np.array([2048.0, 8192.0, 32768.0, 131072.0])
    t_dense = n / 4096
    c_p = np.full(4, 0.5)
    c_kv = 1.5 + n / 65536

    def ratio_p(x):
        return np.full_like(x, 0.6)

    def ratio_kv(x):
        return np.full_like(x, 0.3)

    # 0.6 n/4096 + 0.5 = 0.3 n/4096 + 1.5 + n/65536  ->  n = 65536 / 3.8
    got = stats.predicted_crossing(n, t_dense, c_p, c_kv, ratio_p, ratio_kv)
    assert got == pytest.approx(65536 / 3.8, rel=1e-9)
    assert np.isnan(stats.predicted_crossing(n, t_dense, c_kv, c_p, ratio_kv, ratio_p))


def test_reader_errors_name_file_and_field(tmp_path):
    with pytest.raises(InputError, match="not found"):
        paper.load_campaign(tmp_path / "absent")
    good = tmp_path / "camp" / "b0_g_4096_proj50.json"
    good.parent.mkdir()
    good.write_text(json.dumps(_record()))
    (cell,) = paper.load_campaign(good.parent)
    assert (cell.campaign, cell.mode, cell.context, cell.ms_per_token, cell.allocated_tokens) == (
        "camp",
        "proj",
        4096,
        5.0,
        4352,
    )
    bad = good.parent / "b1_g_4096_proj50.json"
    rec = _record(block=1)
    del rec["ms_per_token"]
    bad.write_text(json.dumps(rec))
    with pytest.raises(InputError, match=r"b1_g_4096_proj50\.json.*'ms_per_token'"):
        paper.load_campaign(good.parent)
    bad.write_text(json.dumps(_record(block=1, context="4K")))
    with pytest.raises(InputError, match=r"b1_g_4096_proj50\.json.*'context'"):
        paper.load_campaign(good.parent)
    bad.write_text("{not json")
    with pytest.raises(InputError, match=r"b1_g_4096_proj50\.json.*JSON"):
        paper.load_campaign(good.parent)
