"""Step timing of the harness (ByteCross App. A 'Timing'): W warm-up calls, then R repeats of
S calls, each repeat timed as a block and divided by S. On CUDA the block is bracketed by two
CUDA events on the current stream, so the host never waits inside a block; on CPU the host
clock times it (labelled CPU wherever it is reported)."""

from __future__ import annotations

import time
from collections.abc import Callable


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
