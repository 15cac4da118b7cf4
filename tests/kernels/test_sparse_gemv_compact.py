"""The kept-row-list variant of the sparse GEMV (config stages 8): each program lists the kept
rows of its split and their x, then streams full tiles of them, two in flight (ByteCross §3.2:
only kept rows are read).
Against the float64 masked product on odd shapes, every keep, segments on the tile grid,
several split counts; on CPU under TRITON_INTERPRET=1 and on CUDA when there is one."""

from __future__ import annotations

import json
import math

import pytest
import torch

from interpreted import run_interpreted
from sparsedecode.kernels.sparse_gemv import (
    keep_mask,
    sparse_gemv,
    sparse_gemv_segments_ref,
    workspace,
)

CUDA = torch.cuda.is_available()


def _case(K, N, dtype, keep, device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, K, generator=gen).to(device, dtype)  # (1, K)
    w_t = (torch.randn(K, N, generator=gen) / math.sqrt(K)).to(device, dtype)  # (K, N)
    b = torch.randn(N, generator=gen).to(device, dtype)
    t = 0.0 if keep >= 1 else float(x.float().abs().quantile(1 - keep))
    return x, w_t, b, t


def _err(y, x, w_t, t, b) -> float:
    """max |y - exact| / (max |exact| + 1), exact the float64 masked product."""
    want = torch.where(keep_mask(x, t), x.double(), 0.0) @ w_t.double() + b.double()
    return ((y.double() - want).abs().max() / (want.abs().max() + 1)).item()


def _cases(device) -> list[str]:
    fails = []
    shapes = {torch.bfloat16: ((301, 96), (77, 45)), torch.float16: ((1000, 37),)}
    if device != "cpu":
        shapes[torch.bfloat16] += ((577, 1537), (4096, 1000))
    for dtype, sizes in shapes.items():
        tol = 2.0**-6 if dtype == torch.bfloat16 else 2.0**-9
        for K, N in sizes:
            for keep in (0.0, 0.3, 1.0):
                x, w_t, b, t = _case(K, N, dtype, keep, device, K + N)
                if keep == 0.0:
                    t = math.inf  # nothing kept: y is the bias
                for block_k, splits in ((16, 1), (8, 7), (16, 40)):
                    ws = workspace(N, device)
                    y = sparse_gemv(x, w_t, torch.tensor(t, device=device), b, ws=ws,
                                    config=(32, block_k, splits, 1, 8))
                    err = _err(y, x, w_t, t, b)
                    if not err <= tol:
                        fails.append(f"{dtype} {K}x{N} keep={keep} BLOCK_K={block_k} splits={splits}: {err:.3g}")
                    if ws[0].abs().sum() != 0 or ws[1].abs().sum() != 0:
                        fails.append(f"{dtype} {K}x{N}: workspace not back at zero")
    # segments on the tile grid (q|k|v-like): each block with its own threshold
    x, w_t, b, _ = _case(301, 96, torch.bfloat16, 1.0, device, 5)
    thr = [torch.tensor(float(x.float().abs().quantile(1 - k)), device=device) for k in (0.2, 0.7, 0.4)]
    want = sparse_gemv_segments_ref(x, w_t, thr, [32, 32, 32], b)
    y = sparse_gemv(x, w_t, thr, b, segments=[32, 32, 32], config=(32, 16, 5, 1, 8))
    if (y.float() - want.float()).abs().max() > 2.0**-6 * (want.float().abs().max() + 1):
        fails.append("segments on the tile grid differ from the reference")
    return fails


def _interpreter_worker() -> None:
    print(json.dumps({"fails": _cases("cpu")}))


def test_compact_variant_matches_the_masked_product_under_the_interpreter():
    report = run_interpreted(__file__, "_interpreter_worker")
    assert report["fails"] == []


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_compact_variant_matches_the_masked_product_on_cuda():
    assert _cases("cuda") == []
