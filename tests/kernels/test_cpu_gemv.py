"""The CPU sparse kernels (kernels/cpu_gemv.c: the input-sparse GEMV and CATS's row-gather up)
against float64 and the masked references: odd
shapes, keeps 0.05-1.0, float32/bfloat16/float16, strided weights (a column slice of a fused
weight), one and several threads, NaN inputs, and the kept-row count (issue 46 item 1)."""

from __future__ import annotations

import math

import pytest
import test_gather_gemv as gather
import torch
from _compare import mismatch
from test_sparse_gemv import DTYPES, check, make, threshold_for

from sparsedecode.errors import InputError
from sparsedecode.kernels.cpu_gemv import (
    cats_up_cpu,
    cpu_kernel,
    sparse_gemv_cpu,
    sparse_gemv_segs_cpu,
)
from sparsedecode.kernels.gather_gemv import cats_up_ref
from sparsedecode.kernels.sparse_gemv import keep_mask, sparse_gemv_ref

pytestmark = pytest.mark.skipif(cpu_kernel().lib is None, reason=f"CPU kernel not built: {cpu_kernel().reason}")
KEEPS = [0.05, 0.3, 0.5, 0.7, 1.0]


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("K,N", [(1, 1), (13, 7), (65, 33), (577, 1537), (1537, 577)])
@pytest.mark.parametrize("keep", KEEPS)
def test_matches_float64_and_the_masked_reference(keep, K, N, dtype, threads):
    x, w_t, b = make(K, N, dtype, seed=K + N + int(keep * 100))
    t = threshold_for(x, keep)
    for bias in (b, None):
        kept = torch.zeros(2, dtype=torch.float64)
        got = sparse_gemv_cpu(x, w_t, torch.tensor(t), bias, kept=kept)
        what = f"cpu keep={keep} {K}x{N} {dtype} threads={threads}"
        fails = check(got, x, w_t, t, bias, what)
        ref = sparse_gemv_ref(x, w_t, t, bias)
        fails += [m for m in [mismatch(got, ref, check_tol(ref, dtype), what + " vs ref")] if m]
        assert not fails, "\n".join(fails)
        assert kept.tolist() == [keep_mask(x, t).sum().item(), K]


