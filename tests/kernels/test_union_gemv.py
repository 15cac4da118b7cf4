"""The batched union GEMV on the GPU (kernels/union_gemv.py; issue 44 item 3): each token of a
decode batch is its own input-sparse product, the weight read once over the union of kept
channels. Odd shapes, B = 1..64, keeps 0.05-1.0, bfloat16 and float16 (and float32), under the
Triton interpreter on CPU and on a CUDA GPU when there is one."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

from interpreted import run_interpreted

SHAPES = [(1, 1, 1), (3, 13, 7), (7, 65, 33), (16, 97, 130), (64, 129, 65)]  # (B, K, N)
KEEPS = [0.05, 0.3, 0.5, 1.0]


def _case(B, K, N, dtype, keep, device, seed):
    from test_sparse_gemv import threshold_for

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, K, generator=gen) * torch.linspace(0.5, 2.0, B).reshape(B, 1)
    w_t = torch.randn(K, N, generator=gen) / math.sqrt(K)
    b = torch.randn(N, generator=gen)
    return x.to(device, dtype), w_t.to(device, dtype), b.to(device, dtype), threshold_for(x, keep)


def _check(device: str, dtypes, shapes=SHAPES, keeps=KEEPS) -> list[str]:
    """Failures of union_gemv against float64 per token, and of its union count."""
    from sparsedecode.kernels.sparse_gemv import keep_mask
    from sparsedecode.kernels.union_gemv import union_gemv

    fails = []
    for dtype in dtypes:
        for B, K, N in shapes:
            for keep in keeps:
                x, w_t, b, t = _case(B, K, N, dtype, keep, device, seed=B + K + N + int(100 * keep))
                count = torch.zeros(1, dtype=torch.int32, device=device)
                y = union_gemv(x, w_t, t, b, union=count)
                keep_m = keep_mask(x, t)
                y64 = torch.where(keep_m, x.double(), 0.0) @ w_t.double() + b.double()
                same = (torch.where(keep_m, x, torch.zeros_like(x)).float() @ w_t.float() + b.float()).to(dtype)
                tol = 4 * (same.double() - y64).abs().max().item() + 1e-5 * (1 + y64.abs().max().item())
                err = (y.double() - y64).abs().max().item()
                what = f"B={B} K={K} N={N} {dtype} keep={keep}"
                if y.shape != (B, N) or y.dtype != dtype or not err <= tol:
                    fails.append(f"{what}: error {err:.3g} > {tol:.3g} (shape {tuple(y.shape)}, {y.dtype})")
                if int(count.item()) != int(keep_m.any(0).sum()):
                    fails.append(f"{what}: union {int(count.item())} rows, want {int(keep_m.any(0).sum())}")
    return fails


def _poison(device: str) -> bool:
    """Rows no token keeps poisoned with NaN stay unread (finite output)."""
    from sparsedecode.kernels.sparse_gemv import keep_mask
    from sparsedecode.kernels.union_gemv import union_gemv

    x, w_t, b, t = _case(5, 301, 129, torch.bfloat16, 0.2, device, seed=4)
    poisoned = w_t.clone()
    poisoned[~keep_mask(x, t).any(0)] = math.nan
    return bool(torch.isfinite(union_gemv(x, poisoned, t, b).float()).all())


def _worker() -> None:
    print(json.dumps({"fails": _check("cpu", [torch.bfloat16, torch.float16, torch.float32],
                                      shapes=SHAPES[:4] + [(64, 33, 65)], keeps=[0.05, 0.5, 1.0]),
                      "poison": _poison("cpu")}))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_union_gemv_under_interpreter():
    r = run_interpreted(__file__, "_worker", timeout=900)
    assert not r["fails"], "\n".join(r["fails"][:10])
    assert r["poison"]


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="needs a CUDA GPU and triton")
def test_union_gemv_on_the_gpu():
    fails = _check("cuda", [torch.bfloat16, torch.float16, torch.float32])
    assert not fails, "\n".join(fails[:10])
    assert _poison("cuda")


def test_bad_input_is_refused_in_one_line():
    from sparsedecode.errors import InputError
    from sparsedecode.kernels.union_gemv import union_gemv

    x, w_t, b, _ = _case(3, 16, 8, torch.float32, 0.5, "cpu", seed=0)
    with pytest.raises(InputError, match=r"x \(B, K\) and w_t \(K, N\)"):
        union_gemv(x[0], w_t, 0.1)
    with pytest.raises(InputError, match="one dtype"):
        union_gemv(x, w_t.double(), 0.1)
    with pytest.raises(InputError, match="bias must be"):
        union_gemv(x, w_t, 0.1, b[:3])
