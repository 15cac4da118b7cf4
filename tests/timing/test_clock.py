"""The CUDA-graph timer of the kernel benchmarks (timing.clock.time_graph): its refusals on any
machine, and on CUDA the count, units and per-call division of what it returns."""

from __future__ import annotations

import statistics

import pytest
import torch

from sparsedecode.timing.clock import time_graph

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_time_graph_without_cuda_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        time_graph(lambda: None, replays=3)


@pytest.mark.parametrize("kw", [{"replays": 0}, {"replays": 3, "per_replay": 0}, {"replays": 3, "warmup": -1}])
def test_time_graph_refuses_bad_counts(kw):
    with pytest.raises(ValueError, match="time_graph"):
        time_graph(lambda: None, **kw)


@CUDA
def test_time_graph_times_a_copy_per_call():
    nbytes = 1 << 28
    src = torch.ones(nbytes // 4, device="cuda")
    dsts = [torch.empty_like(src) for _ in range(4)]
    hits = torch.zeros((), device="cuda")

    def one():
        dsts[0].copy_(src)
        hits.add_(1)

    def four():
        for d in dsts:
            d.copy_(src)
            hits.add_(1)

    t_one = time_graph(one, replays=7, warmup=2)
    torch.cuda.synchronize()
    assert hits.item() == 1 + 2 + 7  # the side-stream run, the warm-up and the timed replays
    t_four = time_graph(four, replays=5, warmup=1, per_replay=len(dsts))
    torch.cuda.synchronize()
    assert hits.item() == 10 + 4 * (1 + 1 + 5)
    assert len(t_one) == 7 and len(t_four) == 5
    assert all(t > 0 for t in t_one + t_four)
    assert all(torch.equal(d, src) for d in dsts)
    rate = 2 * nbytes / statistics.median(t_one)  # bytes read and written per second
    assert 5e10 < rate < 2e13, f"{rate:.3g} B/s: not seconds per copy"
    ratio = statistics.median(t_four) / statistics.median(t_one)  # per_replay divides the replay
    assert 0.5 < ratio < 2, f"four copies per replay time {ratio:.2f}x one copy each"
