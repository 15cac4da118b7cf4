"""Why the fused SDPA path is slow at decode (ByteCross §4.4, App. D): PyTorch SDPA of one
token over a valid cache slice, per backend, beside our split-K kernel, on one GPU.

Llama-3.1-8B attention shapes in bf16: q (1, 8, 4, 128), the 4 query heads of each of 8 KV
heads riding as 4 query rows (as models.attention._fused calls it), keys and values the
first n entries of a (1, 8, T, 128) cache. Each cell times `--reps` CUDA-graph replays of
32 calls (one per layer, each on its own cache so the 32 reads come from DRAM; timed as
sparse_gemv_bench.py times, through timing.clock.time_graph) and reports
microseconds per call and the achieved GB/s of the 2 x n x 8 x 128 x 2 bytes read.

    PYTHONPATH=src python3 benchmarks/kernels/sdpa_decode_h200.py --out DIR

One record (kind 'sdpa_decode_bench') per run in DIR.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from sparse_gemv_bench import time_calls  # the script's folder is on sys.path
from torch.nn.attention import SDPBackend, sdpa_kernel

from sparsedecode.account.units import parse_token_list
from sparsedecode.models.attention import split_k_lse
from sparsedecode.records import stamp, write_record

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
LAYERS = 32


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
        for name, be in [*BACKENDS.items(), ("split_k", None), ("auto", list(BACKENDS.values()))]:
            if be is None:
                def fn(k, v, n=n):
                    split_k_lse(q.view(1, 32, 128), k, v, n)
            else:
                def fn(k, v, n=n, be=be):  # "auto": every backend allowed, PyTorch picks
                    with sdpa_kernel(be if isinstance(be, list) else [be]):
                        F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n])
            try:
                t = statistics.median(time_calls(fn, caches, a.reps))
            except Exception as e:  # a backend that does not take these shapes: say so and go on
                print(f"n={n} {name}: not run ({str(e).splitlines()[0][:120]})", flush=True)
                rows.append({"context": n, "backend": name, "error": str(e).splitlines()[0][:300]})
                continue
            rows.append({"context": n, "backend": name, "us_per_call": t * 1e6, "bytes_per_call": nbytes,
                         "gbps": nbytes / t / 1e9})
            print(f"n={n:>6} {name:9s} {t * 1e6:9.1f} us/call  {nbytes / t / 1e9:7.0f} GB/s", flush=True)
    run = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    rec = stamp({"kind": "sdpa_decode_bench", "gpu": torch.cuda.get_device_name(dev), "dtype": "bfloat16",
                 "q_shape": [1, 8, 4, 128], "cache_shape": [1, 8, T, 128], "layers": LAYERS, "reps": a.reps,
                 "graph": True, "rows": rows})
    write_record(a.out / f"sdpa_decode_bench-{run}.json", rec)


if __name__ == "__main__":
    main()
