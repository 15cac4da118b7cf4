"""The batched union GEMV against dense and its union's byte time on one GPU (issue 44 item 3;
ByteCross §3.3, App. F).

Llama-3.1-8B MLP shapes in bf16: down (K=14336 in, N=4096 out) and gate|up fused (K=4096,
N=28672), each weight larger than the L2, so every call streams it. A batch of B tokens, each
keeping half its channels (the |x| quantile of its own row, random normal x: the tokens' masks
are independent, so the union is about 1 - 0.5^B, what real text gives within a few hundredths:
benchmarks/records/union). For each B: `union_gemv` (one weight read over the union), dense
`F.linear` (cuBLAS, every row) and, at B = 1, the tuned one-token kernel `sparse_gemv`. Each is
20 calls captured in one CUDA graph, the median of `--calls` replays (per call) timed with CUDA
events: no host launch time. Bytes read = union rows * N * 2 (+ x); the
record gives GB/s of each beside the measured ceiling passed in (`--ceiling`, a `bench ceiling`
record of the same machine).

    PYTHONPATH=src python3 benchmarks/kernels/union_gemv_bench.py --ceiling C.json --out R.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from sparsedecode.kernels.sparse_gemv import keep_mask, sparse_gemv
from sparsedecode.kernels.union_gemv import DEFAULT, UnionConfig, union_gemv
from sparsedecode.records import stamp, write_record
from sparsedecode.timing.clock import time_graph

SHAPES = {"down": (14336, 4096), "gate|up": (4096, 28672)}


def timed(fn, calls: int, reps: int = 20) -> float:
    """Median ms of one call of fn: `reps` calls captured in one CUDA graph (no host launch time
    in the measurement), `calls` replays (`timing.clock.time_graph`)."""
    def run():
        for _ in range(reps):
            fn()
    return statistics.median(time_graph(run, calls, warmup=1, per_replay=reps)) * 1e3


def sweep(a) -> None:
    """Every config of a small grid on both shapes at B = 1, 4, 16 (keep --keep); the record ranks
    them by the sum of their times."""
    import itertools

    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for name, (K, N) in SHAPES.items():
        w_t = torch.randn(K, N, device="cuda", dtype=torch.bfloat16, generator=gen) / K ** 0.5
        for B in (1, 4, 16):
            x = torch.randn(B, K, device="cuda", dtype=torch.bfloat16, generator=gen)
            cases.append((name, B, x, w_t, x.float().abs().quantile(1 - a.keep, dim=1).min().item()))
    rows = []
    for bn, bk, warps, pps in itertools.product((64, 128, 256), (16, 32, 64), (1, 2, 4), (2, 8, 16)):
        cfg = UnionConfig(block_n=bn, block_k=bk, warps=warps, programs_per_sm=pps)
        try:
            times = {f"{n} B={B}": timed(lambda x=x, w_t=w_t, t=t, cfg=cfg: union_gemv(x, w_t, t, config=cfg), 20)
                     for n, B, x, w_t, t in cases}
        except Exception as e:  # a config the compiler refuses (registers, shared memory) is recorded as such
            rows.append({"config": cfg.__dict__, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        rows.append({"config": cfg.__dict__, "ms": times, "total_ms": sum(times.values())})
        print(cfg, f"total {sum(times.values()) * 1e3:.0f} us", flush=True)
    ok = sorted((r for r in rows if "total_ms" in r), key=lambda r: r["total_ms"])
    print("fastest:", ok[0]["config"], "default:", DEFAULT)
    write_record(a.out, stamp({"kind": "union_gemv_sweep", "gpu": torch.cuda.get_device_name(), "dtype": "bfloat16",
                               "keep": a.keep, "rows": rows, "fastest": ok[0]["config"],
                               "default": DEFAULT.__dict__}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--keep", type=float, default=0.5)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--ceiling", required=True, help="a `sparsedecode bench ceiling` record of this machine")
    ap.add_argument("--out", required=True)
    ap.add_argument("--sweep", action="store_true",
                    help="time every UnionConfig of the grid at B = 1, 4, 16 instead, and name the fastest")
    a = ap.parse_args()
    if a.sweep:
        return sweep(a)
    ceiling = json.loads(Path(a.ceiling).read_text())["gbps"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (K, N) in SHAPES.items():
        w_t = torch.randn(K, N, device="cuda", dtype=torch.bfloat16, generator=gen) / K ** 0.5  # (K, N)
        w = w_t.t().contiguous()  # (N, K): cuBLAS's layout for F.linear
        for B in (int(b) for b in a.batches.split(",")):
            x = torch.randn(B, K, device="cuda", dtype=torch.bfloat16, generator=gen)
            t = x.float().abs().quantile(1 - a.keep, dim=1).min().item()  # every token keeps >= keep
            keep = keep_mask(x, t)
            union_rows = int(keep.any(0).sum())
            count = torch.zeros(1, dtype=torch.int32, device="cuda")
            u_ms = timed(lambda x=x, t=t, w_t=w_t: union_gemv(x, w_t, t), a.calls)
            d_ms = timed(lambda x=x, w=w: F.linear(x, w), a.calls)
            union_gemv(x, w_t, t, union=count)
            byte = union_rows * N * 2 + B * K * 2
            row = {"shape": name, "K": K, "N": N, "batch": B, "keep": a.keep, "union": union_rows / K,
                   "union_counted": int(count.item()) / K, "union_ms": u_ms, "dense_ms": d_ms,
                   "union_gbps": byte / u_ms / 1e6, "dense_gbps": (K * N * 2 + B * K * 2) / d_ms / 1e6,
                   "speedup_vs_dense": d_ms / u_ms, "union_byte_bound": (K * N) / max(union_rows * N, 1)}
            if B == 1:
                row["one_token_ms"] = timed(lambda x=x, t=t, w_t=w_t: sparse_gemv(x, w_t, t), a.calls)
            row["union_pct_of_ceiling"] = 100 * row["union_gbps"] / ceiling
            rows.append(row)
            print(f"{name} B={B}: union {row['union']:.3f}, union_gemv {u_ms * 1e3:.1f} us "
                  f"({row['union_pct_of_ceiling']:.0f}% of ceiling), dense {d_ms * 1e3:.1f} us, "
                  f"speedup {row['speedup_vs_dense']:.2f}x (bound {row['union_byte_bound']:.2f}x)"
                  + (f", one-token kernel {row['one_token_ms'] * 1e3:.1f} us" if B == 1 else ""), flush=True)
    write_record(a.out, stamp({"kind": "union_gemv_bench", "gpu": torch.cuda.get_device_name(), "dtype": "bfloat16",
                               "ceiling_gbps": ceiling, "ceiling_record": Path(a.ceiling).name, "calls": a.calls,
                               "rows": rows}))


if __name__ == "__main__":
    main()
