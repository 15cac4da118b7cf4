"""The read-floor kernel (read_floor.py beside this file) against its PyTorch reference: every element read
once, each program's partial where the tiling puts it, under TRITON_INTERPRET=1 and on CUDA."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from read_floor import CONFIGS, label, programs, stream_sum, stream_sum_ref

from interpreted import run_interpreted  # tests/, on the path by pyproject's pythonpath
from sparsedecode.errors import InputError

HAS_TRITON = importlib.util.find_spec("triton") is not None
SMALL = [("chunk", 64, 3, 1, 1), ("chunk", 32, 1, 1, 1), ("stride", 64, 2, 1, 2), ("stride", 16, 3, 1, 1)]


def _cases(device: str, configs, sizes, sm_count: int | None):
    fails, n_cases = [], 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for n in sizes:
            x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(device, dtype)
            for cfg in configs:
                got = stream_sum(x, cfg, sm_count=sm_count)
                want = stream_sum_ref(x, cfg, sm_count if sm_count is not None else
                                      torch.cuda.get_device_properties(x.device).multi_processor_count)
                n_cases += 1
                if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-3):
                    fails.append(f"{label(cfg)} n={n} {dtype}: {got[:4].tolist()} vs {want[:4].tolist()}")
                if abs(got.sum().item() - x.float().sum().item()) > 1e-3 * max(1.0, x.float().abs().sum().item()):
                    fails.append(f"{label(cfg)} n={n} {dtype}: total {got.sum().item()} vs {x.float().sum().item()}")
    return fails, n_cases


def _interpreter_worker() -> None:
    fails, n_cases = _cases("cpu", SMALL, (1, 63, 1000, 4097), sm_count=3)
    print(json.dumps({"fails": fails, "cases": n_cases}))


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_stream_sum_reads_every_element_once_under_the_interpreter():
    report = run_interpreted(__file__, "_interpreter_worker")
    assert report["cases"] == 48 and not report["fails"], "\n".join(report["fails"])


def test_reference_tiling():
    x = torch.arange(10, dtype=torch.float32)
    # chunk: tiles of 4 ([0..3], [4..7], [8, 9]), 2 tiles a program -> programs own [0..7] and [8, 9]
    assert stream_sum_ref(x, ("chunk", 4, 2, 1, 1), sm_count=1).tolist() == [28.0, 17.0]
    # stride: 2 programs (2 per SM x 1 SM) take tiles 0, 2 and 1
    assert stream_sum_ref(x, ("stride", 4, 2, 1, 1), sm_count=1).tolist() == [6.0 + 17.0, 22.0]
    assert programs(10, ("stride", 4, 8, 1, 1), sm_count=4) == 3  # never more programs than tiles
    assert all(programs(1 << 20, cfg, 132) >= 1 for cfg in CONFIGS)


@pytest.mark.parametrize("x, cfg, what", [
    (torch.zeros(4, 4), ("chunk", 4, 1, 1, 1), "1-D"),
    (torch.zeros(8)[::2], ("chunk", 4, 1, 1, 1), "contiguous"),
    (torch.zeros(0), ("chunk", 4, 1, 1, 1), "non-empty"),
    (torch.zeros(8), ("chunk", 6, 1, 1, 1), "power-of-two"),
    (torch.zeros(8), ("rows", 4, 1, 1, 1), "'chunk' or 'stride'"),
])
def test_bad_input_is_refused(x, cfg, what):
    with pytest.raises(InputError, match=what):
        stream_sum_ref(x, cfg, sm_count=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pdl", [False, True])
def test_stream_sum_cuda(pdl):
    fails, n_cases = _cases("cuda", CONFIGS, (1, 1000, 1 << 20, (1 << 20) + 77), sm_count=None)
    assert n_cases and not fails, "\n".join(fails)
    x = torch.randn(5000, device="cuda")
    out = torch.empty(10000, device="cuda")
    assert stream_sum(x, CONFIGS[0], out, pdl=pdl).data_ptr() == out.data_ptr()
