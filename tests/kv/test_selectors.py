"""KV selectors (issue 6): SnapKV-style scored selection and the sink+recent window.

The scored selection is checked against a from-scratch reference written here
with plain loops: per query head and window query, a float64 softmax over the
keys it may see, summed into its KV head (h // G), pooled position by
position, then the forced positions plus a sorted top-k of the rest.
"""

from __future__ import annotations

import math

import pytest
import torch

from sparsedecode.errors import InputError
from sparsedecode.kv import SELECTORS, KVSelector, get_selector
from sparsedecode.kv.snapkv import SnapKV
from sparsedecode.kv.window import SinkWindow, window_ranges

B, D = 2, 16
# (n, Hkv, G, W): odd lengths, GQA ratios 1, 3 and 7.
CASES = [(37, 2, 1, 8), (101, 2, 3, 16), (101, 1, 7, 16), (1000, 2, 7, 64), (1000, 3, 3, 64)]


def make(n, hkv, g, w, seed=0, t_extra=5):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, hkv * g, w, D, generator=gen)  # (B, Hq, W, D)
    k = torch.randn(B, hkv, n + t_extra, D, generator=gen)  # (B, Hkv, T, D), T > n
    return q, k


def ref_scores(q, k, n, width, kind):
    """(B, Hkv, n) float64 by loops: the documented score, independently of kv/snapkv.py."""
    b_, hq, w, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    raw = torch.zeros(b_, hkv, n, dtype=torch.float64)
    for b in range(b_):
        for h in range(hq):
            for i in range(w):
                pos = n - w + i
                keys = k[b, h // g, : pos + 1].double()  # (pos + 1, D)
                logits = keys @ q[b, h, i].double() / math.sqrt(d)
                raw[b, h // g, : pos + 1] += torch.softmax(logits, dim=0)
    out = torch.empty_like(raw)
    r = width // 2
    for j in range(n):
        seg = raw[..., max(0, j - r) : min(n, j + r + 1)]
        out[..., j] = seg.mean(-1) if kind == "avg" else seg.amax(-1)
    return out


def ref_select(scores, budget, sinks, w):
    """Per (b, h): forced positions, then the rest by (-score, position); ascending lists."""
    n = scores.shape[-1]
    forced = set(range(min(sinks, n))) | set(range(max(n - w, 0), n))
    sel = {}
    for b in range(scores.shape[0]):
        for h in range(scores.shape[1]):
            rest = sorted((p for p in range(n) if p not in forced), key=lambda p: (-float(scores[b, h, p]), p))
            sel[b, h] = sorted(forced | set(rest[: budget - len(forced)]))
    return sel


def assert_selection(got, scores, budget, sinks, w, tol=1e-5):
    """got equals the reference top-k, up to positions whose reference score lies within
    tol of the cutoff (float32 scoring vs the float64 reference)."""
    ref = ref_select(scores, budget, sinks, w)
    n = scores.shape[-1]
    forced = set(range(min(sinks, n))) | set(range(max(n - w, 0), n))
    for (b, h), want in ref.items():
        have = got[b, h].tolist()
        assert have == sorted(set(have)), f"(b={b}, h={h}) not ascending and unique"
        assert forced <= set(have), f"(b={b}, h={h}) lost forced {sorted(forced - set(have))}"
        diff = set(have) ^ set(want)
        if diff:
            cut = min(float(scores[b, h, p]) for p in set(want) - forced)
            off = [p for p in diff if abs(float(scores[b, h, p]) - cut) > tol]
            assert not off, f"(b={b}, h={h}): {len(off)} positions differ, e.g. {sorted(off)[:5]}"


# -- registry and fields ---------------------------------------------------------------
def test_registry_builds_by_name_and_refuses_unknowns():
    assert set(SELECTORS) >= {"snapkv", "window"}
    s = get_selector("snapkv", pool_kind="max", window=32)
    assert isinstance(s, SnapKV) and isinstance(s, KVSelector)
    assert (s.sinks, s.window, s.pool_width, s.pool_kind) == (4, 32, 7, "max")
    assert isinstance(get_selector("window"), SinkWindow)
    assert (SnapKV().sinks, SnapKV().window, SinkWindow().sinks, SinkWindow().window) == (4, 64, 4, 64)
    with pytest.raises(InputError, match="did you mean 'snapkv'"):
        get_selector("snapvk")
    with pytest.raises(InputError, match="window has no option pool_width"):
        get_selector("window", pool_width=7)


@pytest.mark.parametrize("bad, match", [
    ({"pool_kind": "mean"}, "'avg' or 'max'"),
    ({"pool_width": 6}, "odd.*use 7"),
    ({"pool_width": 0}, "pool_width must be an integer >= 1"),
    ({"sinks": -1}, "sinks must be an integer >= 0"),
    ({"window": 0}, "window must be an integer >= 1"),
    ({"window": 2.5}, "window must be an integer"),
])
def test_bad_snapkv_fields_are_refused(bad, match):
    with pytest.raises(InputError, match=match):
        get_selector("snapkv", **bad)


# -- scores and selection against the reference ----------------------------------------
@pytest.mark.parametrize("kind", ["avg", "max"])
@pytest.mark.parametrize("n, hkv, g, w", CASES)
def test_scores_and_selection_match_reference(n, hkv, g, w, kind):
    q, k = make(n, hkv, g, w)
    sel = SnapKV(window=w, pool_kind=kind)
    got = sel.scores(q, k, n)
    ref = ref_scores(q, k, n, 7, kind)
    assert got.shape == (B, hkv, n) and got.dtype == torch.float32
    err = (got.double() - ref).abs()  # (B, Hkv, n)
    tol = 1e-5 * float(ref.abs().max())
    worst = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
    assert float(err.max()) < tol, f"{int((err > tol).sum())} scores off by > {tol:.2g}, worst at (b, h, pos) {worst}"
    for keep, max_new in ((0.5, 3), (0.4, 0), (0.9, 7)):
        budget = sel.budget(n, keep, max_new)
        assert budget == math.floor(keep * n + 0.5) - max_new
        idx = sel.select(q, k, n, keep, max_new)
        assert idx.shape == (B, hkv, budget) and idx.dtype == torch.int64
        assert_selection(idx, ref, budget, sel.sinks, w)


def test_scores_sum_to_the_attention_mass():
    """Without pooling, each KV head's scores add up to W queries x G heads of softmax mass."""
    n, hkv, g, w = 101, 2, 3, 16
    q, k = make(n, hkv, g, w)
    s = SnapKV(window=w, pool_width=1).scores(q, k, n)
    torch.testing.assert_close(s.sum(-1), torch.full((B, hkv), float(w * g)))
    # The causal mask: the last key is seen only by the last window query of each head.
    assert (s[..., -1] <= g + 1e-6).all()


def test_keep_one_is_every_position_in_order():
    n, hkv, g, w = 101, 2, 3, 16
    q, k = make(n, hkv, g, w)
    v = torch.randn_like(k)
    for sel in (SnapKV(window=w), SinkWindow(window=w)):
        assert sel.budget(n, 1.0, 50) == n  # keep 1.0 is "everything", whatever max_new
        idx = sel.select(q, k, n, 1.0, 50)
        assert torch.equal(idx, torch.arange(n).expand(B, hkv, n))
        kb, vb = KVSelector.gather(k, v, idx, extra=4)
        assert torch.equal(kb[:, :, :n], k[:, :, :n]) and torch.equal(vb[:, :, :n], v[:, :, :n])


def test_ties_go_to_the_lower_position():
    scores = torch.zeros(2, 3, 10)
    scores[..., 7] = 1.0
    forced = torch.tensor([9])
    idx = KVSelector.topk_positions(scores, 4, forced)
    assert idx.tolist() == [[[0, 1, 7, 9]] * 3] * 2
    # Equal keys give equal attention to every key all window queries see: the lowest win.
    n, w = 60, 8
    q = torch.randn(B, 6, w, D)
    k = torch.ones(B, 2, n, D)
    sel = SnapKV(window=w, pool_width=1)
    idx = sel.select(q, k, n, 0.5, 0)
    want = list(range(4 + 18)) + list(range(n - w, n))
    assert idx.tolist() == [[want] * 2] * B
    assert torch.equal(idx, sel.select(q, k, n, 0.5, 0))


# -- the window selector -----------------------------------------------------------------
@pytest.mark.parametrize("n", [101, 1000])
def test_window_keeps_sinks_and_the_most_recent(n):
    k = torch.zeros(B, 3, n + 2, D)
    sel = SinkWindow(sinks=4, window=16)
    budget = sel.budget(n, 0.3, 5)
    assert budget == SnapKV(window=16).budget(n, 0.3, 5)
    recent = budget - 4
    assert window_ranges(n, budget, 4) == ((0, 4), (n - recent, n))
    idx = sel.select(None, k, n, 0.3, 5)
    want = list(range(4)) + list(range(n - recent, n))
    assert idx.shape == (B, 3, budget) and idx.dtype == torch.int64
    assert idx.tolist() == [[want] * 3] * B
    assert window_ranges(n, n, 4) == ((0, 4), (4, n))
    assert window_ranges(n, 10, 0) == ((0, 0), (n - 10, n))


# -- gather ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_gather_puts_kept_entries_first_then_empty_slots(dtype):
    n, hkv, g, w = 101, 2, 3, 16
    q, k = make(n, hkv, g, w)
    k, v = k.to(dtype), torch.randn_like(k).to(dtype)
    idx = SnapKV(window=w).select(q.to(dtype), k, n, 0.4, 3)
    kb, vb = KVSelector.gather(k, v, idx, extra=9)
    budget = idx.shape[-1]
    assert kb.shape == vb.shape == (B, hkv, budget + 9, D)
    assert kb.dtype == dtype and kb.is_contiguous() and vb.is_contiguous()
    for b in range(B):
        for h in range(hkv):
            for j, p in enumerate(idx[b, h].tolist()):
                assert torch.equal(kb[b, h, j], k[b, h, p]) and torch.equal(vb[b, h, j], v[b, h, p])
    assert not kb[:, :, budget:].any() and not vb[:, :, budget:].any()
    with pytest.raises(InputError, match="outside"):
        KVSelector.gather(k, v, idx + k.shape[2], extra=0)
    # into given buffers: the same kept entries, the slots past the budget as they were
    bufs = (torch.full_like(kb, 7.0), torch.full_like(vb, 7.0))
    got = KVSelector.gather(k, v, idx, out=bufs)
    assert got[0] is bufs[0] and torch.equal(got[0][:, :, :budget], kb[:, :, :budget])
    assert torch.equal(got[1][:, :, :budget], vb[:, :, :budget]) and (got[1][:, :, budget:] == 7).all()
    with pytest.raises(InputError, match="out must be two buffers"):
        KVSelector.gather(k, v, idx, out=(kb[:, :, :budget - 1], vb))


# -- bad input -----------------------------------------------------------------------------
@pytest.mark.parametrize("keep", [0, 0.0, 1.5, -0.2])
def test_keep_outside_unit_interval_is_refused(keep):
    with pytest.raises(InputError, match=r"snapkv keep .* outside \(0, 1\]"):
        SnapKV().budget(1000, keep, 0)


def test_budget_too_small_names_the_numbers_and_the_fix():
    with pytest.raises(InputError, match=r"round\(0.05 x 1000\) - 10 generated = 40 entries cannot hold "
                       r"the 4 sinks and the 64-token observation window \(68 entries\): raise keep to "
                       r"at least 0.078"):
        SnapKV().budget(1000, 0.05, 10)
    with pytest.raises(InputError, match="give a context longer than 68 tokens"):
        SinkWindow().budget(50, 0.9, 0)
    q, k = make(37, 2, 1, 8)
    with pytest.raises(InputError, match="cannot hold"):
        SnapKV(window=8).select(q, k, 37, 0.3, 0)
    with pytest.raises(InputError, match="between the 5 forced positions"):
        KVSelector.topk_positions(torch.zeros(1, 1, 10), 4, torch.arange(5))


def test_shape_mismatches_are_refused():
    sel = SnapKV(window=8)
    q, k = make(101, 2, 3, 8)
    with pytest.raises(InputError, match="in batch or head dim"):
        sel.scores(q[..., :8], k, 101)
    with pytest.raises(InputError, match="in batch or head dim"):
        sel.scores(q[:1], k, 101)
    with pytest.raises(InputError, match="5 query heads are not a multiple of 2 KV heads"):
        sel.scores(q[:, :5], k, 101)
    with pytest.raises(InputError, match="q_obs \\(B, Hq, W, D\\)"):
        sel.scores(q[0], k, 101)
    with pytest.raises(InputError, match="exceeds the 106 positions"):
        sel.scores(q, k, 107)
    with pytest.raises(InputError, match="holds 8 observation queries but the snapkv window is 16"):
        SnapKV(window=16).select(q, k, 101, 0.5, 0)


def test_scores_do_not_depend_on_how_many_groups_are_scored_at_once(monkeypatch):
    import sparsedecode.kv.snapkv as snap

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 12, 8, 16, generator=gen)  # (B, Hq, W, D): 4 KV heads, G = 3
    k = torch.randn(2, 4, 50, 16, generator=gen)  # (B, Hkv, T, D)
    sel = get_selector("snapkv", window=8)
    whole = sel.scores(q, k, 45)
    monkeypatch.setattr(snap, "SCORE_ELEMENTS", 2 * 3 * 8 * 45 * 3)  # 3 groups, then 1
    assert torch.allclose(sel.scores(q, k, 45), whole, rtol=1e-6, atol=1e-7)
    monkeypatch.setattr(snap, "SCORE_ELEMENTS", 1)  # one group at a time
    assert torch.allclose(sel.scores(q, k, 45), whole, rtol=1e-6, atol=1e-7)
