"""The batched CPU GEMV over the union of kept channels (kernels/cpu_gemv.c `sd_gemv_union`; issue
44 item 3, ByteCross §3.3 and App. F): each token of a decode batch keeps its own channels, the
weight is read once in the rows any token keeps. Odd shapes, B = 1..64, keeps 0.05-1.0, float32,
bfloat16 and float16, one and two threads, against float64 and each token's own call."""

from __future__ import annotations

import math

import pytest
import torch
from _compare import mismatch
from test_cpu_gemv import check_tol, threads  # noqa: F401, F811 (threads: the 1- and 2-thread fixture)
from test_sparse_gemv import DTYPES, check, make, threshold_for

from sparsedecode.errors import InputError
from sparsedecode.kernels.cpu_gemv import cpu_kernel, sparse_gemv_cpu, sparse_gemv_union_cpu
from sparsedecode.kernels.sparse_gemv import keep_mask

pytestmark = pytest.mark.skipif(cpu_kernel().lib is None, reason=f"CPU kernel not built: {cpu_kernel().reason}")


def batch(B: int, K: int, N: int, dtype, seed: int):
    """B tokens (B, K) whose scales differ (so their masks differ), a weight and a bias."""
    _, w_t, b = make(K, N, dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(B, K, generator=gen) * torch.linspace(0.5, 2.0, B).reshape(B, 1)
    return x.to(dtype), w_t, b


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("K,N", [(1, 1), (13, 7), (65, 33), (577, 193)])
@pytest.mark.parametrize("B", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("keep", [0.05, 0.3, 0.5, 1.0])
def test_each_token_is_its_own_sparse_gemv_and_the_union_is_counted(keep, B, K, N, dtype, threads):  # noqa: F811
    x, w_t, bias = batch(B, K, N, dtype, seed=K + N + B + int(keep * 100))
    t = threshold_for(x, keep)
    y, union, kept = sparse_gemv_union_cpu(x, w_t, t, bias)
    masks = keep_mask(x, t)  # (B, K)
    assert union == int(masks.any(0).sum()) and kept.tolist() == masks.sum(1).tolist()
    assert y.dtype == x.dtype and y.shape == (B, N)
    fails = []
    for b in range(B):
        what = f"token {b} of {B}, keep={keep} {K}x{N} {dtype} threads={threads}"
        fails += check(y[b:b + 1], x[b:b + 1], w_t, t, bias, what)
        alone = sparse_gemv_cpu(x[b:b + 1], w_t, t, bias)
        fails += [m for m in [mismatch(y[b:b + 1], alone, check_tol(alone, dtype), what + " vs alone")] if m]
    assert not fails, "\n".join(fails[:10])


def test_rows_outside_the_union_are_never_read_and_a_token_adds_only_its_own():
    """Rows no token keeps are poisoned with NaN and the output stays finite (never read); a row
    only one token keeps leaves the others' outputs as their own calls."""
    x, w_t, bias = batch(5, 301, 129, torch.float32, seed=4)
    t = threshold_for(x, 0.2)
    union = keep_mask(x, t).any(0)
    poisoned = w_t.clone()
    poisoned[~union] = math.nan
    y, n, _ = sparse_gemv_union_cpu(x, poisoned, t, bias)
    assert torch.isfinite(y).all() and n == int(union.sum()) < 301
    x[1, :] = 0.0  # token 1 keeps nothing: bias alone
    y, _, kept = sparse_gemv_union_cpu(x, w_t, t, bias)
    assert kept[1] == 0 and torch.equal(y[1], bias)
    x[2, 5] = math.nan  # a NaN channel is dropped, not spread to the others
    y, _, _ = sparse_gemv_union_cpu(x, w_t, t, bias)
    assert torch.isfinite(y).all()


def test_bad_input_is_refused_in_one_line():
    x, w_t, bias = batch(3, 16, 8, torch.float32, seed=0)
    with pytest.raises(InputError, match=r"shape \(B, K\)"):
        sparse_gemv_union_cpu(x[0], w_t, 0.1)
    with pytest.raises(InputError, match="at least one token"):
        sparse_gemv_union_cpu(x[:0], w_t, 0.1)
    with pytest.raises(InputError, match=r"w_t of shape \(16, N\)"):
        sparse_gemv_union_cpu(x, w_t[:5], 0.1)
    with pytest.raises(InputError, match="bias must have shape"):
        sparse_gemv_union_cpu(x, w_t, 0.1, bias[:3])
