"""Input-sparse GEMV against its byte time on one GPU (ByteCross §3.2, §4.1, App. A).

Llama-3.1-8B MLP shapes in bf16, one token: gate/up (K=4096 in, N=14336 out) and
down (K=14336, N=4096), at keeps 1.0, 0.5 and 0.3. x is random normal and the
threshold is the |x| quantile, so the kept channel count is exact. Each cell
captures `--copies` distinct weight copies x `--rounds` calls in one CUDA graph
(a copy is revisited only after the others have flushed the 50 MB L2), times
`--reps` replays with CUDA events and takes the median per call.

Bytes read are what the kernel must read: kept rows * N * 2 + the K * 2 bytes of
x. The byte time is bytes / 4.15 TB/s (the H200's measured streaming rate, as
in the attention benchmark); the target is time <= 1.15x byte time at keeps 0.5
and 0.3. Dense F.linear (x @ W^T with W (N, K), cuBLAS's GEMV) at the same shape
is timed the same way for comparison.

  PYTHONPATH=src python3 benchmarks/sparse_gemv_bench.py --out DIR [--sweep]

Writes one record per cell of kind 'sparse_gemv_bench' into DIR (sweep cells into
DIR/sweep) and all of them as one JSON list in DIR/sparse_gemv_records.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from sparsedecode.kernels import sparse_gemv as sg
from sparsedecode.records import stamp, write_record

SHAPES = {"gate_up": (4096, 14336), "down": (14336, 4096)}  # name: (K in, N out)
KEEPS = (1.0, 0.5, 0.3)
BYTE_RATE = 4.15e12  # B/s: the H200 streaming rate the target is set against
TARGET = 1.15
# (BLOCK_N, BLOCK_K, programs per SM, num_warps) tried by --sweep beside the default
SWEEP = [(256, 16, 24, 1), (256, 32, 8, 1), (256, 32, 6, 1), (256, 64, 6, 1), (512, 32, 6, 2),
         (1024, 32, 3, 4), (1024, 16, 6, 4), (256, 32, 4, 4), (128, 32, 12, 1)]
COMBINED = "sparse_gemv_records.json"


def time_graph(fn, args_list, reps: int) -> list[float]:
    """Per-call seconds of `reps` replays of one graph that calls fn(*args) for each args."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for a in args_list:
            fn(*a)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for a in args_list:
            fn(*a)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(args_list))
    return times


