"""The measured bandwidth ceiling: what one matrix-vector product over a large weight reads per
second on this device, the roof a decode step's bytes are judged against beside the nominal
peak (ByteCross §4.4: a step at its byte bound still lags the datasheet; 4.15 TB/s for a bf16
GEMV on the H200 against 4.8 nominal).

`measure_ceiling` times `torch.mv` (cuBLAS GEMV on CUDA) over a weight of at least `gib` GiB,
far beyond the L2, so every call streams it from memory: on CUDA `calls` products per CUDA
graph replay (timing/clock.time_graph), on CPU the host clock (labelled CPU).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from sparsedecode.errors import InputError, option

KIND = "bandwidth_ceiling"


def measure_ceiling(device: str = "auto", dtype: str = "auto", gib: float = 1.0, replays: int = 20,
                    calls: int = 10, shared_gpu: str = "refuse") -> dict:
    """A 'bandwidth_ceiling' record: GB/s of each replay, their median, and how it was read.
    Like a timing cell it refuses a GPU other processes hold unless `shared_gpu` is 'allow'
    (timing.neighbors), and records who was there."""
    import torch

    from sparsedecode.engine.device import resolve_device, resolve_dtype
    from sparsedecode.records import stamp
    from sparsedecode.timing.clock import time_blocks, time_graph
    from sparsedecode.timing.neighbors import watched

    if not gib > 0 or replays < 1 or calls < 1:
        raise InputError(f"ceiling: {option('gib')} must be > 0 and {option('replays')}, {option('calls')} >= 1 (got {gib}, {replays}, {calls})")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    k = 8192
    n = max(1, int(gib * 2**30 / (k * dt.itemsize)))
    w = torch.randn(n, k, device=dev, dtype=dt)
    x = torch.randn(k, device=dev, dtype=dt)
    y = torch.empty(n, device=dev, dtype=dt)
    nbytes = w.numel() * dt.itemsize + x.numel() * dt.itemsize + y.numel() * dt.itemsize

    def run():
        for _ in range(calls):
            torch.mv(w, x, out=y)

    def timed() -> list[float]:
        if dev.type == "cuda":
            return time_graph(run, replays, per_replay=calls)
        return [ms / 1e3 for ms in time_blocks(lambda: torch.mv(w, x, out=y), warmup=2, repeats=replays,
                                               steps=calls, cuda=False)]

    seconds, seen = watched(dev, shared_gpu, timed)
    gbps = [nbytes / s / 1e9 for s in seconds]
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    return stamp({
        "kind": KIND,
        "device": dev.type,
        "gpu": gpu,
        "label": "CPU" if dev.type == "cpu" else None,
        "dtype": str(dt).removeprefix("torch."),
        "method": f"torch.mv over a ({n}, {k}) weight, {calls} calls per "
                  + ("CUDA graph replay (cuBLAS GEMV)" if dev.type == "cuda" else "host-timed block"),
        "bytes_per_call": nbytes,
        "gbps_runs": gbps,
        "gbps": statistics.median(gbps),
        "gpu_neighbors": seen,  # other processes on the GPU around the timed replays; None = unknown
    })


def read_ceiling(path) -> dict:
    """A ceiling record from its file; InputError naming the file when it is not one."""
    from sparsedecode.records import read_record

    rec = read_record(path)
    if rec.get("kind") != KIND or not isinstance(rec.get("gbps"), (int, float)) or not rec["gbps"] > 0:
        raise InputError(f"{path} is not a bandwidth ceiling record (`sparsedecode bench ceiling --out F`)")
    return rec


def campaign_ceiling(cc, ceiling) -> tuple[float | None, str]:
    """The measured ceiling in GB/s and where it came from: a 'bandwidth_ceiling' record
    (`sparsedecode bench ceiling`), the given one or the campaign folder's ceiling.json, for the
    campaign's cells `cc`."""
    path = Path(ceiling) if ceiling is not None else Path(cc.folder) / "ceiling.json"
    if ceiling is None and not path.is_file():
        return None, ("no measured ceiling (a CUDA `campaign run` writes DIR/ceiling.json; else run "
                      "`sparsedecode bench ceiling --out DIR/ceiling.json` in the same call as the cells): "
                      "% of ceiling left blank")
    rec = read_ceiling(path)
    if cc.source == "sparsedecode" and rec.get("gpu") != cc.gpu:
        raise InputError(f"{path}: the ceiling was measured on {rec.get('gpu')}, the cells on {cc.gpu}")
    return float(rec["gbps"]), f"measured ceiling ({path.name}: {rec['method']})"


__all__ = ["KIND", "campaign_ceiling", "measure_ceiling", "read_ceiling"]
