"""Why the fused SDPA path is slow at decode (ByteCross §4.4, App. D): PyTorch SDPA of one
token over a valid cache slice, per backend, beside our split-K kernel, on one GPU.

Llama-3.1-8B attention shapes in bf16: q (1, 8, 4, 128), the 4 query heads of each of 8 KV
heads riding as 4 query rows (as engine.attention._fused calls it), keys and values the
first n entries of a (1, 8, T, 128) cache. Each cell times `--reps` CUDA-graph replays of
32 calls (one per layer, each on its own cache so the 32 reads come from DRAM) and reports
microseconds per call and the achieved GB/s of the 2 x n x 8 x 128 x 2 bytes read.

    PYTHONPATH=src python3 benchmarks/sdpa_decode_h200.py --out DIR

One record (kind 'sdpa_decode_bench') per run in DIR.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from sparsedecode.account.units import parse_token_list
from sparsedecode.engine.attention import split_k_lse
from sparsedecode.records import stamp, write_record

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
LAYERS = 32


def graph_time(fn, reps: int) -> float:
    """Seconds per call of fn (which makes LAYERS calls) replayed in a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / LAYERS)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--contexts", default="2K,8K,32K,64K,128K")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    dev = torch.device("cuda")
    contexts = parse_token_list(a.contexts)
    T = max(contexts)
    gen = torch.Generator(dev).manual_seed(0)
    caches = [(torch.randn(1, 8, T, 128, device=dev, dtype=torch.bfloat16, generator=gen),
               torch.randn(1, 8, T, 128, device=dev, dtype=torch.bfloat16, generator=gen)) for _ in range(LAYERS)]
    q = torch.randn(1, 8, 4, 128, device=dev, dtype=torch.bfloat16, generator=gen)
    rows = []
    for n in contexts:
        nbytes = 2 * n * 8 * 128 * 2
        for name, be in [*BACKENDS.items(), ("split_k", None)]:
            if be is None:
                def fn(n=n):
                    for k, v in caches:
                        split_k_lse(q.view(1, 32, 128), k, v, n)
            else:
                def fn(n=n, be=be):
                    with sdpa_kernel([be]):
                        for k, v in caches:
                            F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n])
            try:
                t = graph_time(fn, a.reps)
            except Exception as e:  # a backend that does not take these shapes: say so and go on
                print(f"n={n} {name}: not run ({str(e).splitlines()[0][:120]})", flush=True)
                rows.append({"context": n, "backend": name, "error": str(e).splitlines()[0][:300]})
                continue
            rows.append({"context": n, "backend": name, "us_per_call": t * 1e6, "bytes_per_call": nbytes,
                         "gbps": nbytes / t / 1e9})
            print(f"n={n:>6} {name:9s} {t * 1e6:9.1f} us/call  {nbytes / t / 1e9:7.0f} GB/s", flush=True)
        with sdpa_kernel(list(BACKENDS.values())):  # what PyTorch picks by itself
            try:
                t = graph_time(lambda n=n: [F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n])
                                            for k, v in caches], a.reps)
                rows.append({"context": n, "backend": "auto", "us_per_call": t * 1e6, "bytes_per_call": nbytes,
                             "gbps": nbytes / t / 1e9})
                print(f"n={n:>6} {'auto':9s} {t * 1e6:9.1f} us/call  {nbytes / t / 1e9:7.0f} GB/s", flush=True)
            except Exception as e:
                print(f"n={n} auto: not run ({str(e).splitlines()[0][:120]})", flush=True)
    run = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    rec = stamp({"kind": "sdpa_decode_bench", "gpu": torch.cuda.get_device_name(dev), "dtype": "bfloat16",
                 "q_shape": [1, 8, 4, 128], "cache_shape": [1, 8, T, 128], "layers": LAYERS, "reps": a.reps,
                 "graph": True, "rows": rows})
    write_record(a.out / f"sdpa_decode_bench-{run}.json", rec)


if __name__ == "__main__":
    main()