def check_tol(ref, dtype) -> float:
    """One unit in the last place of the output's dtype at its largest value, plus a floor: the
    kernel and the reference both sum in float32, in different orders."""
    eps = torch.finfo(dtype).eps
    return eps * max(1.0, ref.double().abs().max().item()) * (1.0 if dtype != torch.float32 else 64.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_column_slice_of_a_fused_weight(dtype, threads):
    """A site's w_t may be a column slice of a fused (K, N1 + N2) weight: leading dimension > N."""
    x, fused, b = make(301, 700, dtype, seed=3)
    t = threshold_for(x, 0.4)
    w_t = fused[:, 200:555]
    assert w_t.stride(0) == 700
    got = sparse_gemv_cpu(x, w_t, t, b[200:555])
    fails = check(got, x, w_t.contiguous(), t, b[200:555], f"slice {dtype}")
    assert not fails, "\n".join(fails)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("K,widths", [(1, [1, 1]), (37, [13, 5, 7]), (577, [576, 192, 192]), (301, [700, 699])])
@pytest.mark.parametrize("keeps", [(0.05, 0.5, 1.0), (0.5, 0.5, 0.5), (1.0, 0.3, 0.7)], ids=str)
def test_segments_match_each_site_alone(K, widths, keeps, dtype, threads):
    """q|k|v (gate|up) fused in one (K, sum of widths) weight, each site with its own threshold:
    the segmented call equals each site's own call on its column slice and float64, and counts
    each site's kept rows."""
    x, w_t, b = make(K, sum(widths), dtype, seed=K + len(widths))
    ts = [threshold_for(x, k) for k in keeps[:len(widths)]]
    for bias in (b, None):
        kept = [torch.zeros(2, dtype=torch.float64) for _ in widths]
        got = sparse_gemv_segs_cpu(x, w_t, ts, widths, bias, kept=kept)
        lo, fails = 0, []
        for n, t, k in zip(widths, ts, kept, strict=True):
            b_j = None if bias is None else bias[lo:lo + n]
            part = got[..., lo:lo + n]
            what = f"segment {lo}:{lo + n} {K}x{sum(widths)} {dtype} threads={threads}"
            fails += check(part, x, w_t[:, lo:lo + n].contiguous(), t, b_j, what)
            alone = sparse_gemv_cpu(x, w_t[:, lo:lo + n], t, b_j)
            fails += [m for m in [mismatch(part, alone, check_tol(alone, dtype), what + " vs alone")] if m]
            assert k.tolist() == [keep_mask(x, t).sum().item(), K]
            lo += n
        assert not fails, "\n".join(fails)
    with pytest.raises(InputError, match="one threshold per site"):
        sparse_gemv_segs_cpu(x, w_t, ts[:1], widths)


def test_drops_nan_channels_and_reads_nothing_when_all_dropped():
    x, w_t, b = make(129, 65, torch.float32, seed=5)
    x[0, 7] = math.nan
    t = threshold_for(x.nan_to_num(0.0), 0.5)
    assert torch.isfinite(sparse_gemv_cpu(x, w_t, t, b)).all()  # the NaN channel is dropped, not spread
    w_poison = w_t.clone()
    w_poison[7] = math.nan
    assert torch.equal(sparse_gemv_cpu(x, w_poison, t, b), sparse_gemv_cpu(x, w_t, t, b))  # its row is never read
    assert torch.equal(sparse_gemv_cpu(x, w_t, math.inf, b), b.reshape(1, -1))
    assert torch.equal(sparse_gemv_cpu(x, w_t, 1e30, None), torch.zeros(1, 65))


def test_dropped_rows_are_not_read():
    """Poison every dropped row with NaN: the output stays the masked product, so the kernel never
    touched them (a masked kernel would read NaN * 0 = NaN)."""
    x, w_t, b = make(513, 257, torch.bfloat16, seed=9)
    t = threshold_for(x, 0.3)
    poisoned = w_t.clone()
    poisoned[~keep_mask(x, t).reshape(-1)] = math.nan
    got = sparse_gemv_cpu(x, poisoned, t, b)
    assert torch.isfinite(got.float()).all()
    fails = check(got, x, w_t, t, b, "poisoned")
    assert not fails, "\n".join(fails)


def test_bad_input_is_refused_in_one_line():
    x, w_t, b = make(16, 8, torch.float32)
    with pytest.raises(InputError, match="one token of width 16"):
        sparse_gemv_cpu(torch.cat([x, x]), w_t, 0.1)
    with pytest.raises(InputError, match="unit stride"):
        sparse_gemv_cpu(x, w_t.t().contiguous().t(), 0.1)
    with pytest.raises(InputError, match="bias must have shape"):
        sparse_gemv_cpu(x, w_t, 0.1, b[:3])
    with pytest.raises(InputError, match="no torch.float64 entry"):
        sparse_gemv_cpu(x.double(), w_t.double(), 0.1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N,K", [(1, 1), (7, 13), (130, 65), (1537, 577)])
@pytest.mark.parametrize("keep", KEEPS)
def test_cats_up_matches_float64_and_the_masked_reference(keep, N, K, dtype, threads):
    x, w, g, b = gather.make(N, K, dtype, seed=N + K + int(keep * 100))
    t = gather.threshold_for(g, keep)
    for bias in (b, None):
        got = cats_up_cpu(x, w, g, torch.tensor(t), bias)
        what = f"cats up cpu keep={keep} {N}x{K} {dtype} threads={threads}"
        fails = gather.check(got, x, w, g, t, bias, what)
        ref = cats_up_ref(x, w, g, t, bias)
        fails += [m for m in [mismatch(got, ref, check_tol(ref, dtype), what + " vs ref")] if m]
        assert not fails, "\n".join(fails)


def test_cats_up_never_reads_a_dropped_row():
    x, w, g, b = gather.make(257, 129, torch.float32, seed=4)
    t = gather.threshold_for(g, 0.3)
    poisoned = w.clone()
    poisoned[~keep_mask(g, t).reshape(-1)] = math.nan
    got = cats_up_cpu(x, poisoned, g, t, b)
    fails = gather.check(got, x, w, g, t, b, "poisoned up")
    assert not fails, "\n".join(fails)
    with pytest.raises(InputError, match="gate_act of width 257"):
        cats_up_cpu(x, w, g[:, :5], t, b)


def test_sparse_linear_runs_the_kernel_and_traces_whole_under_compile():
    """SparseLinear's one-token CPU call is the kernel (dropped rows poisoned, still finite), and
    the same module traced by torch.compile (fullgraph) runs it as a custom op with the same
    outputs and the same kept counts."""
    from sparsedecode.projection.sparse_linear import SparseLinear

    x, w_t, b = make(96, 40, torch.float32, seed=11)
    t = threshold_for(x, 0.5)
    mod = SparseLinear(w_t.clone(), b, t, site="layers.0.q", track=True)
    with torch.no_grad():
        mod.w_t[~keep_mask(x, t).reshape(-1)] = math.nan
    eager = mod(x)
    assert torch.isfinite(eager).all()
    assert not check(eager, x, w_t, t, b, "SparseLinear on CPU")
    traced = torch.compile(mod, fullgraph=True, backend="aot_eager")
    assert torch.equal(traced(x), eager)
    kept = keep_mask(x, t).sum().item()
    assert mod.kept_counts() == (2 * kept, 2 * 96)


@pytest.mark.parametrize("same", [True, False], ids=["one threshold", "own thresholds"])
def test_fused_sites_count_each_sites_keep_whichever_call_runs(same):
    """A SparseConcat of three tracked sites on CPU: with one threshold shared (one pass over the
    fused rows) or each its own (the segmented call), every site's output is its own call's and
    its kept count is its own mask's."""
    from sparsedecode.projection.sparse_linear import SparseConcat, SparseLinear

    x, w_t, b = make(97, 3 * 33, torch.float32, seed=5)
    ts = [threshold_for(x, k) for k in ((0.5, 0.5, 0.5) if same else (0.3, 0.5, 0.9))]
    sites = [SparseLinear(w_t[:, 33 * j:33 * (j + 1)].contiguous(), b[33 * j:33 * (j + 1)], t,
                          site=f"layers.0.{s}", track=True) for j, (s, t) in enumerate(zip("qkv", ts, strict=True))]
    fused = SparseConcat(sites)
    outs = fused(x)
    for m, out, t in zip(sites, outs, ts, strict=True):
        torch.testing.assert_close(out, sparse_gemv_ref(x, m.w_t, t, m.bias), rtol=1e-5, atol=1e-5)
        assert m.kept_counts() == (keep_mask(x, t).sum().item(), 97), m.site


def test_without_a_compiler_the_cpu_path_is_the_masked_reference_and_says_so(tmp_path):
    """No C compiler ($CC pointing nowhere, an empty cache): nothing is built, `projection_runtime`
    names the masked reference and the reason, and SparseLinear computes the masked product."""
    import os
    import subprocess
    import sys

    code = """
import torch
from sparsedecode.kernels.cpu_gemv import cpu_kernel
from sparsedecode.kernels.sparse_gemv import sparse_gemv_ref
from sparsedecode.projection.sparse_linear import SparseLinear, cpu_rows
w = torch.randn(32, 8); x = torch.randn(1, 32)
mod = SparseLinear(w, None, 0.5)
assert not cpu_rows(w)
assert torch.equal(mod(x), sparse_gemv_ref(x, w, 0.5))
print(cpu_kernel().reason)
"""
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "SPARSEDECODE_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "no C compiler found ($CC, cc or gcc)"
    assert not (tmp_path / "cache").exists()
