"""Step timing of the harness (ByteCross App. A 'Timing'): W warm-up calls, then R repeats of
S calls, each repeat timed as a block and divided by S. On CUDA the block is bracketed by two
CUDA events on the current stream, so the host never waits inside a block; on CPU the host
clock times it (labelled CPU wherever it is reported). Kernel micro-benchmarks time replays of a
captured CUDA graph instead (`time_graph`), so launch gaps from the host do not count."""

from __future__ import annotations

import time
from collections.abc import Callable


def process_age_s() -> float | None:
    """Seconds since this process started (interpreter start and imports included), from
    /proc/self/stat and /proc/uptime; None where there is no /proc. 10 ms resolution."""
    import os
    from pathlib import Path

    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)


def time_blocks(step: Callable[[], object], warmup: int, repeats: int, steps: int,
                cuda: bool) -> list[float]:
    """Mean ms per call of each of `repeats` blocks of `steps` calls of `step`, after `warmup` calls."""
    import torch

    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                step()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / steps)
        else:
            t = time.perf_counter()
            for _ in range(steps):
                step()
            out.append((time.perf_counter() - t) * 1e3 / steps)
    return out


def time_graph(calls: Callable[[], object], replays: int, warmup: int = 5,
               per_replay: int = 1) -> list[float]:
    """Seconds per call of each of `replays` CUDA-graph replays of `calls` (ByteCross App. A 'Timing')."""
    import torch

    if replays < 1 or warmup < 0 or per_replay < 1:
        raise ValueError(f"time_graph: replays {replays} and per_replay {per_replay} must be >= 1, "
                         f"warmup {warmup} >= 0")
    if not torch.cuda.is_available():
        raise RuntimeError("time_graph captures and replays a CUDA graph: it needs a CUDA GPU")
    stream = torch.cuda.Stream()  # the first run (compiles, allocates) on a side stream, as capture wants
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    for _ in range(warmup):
        graph.replay()
    out = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3 / per_replay)
    return out