def sweep_config(K: int, N: int, block_n: int, block_k: int, per_sm: int, warps: int) -> tuple:
    """(BLOCK_N, BLOCK_K, splits, num_warps) with the split count for `per_sm` programs per SM."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    want = max(1, round(per_sm * sms / -(-N // block_n)))
    return block_n, block_k, sg._splits(K, block_k, want), warps


def check(x, w_t, thr, ws, config, what: str) -> float:
    """Max error of the kernel against the masked reference; raises when any element is off."""
    got = sg.sparse_gemv(x, w_t, thr, ws=ws, config=config).float()
    want = sg.sparse_gemv_ref(x, w_t, thr).float()
    err = (got - want).abs()
    tol = 2 * 2.0**-8 * want.abs().max().item() + 1e-3  # two bf16 ulps of the largest output
    bad = int((err > tol).sum())
    if bad:
        worst = int(err.argmax())
        raise AssertionError(f"{what}: {bad} of {err.numel()} outputs off by > {tol:.3g} (max "
                             f"{err.max().item():.3g} at {worst}: got {got.flatten()[worst].item():.5g}, "
                             f"want {want.flatten()[worst].item():.5g})")
    return err.max().item()


def bench_shape(name: str, args, dev: torch.device, run: str, timer=time_graph) -> tuple[list, list]:
    """Records and table rows of one shape: dense once, then every keep x config."""
    dtype = torch.bfloat16
    records, rows = [], []
    K, N = SHAPES[name]
    gen = torch.Generator(device=dev).manual_seed(K)
    x = torch.randn(1, K, device=dev, dtype=dtype, generator=gen)  # (1, K): one token
    w_ts = [torch.randn(K, N, device=dev, dtype=dtype, generator=gen) for _ in range(args.copies)]  # (K, N)
    ws = sg.workspace(N, dev)
    dense_ws = [w.t().contiguous() for w in w_ts]  # (N, K): nn.Linear's layout, as cuBLAS runs it
    t_dense = statistics.median(timer(F.linear, [(x, w) for w in dense_ws] * args.rounds, args.reps))
    del dense_ws
    dense_bytes = K * N * 2 + K * 2
    default = sg.default_config(K, N, dtype, dev)
    variants = [("default", default)]
    if args.sweep:
        variants += [(f"b{c[0]}k{c[1]}p{c[2]}w{c[3]}", sweep_config(K, N, *c)) for c in SWEEP]
    for keep in args.keeps:
        t_val = 0.0 if keep >= 1.0 else float(x.float().abs().quantile(1.0 - keep))
        thr = torch.tensor(t_val, device=dev)
        kept = int((x.float().abs() > thr).sum())
        nbytes = kept * N * 2 + K * 2
        byte_time = nbytes / BYTE_RATE
        for label, cfg in variants:
            try:
                err = check(x, w_ts[0], thr, ws, cfg, f"{name} keep={keep} {label}")
                calls = [(x, w, thr, None, ws, cfg) for w in w_ts] * args.rounds
                t = statistics.median(timer(sg.sparse_gemv, calls, args.reps))
            except Exception as e:  # a sweep config can fail to compile or fit; report and go on
                if label == "default":
                    raise
                print(f"{name} keep={keep} {label}: failed ({str(e).splitlines()[0]})", flush=True)
                continue
            block_n, block_k, splits, warps = cfg
            rec = stamp({
                "kind": "sparse_gemv_bench", "shape": name, "K": K, "N": N, "dtype": "bfloat16",
                "keep_target": keep, "threshold": t_val, "kept_rows": kept, "keep": kept / K,
                "config_label": label,
                "config": {"block_n": block_n, "block_k": block_k, "splits": splits, "num_warps": warps,
                           "programs": -(-N // block_n) * splits},
                "copies": args.copies, "rounds": args.rounds, "reps": args.reps, "graph": True,
                "time_s": t, "bytes_read": nbytes, "tb_per_s": nbytes / t / 1e12,
                "byte_rate": BYTE_RATE, "byte_time_s": byte_time, "ratio_to_byte_time": t / byte_time,
                "target_ratio": TARGET, "meets_target": t / byte_time <= TARGET,
                "dense_time_s": t_dense, "dense_bytes": dense_bytes, "dense_tb_per_s": dense_bytes / t_dense / 1e12,
                "speedup_vs_dense": t_dense / t, "max_abs_err_vs_ref": err,
            })
            sub = args.out if label == "default" else args.out / "sweep"
            write_record(sub / f"sparse_gemv_bench-{name}-keep{keep:g}-{label}-{run}.json", rec)
            records.append(rec)
            rows.append((name, keep, label, t * 1e6, rec["tb_per_s"], t / byte_time, t_dense / t))
            print(f"{name:8s} keep={keep:<4g} {label:14s} {t * 1e6:8.1f} us  {rec['tb_per_s']:5.2f} TB/s  "
                  f"{t / byte_time:5.2f}x byte time  {t_dense / t:5.2f}x vs dense "
                  f"({t_dense * 1e6:.1f} us)", flush=True)
    del w_ts
    torch.cuda.empty_cache()
    return records, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the JSON records")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--keeps", type=float, nargs="+", default=list(KEEPS))
    ap.add_argument("--copies", type=int, default=4, help="distinct weight copies per graph (beat the L2)")
    ap.add_argument("--rounds", type=int, default=8, help="calls per copy and graph")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--sweep", action="store_true", help="also time the tile configs of SWEEP")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    if (args.out / COMBINED).exists():
        raise SystemExit(f"{args.out / COMBINED} exists; records are never overwritten: pick a new --out")
    dev = torch.device("cuda")
    run = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    records, rows = [], []
    for name in args.shapes:
        recs, shape_rows = bench_shape(name, args, dev, run)
        records += recs
        rows += shape_rows
    write_record(args.out / COMBINED, records)
    print(f"\n{'shape':8s} {'keep':>5s} {'config':14s} {'us':>8s} {'TB/s':>6s} {'x byte':>7s} {'x dense':>8s}")
    for name, keep, label, us, tbs, ratio, speed in rows:
        print(f"{name:8s} {keep:5g} {label:14s} {us:8.1f} {tbs:6.2f} {ratio:7.2f} {speed:8.2f}")


if __name__ == "__main__":
    main()
