"""A decode batch's attention (issue 44): the captured form (split-K with per-row device bounds,
cache and compact regions merged by log-sum-exp) equals the eager per-row SDPA on odd shapes,
for rows that read their cache, rows that read their compact region, and a mix."""

from __future__ import annotations

import pytest
import torch

from sparsedecode.models.attention import rows_attention, rows_split_k


@pytest.mark.parametrize("B, Hq, Hkv, T, D", [(3, 4, 2, 50, 16), (5, 6, 3, 97, 24), (1, 8, 1, 33, 8)])
@pytest.mark.parametrize("mix", ["cache", "compact", "mixed"])
def test_the_captured_form_equals_per_row_sdpa(B, Hq, Hkv, T, D, mix):
    g = torch.Generator().manual_seed(B * T + D)
    q = torch.randn(B, Hq, D, generator=g)
    k, v = torch.randn(B, Hkv, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g)
    pos = torch.randint(1, T - 1, (B,), generator=g)  # each row at its own position
    compact = None
    if mix != "cache":
        Tc = 21
        ck, cv = torch.randn(B, Hkv, Tc, D, generator=g), torch.randn(B, Hkv, Tc, D, generator=g)
        offset = (pos - torch.randint(0, Tc, (B,), generator=g)).clamp(min=0)  # slot = pos - offset < Tc
        offset = torch.maximum(offset, pos - (Tc - 1))
        sel = torch.ones(B, dtype=torch.bool) if mix == "compact" else torch.arange(B) % 2 == 0
        compact = (ck, cv, offset, sel)
    eager = rows_attention(q, k, v, pos, compact)
    captured = rows_split_k(q, k, v, pos, compact)
    torch.testing.assert_close(captured, eager, rtol=1e-5, atol=1e-5)
    b = 0  # row 0 by hand: SDPA over what it reads
    if compact is not None and bool(compact[3][0]):
        kk, vv, n = compact[0][0], compact[1][0], int(pos[0] - compact[2][0]) + 1
    else:
        kk, vv, n = k[0], v[0], int(pos[0]) + 1
    G = Hq // Hkv
    s = torch.einsum("hgd,htd->hgt", q[b].view(Hkv, G, D), kk[:, :n]) / D**0.5
    want = torch.einsum("hgt,htd->hgd", s.softmax(-1), vv[:, :n]).reshape(Hq, D)
    torch.testing.assert_close(eager[0], want, rtol=1e-5, atol=1e-5)
