"""A decode batch through a SparseLinear (issue 44, ByteCross §3.3, App. F): x (B, 1, in), one
token per sequence, gives each token's own input-sparse product (the masked reference), reads
the union of the kept rows, and counts that union; a dense site (READ_ALL) is F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sparsedecode.kernels.union_gemv import union_gemv_ref
from sparsedecode.projection.sparse_linear import READ_ALL, SparseLinear


@pytest.mark.parametrize("B, K, N", [(2, 37, 19), (5, 130, 67), (16, 96, 200), (64, 33, 8)])
@pytest.mark.parametrize("keep_t", [0.0, 0.4, 1.3])
def test_rows_are_each_tokens_own_sparse_product(B, K, N, keep_t):
    g = torch.Generator().manual_seed(B * K + N)
    w_t = torch.randn(K, N, generator=g)
    bias = torch.randn(N, generator=g)
    x = torch.randn(B, 1, K, generator=g)
    lin = SparseLinear(w_t, bias, keep_t, track=True)
    y = lin(x)
    assert y.shape == (B, 1, N)
    torch.testing.assert_close(y[:, 0], union_gemv_ref(x[:, 0], w_t, keep_t, bias), rtol=1e-5, atol=1e-5)
    kept = x[:, 0].abs() > keep_t  # (B, K)
    assert lin.realized_union() == pytest.approx(float(kept.any(0).float().mean()))
    assert lin.realized_keep() == pytest.approx(float(kept.float().mean()))


def test_a_dense_site_in_a_batch_is_f_linear():
    g = torch.Generator().manual_seed(1)
    w_t, bias = torch.randn(40, 24, generator=g), torch.randn(24, generator=g)
    x = torch.randn(7, 1, 40, generator=g)
    y = SparseLinear(w_t, bias, READ_ALL)(x)
    torch.testing.assert_close(y, F.linear(x, w_t.t(), bias))


def test_a_prefill_stays_dense_and_one_token_stays_the_one_token_path():
    g = torch.Generator().manual_seed(2)
    w_t = torch.randn(40, 24, generator=g)
    lin = SparseLinear(w_t, None, 10.0)  # keeps nothing of a decode token
    x = torch.randn(1, 5, 40, generator=g)  # one sequence's five prompt tokens
    torch.testing.assert_close(lin(x), F.linear(x, w_t.t()))
    assert torch.count_nonzero(lin(x[:, :1])) == 0

