"""The byte account reproduces the ByteCross paper to the token (§3.3, §4.4, §5.2, App. C, F)."""

import math

import pytest

from sparsedecode import account as acc
from sparsedecode.errors import InputError

LLAMA = acc.ModelDims.known("llama-3.1-8b")
QWEN3 = acc.ModelDims.known("qwen3-8b")
MISTRAL = acc.ModelDims.known("mistral-7b-v0.3")


@pytest.mark.parametrize(
    "model, rp, rkv, ff_only, expected",
    [
        ("llama-3.1-8b", 0.5, 0.3, False, 76_069),
        ("mistral-7b-v0.3", 0.5, 0.3, False, 76_069),
        ("qwen3-8b", 0.5, 0.3, False, 67_291),
        ("llama-3.1-8b", 0.5, 0.3, True, 61_440),
        ("qwen3-8b", 0.5, 0.3, True, 52_663),
        ("llama-3.1-8b", 0.7, 0.3, False, 45_641),
        ("llama-3.1-8b", 0.5, 0.5, False, 106_496),
        ("llama-3.2-3b", 0.5, 0.3, False, 35_109),
    ],
)
def test_crossover_matches_paper(model, rp, rkv, ff_only, expected):
    n = acc.crossover(acc.ModelDims.known(model), rp, rkv, ff_only)
    assert acc.round_tokens(n) == expected


def test_70b_crosses_beyond_its_window():
    n = acc.crossover(acc.ModelDims.known("llama-3.1-70b"), 0.5, 0.3)
    assert f"{n / acc.K:.1f}K" == "291.4K"
    assert n > 131_072


def test_one_layer_suffices_layer_count_cancels():
    import dataclasses

    half = dataclasses.replace(LLAMA, n_layers=7)
    assert acc.crossover(half, 0.5, 0.3) == pytest.approx(acc.crossover(LLAMA, 0.5, 0.3))


def test_crossover_is_where_savings_are_equal():
    n = acc.crossover(LLAMA, 0.6, 0.2)
    assert acc.kv_saving(LLAMA, n, 0.2) == pytest.approx(acc.projection_saving(LLAMA, 0.6))
    assert acc.kv_saving(LLAMA, 0.9 * n, 0.2) < acc.projection_saving(LLAMA, 0.6)


def test_batched_crossover_at_union_092():
    n4 = acc.crossover_batched(LLAMA, 0.92, 0.3, 4)
    assert f"{n4 / acc.K:.1f}K" == "3.0K"
    # at most n*/B, with equality when the union equals the single-sequence keep
    assert acc.crossover_batched(LLAMA, 0.5, 0.3, 4) == pytest.approx(
        acc.crossover(LLAMA, 0.5, 0.3) / 4
    )


def test_fixed_budget_crossover():
    b = 4096
    n = acc.crossover_fixed_budget(LLAMA, 0.5, b)
    # r_KV = b/n makes the savings equal at n
    assert acc.kv_saving(LLAMA, n, b / n) == pytest.approx(acc.projection_saving(LLAMA, 0.5))
    assert n > b


def test_precision_scales_crossover_by_weight_over_kv_bytes():
    base = acc.crossover(LLAMA, 0.5, 0.3)
    assert acc.crossover(LLAMA, 0.5, 0.3, weight_bytes=0.5, kv_bytes=2) == pytest.approx(base / 4)
    assert acc.crossover(LLAMA, 0.5, 0.3, weight_bytes=2, kv_bytes=1) == pytest.approx(base * 2)


def test_step_bytes_and_kv_bound_at_128k():
    b = acc.step_bytes(LLAMA, 128 * acc.K)
    assert f"{b.total / 1e9:.1f}" == "32.2"
    # one layer of projection weights is 436 MB (§3.1); its cache adds 4096 bytes a token
    assert round(LLAMA.proj_params * 2 / 1e6) == 436
    assert LLAMA.kv_elems_per_token * 2 == 4096
    assert f"{acc.bounds(LLAMA, 128 * acc.K, 0.5, 0.3).kv:.2f}" == "1.60"


def test_both_bound_at_32k():
    assert f"{acc.bounds(LLAMA, 32 * acc.K, 0.5, 0.2).both:.3f}" == "2.172"


def test_bounds_order_and_trends():
    short, long = (acc.bounds(LLAMA, n, 0.5, 0.3) for n in (2048, 128 * acc.K))
    assert short.projection > long.projection  # falls with n
    assert short.kv < long.kv  # rises with n
    for b in (short, long):
        assert b.both > max(b.projection, b.kv)
    dense = acc.bounds(LLAMA, 4096, 1.0, 1.0)
    assert dense.projection == dense.kv == dense.both == 1.0


