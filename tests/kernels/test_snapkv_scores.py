"""SnapKV's two-launch score kernels against their float32 PyTorch reference, on odd shapes:
head dims off a power of two, contexts off the tile, windows of one query and of the whole
context, several batches and GQA groups (kernels.snapkv_scores; ByteCross App. A)."""

from __future__ import annotations

import json

import pytest
import torch

from interpreted import run_interpreted
from sparsedecode.errors import InputError
from sparsedecode.kernels.snapkv_scores import scores_ref, snapkv_scores

HAS_TRITON = __import__("importlib").util.find_spec("triton") is not None
CUDA = torch.cuda.is_available() and HAS_TRITON

# (B, Hq, Hkv, W, D, n, T): T >= n slots in the cache, the rest must not be read
SMALL = [(1, 6, 2, 5, 16, 37, 40), (2, 4, 4, 1, 24, 70, 70), (1, 8, 2, 13, 32, 13, 20), (1, 2, 1, 64, 16, 130, 150)]
LARGE = [(1, 32, 8, 64, 128, 5000, 5100), (1, 14, 2, 64, 64, 3001, 3001), (2, 12, 4, 31, 80, 777, 800)]


def make(B, Hq, Hkv, W, D, n, T, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, Hq, W, D, generator=g) * 2).to(device, dtype)
    k = (torch.randn(B, Hkv, T, D, generator=g) * 2).to(device, dtype)
    k[:, :, n:] = float("nan")  # slots past n must not be read
    return q, k


def cases(device: str, dtypes, shapes) -> list[str]:
    fails = []
    for shape in shapes:
        for dtype in dtypes:
            q, k = make(*shape, dtype, device)
            n = shape[5]
            want = scores_ref(q, k, n)
            got = snapkv_scores(q, k, n)
            ok = got.shape == want.shape and torch.allclose(got, want, rtol=2e-4, atol=1e-5)
            if not ok:
                err = (got - want).abs().max().item() if got.shape == want.shape else got.shape
                fails.append(f"{device} {dtype} {shape}: max error {err}")
    return fails


def _worker():
    # fp16 and fp32: the interpreter (NumPy underneath) has no bfloat16 dot; bf16 runs on CUDA
    print(json.dumps({"fails": cases("cpu", (torch.float32, torch.float16), SMALL)}))


def test_reference_sums_each_rows_softmax():
    """Each of the G x W rows spreads one unit of attention: the scores of a KV head sum to G x W,
    and a window query never pays attention to a key after it."""
    q, k = make(1, 6, 2, 5, 16, 37, 40, torch.float32, "cpu")
    s = scores_ref(q, k, 37)
    torch.testing.assert_close(s.sum(-1), torch.full((1, 2), 15.0))
    q1 = q.clone()
    q1[:, :, :, :] = 0  # uniform attention: query w sees 32 + w + 1 keys
    s = scores_ref(q1, k, 37)
    want = sum(torch.cat([torch.full((33 + w,), 1 / (33 + w)), torch.zeros(4 - w)]) for w in range(5)) * 3
    torch.testing.assert_close(s[0, 0], want)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_kernels_under_interpreter():
    report = run_interpreted(__file__, "_worker")
    assert not report["fails"], "\n".join(report["fails"])


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU and triton")
def test_kernels_on_cuda():
    fails = cases("cuda", (torch.bfloat16, torch.float16, torch.float32), SMALL + LARGE)
    assert not fails, "\n".join(fails)


def test_kernels_refuse_the_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k = make(1, 2, 1, 2, 16, 10, 10, torch.float32, "cpu")
    with pytest.raises(InputError, match="need triton and CUDA"):
        snapkv_scores(q, k, 10)
    with pytest.raises(InputError, match="of one dtype among bf16, fp16, fp32"):
        snapkv_scores(q.double(), k.double(), 10)