def test_projection_saving_never_touches_lm_head_or_norms():
    b = acc.step_bytes(LLAMA, 0)
    saved = acc.projection_saving(LLAMA, 1e-9)  # keep almost nothing
    assert saved == pytest.approx(b.mlp + b.attn, rel=1e-6)
    assert b.other == pytest.approx((128256 * 4096 + 4096 + 65 * 4096) * 2)


def test_qwen3_traffic_table_matches_appendix_c():
    rows = acc.traffic_table(QWEN3, [512, 32 * acc.K], rp=0.5, rkv=0.3, ff_only=True)
    short, long = rows
    assert f"{100 * short['share']['mlp']:.1f}" == "71.5"
    assert f"{100 * short['share']['kv']:.1f}" == "0.5"
    assert f"{100 * long['share']['kv']:.1f}" == "24.2"
    assert round(long["removed_mb"]["kv"] / long["removed_mb"]["projection"], 2) == 0.62
    assert f"{acc.step_bytes(QWEN3, 0).other / 1e9:.3f}" == "1.245"
    assert sum(short["share"].values()) == pytest.approx(1.0)


def test_general_attention_shape_uses_head_dim():
    cfg = {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 4,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 1000,
        "model_type": "qwen3",
    }
    d = acc.ModelDims.from_config(cfg)
    assert d.q_width == 4096 != d.d
    assert d.attn_params == 2 * 2048 * 4096 + 2 * 2048 * 512


@pytest.mark.parametrize("budget, expected", [(0.2, "35.7K"), (0.5, "48.1K"), (1.0, "57.8K")])
def test_quality_matched_crossover(budget, expected):
    proj = {0.7: 0.18, 0.6: 0.402, 0.5: 0.995}
    sel = {0.5: -0.007, 0.3: 0.004, 0.2: 0.004, 0.1: 0.06}
    m = acc.matched_crossover(LLAMA, proj, sel, budget)
    assert f"{m.crossover / acc.K:.1f}K" == expected
    assert m.kv_keep == 0.1  # the selection curve stays under every budget


def test_admissible_keep_rules():
    curve = {0.7: 0.18, 0.6: 0.402, 0.5: 0.995}
    assert acc.admissible_keep(curve, 0.18) == 0.7
    assert acc.admissible_keep(curve, 0.402) == pytest.approx(0.6)
    assert acc.admissible_keep(curve, 0.291) == pytest.approx(0.65)
    assert acc.admissible_keep(curve, 5.0) == 0.5  # budget above the curve: most aggressive
    assert acc.admissible_keep(curve, 0.1) is None  # never extended toward dense
    # a curve that dips back under the budget after exceeding it stops at the first exceedance
    assert acc.admissible_keep({0.8: 0.0, 0.6: 1.0, 0.4: 0.0}, 0.5) == pytest.approx(0.7)


def test_matched_with_one_branch_inadmissible():
    m = acc.matched_crossover(LLAMA, {0.7: 0.5}, {0.3: 0.0}, 0.2)
    assert m.proj_keep is None and m.crossover == 0
    m = acc.matched_crossover(LLAMA, {0.7: 0.1}, {0.3: 0.5}, 0.2)
    assert m.kv_keep is None and math.isinf(m.crossover)
    with pytest.raises(InputError, match="raise the budget"):
        acc.matched_crossover(LLAMA, {0.7: 0.5}, {0.3: 0.5}, 0.2)


def test_latency_crossing_moves_by_cost_difference_over_gap_growth():
    n_star = acc.crossover(LLAMA, 0.5, 0.3)
    assert acc.latency_crossing(LLAMA, 0.5, 0.3, 1.0, 1.0, 1500) == pytest.approx(n_star)
    s = acc.kv_gap_growth_ms_per_k(LLAMA, 0.3, 1500)  # ms per 1K tokens
    n_lat = acc.latency_crossing(LLAMA, 0.5, 0.3, 2.0, 0.5, 1500)
    assert n_lat == pytest.approx(n_star - 1.5 / s * 1024)
    # On A100 s is about 0.06 ms per 1K tokens, so 1 ms moves the crossing ~17K (§4.3)
    s_a100 = acc.kv_gap_growth_ms_per_k(LLAMA, 0.3, 1550)
    assert 0.05 < s_a100 < 0.07
    assert 14 < 1 / s_a100 < 20


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, "abc"])
def test_keep_outside_unit_interval_is_refused(bad):
    with pytest.raises(InputError, match="keep"):
        acc.crossover(LLAMA, bad, 0.3)
