"""CATS row-gather up projection against its byte time on one GPU (SATS paper §2, CATS).

Llama-3.1-8B up_proj in bf16, one token: w_up (N=14336 out, K=4096 in), nn.Linear's
layout, at keeps 1.0, 0.5 and 0.3. gate_act = SiLU of a random gate and the threshold
is the |gate_act| quantile, so the kept row count is known. Timing is
`sparse_gemv_bench.time_calls`: each cell captures `--copies` distinct weight copies
x `--rounds` calls in one CUDA graph (a copy is revisited only after the others have
flushed the 50 MB L2), times `--reps` replays with CUDA events and takes the median
per call. Every config is checked against `cats_up_ref` (and exact zeros where
dropped) before it is timed.

Bytes read are what the kernel must read: kept rows * K * 2 + the K * 2 bytes of x
+ the N * 2 bytes of gate_act (the N * 2 bytes of h written are not counted). The
byte time is bytes / 4.15 TB/s (the H200's measured streaming rate, as in the other
benchmarks); the target is time <= 1.15x byte time at keeps 0.5 and 0.3. Dense
F.linear (x @ W^T, cuBLAS's GEMV, the up projection as CATS on CPU reads it) is timed
the same way for comparison.

  PYTHONPATH=src python3 benchmarks/kernels/cats_gemv_bench.py --out DIR [--sweep]

Writes one record per cell of kind 'cats_gemv_bench' into DIR (sweep cells into
DIR/sweep) and all of them as one JSON list in DIR/cats_gemv_records.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from sparse_gemv_bench import BYTE_RATE, time_calls, timing_fields  # the same timing and fields

from sparsedecode.kernels import common
from sparsedecode.kernels import gather_gemv as gg
from sparsedecode.kernels import sparse_gemv as sg
from sparsedecode.records import stamp, write_record

SHAPES = {"up": (14336, 4096)}  # name: (N out, K in)
KEEPS = (1.0, 0.5, 0.3)
# (BLOCK_R, BLOCK_J, row bytes per tile, programs per SM (0: one split, full K), num_warps)
# tried by --sweep beside the default
SWEEP = [(64, 8, 512, 24, 1), (64, 16, 512, 12, 1), (64, 16, 512, 20, 1), (64, 32, 512, 12, 1),
         (128, 16, 512, 16, 1), (128, 32, 512, 12, 1), (32, 8, 512, 24, 1), (32, 16, 512, 16, 1),
         (16, 16, 512, 0, 1), (64, 16, 1024, 8, 2), (64, 16, 256, 16, 1)]
COMBINED = "cats_gemv_records.json"


def sweep_config(N: int, K: int, block_r: int, block_j: int, row_bytes: int, per_sm: int, warps: int,
                 elem: int = 2) -> tuple:
    """(BLOCK_R, BLOCK_J, BLOCK_K, splits, num_warps) with the split count for `per_sm`
    programs per SM (one split for per_sm 0)."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    block_k = row_bytes // elem
    want = max(1, round(per_sm * sms / -(-N // block_r))) if per_sm else 1
    return block_r, block_j, block_k, common.splits(K, block_k, want), warps


def check(x, w, g, thr, ws, config, what: str) -> float:
    """Max error of the kernel against the masked reference; raises when any output is off or a
    dropped channel is not exactly 0."""
    got = gg.cats_up(x, w, g, thr, ws=ws, config=config).float()
    want = gg.cats_up_ref(x, w, g, thr).float()
    err = (got - want).abs()
    tol = 2 * 2.0**-8 * want.abs().max().item() + 1e-3  # two bf16 ulps of the largest output
    bad = int((err > tol).sum())
    if bad:
        worst = int(err.argmax())
        raise AssertionError(f"{what}: {bad} of {err.numel()} outputs off by > {tol:.3g} (max "
                             f"{err.max().item():.3g} at {worst}: got {got.flatten()[worst].item():.5g}, "
                             f"want {want.flatten()[worst].item():.5g})")
    dropped = ~sg.keep_mask(g, thr)
    if (got[dropped] != 0).any():
        raise AssertionError(f"{what}: {int((got[dropped] != 0).sum())} dropped channels are not 0")
    return err.max().item()


def bench_shape(name: str, args, dev: torch.device, run: str, timer=time_calls) -> tuple[list, list]:
    """Records and table rows of one shape: dense once, then every keep x config."""
    dtype = torch.bfloat16
    records, rows = [], []
    N, K = SHAPES[name]
    gen = torch.Generator(device=dev).manual_seed(N)
    x = torch.randn(1, K, device=dev, dtype=dtype, generator=gen)  # (1, K): one token
    g = F.silu(2 * torch.randn(1, N, device=dev, generator=gen)).to(dtype)  # (1, N): SiLU(gate)
    w_ups = [torch.randn(N, K, device=dev, dtype=dtype, generator=gen) / K**0.5
             for _ in range(args.copies)]  # (N, K): nn.Linear's layout
    ws = sg.workspace(N, dev)
    t_dense = statistics.median(timer(F.linear, [(x, w) for w in w_ups] * args.rounds, args.reps))
    dense_bytes = N * K * 2 + K * 2
    variants = [("default", gg.default_config(N, K, dtype, dev))]
    if args.sweep:
        variants += [(f"r{c[0]}j{c[1]}b{c[2]}p{c[3]}w{c[4]}", sweep_config(N, K, *c)) for c in SWEEP]
    for keep in args.keeps:
        t_val = 0.0 if keep >= 1.0 else float(g.float().abs().quantile(1.0 - keep))
        thr = torch.tensor(t_val, device=dev)
        kept = int(sg.keep_mask(g, thr).sum())
        nbytes = kept * K * 2 + K * 2 + N * 2
        byte_time = nbytes / BYTE_RATE
        for label, cfg in variants:
            try:
                err = check(x, w_ups[0], g, thr, ws, cfg, f"{name} keep={keep} {label}")
                calls = [(x, w, g, thr, None, ws, cfg) for w in w_ups] * args.rounds
                t = statistics.median(timer(gg.cats_up, calls, args.reps))
            except Exception as e:  # a sweep config can fail to compile or fit; report and go on
                if label == "default":
                    raise
                print(f"{name} keep={keep} {label}: failed ({str(e).splitlines()[0]})", flush=True)
                continue
            block_r, block_j, block_k, splits, warps = cfg
            rec = stamp({
                "kind": "cats_gemv_bench", "shape": name, "N": N, "K": K, "dtype": "bfloat16",
                "keep_target": keep, "threshold": t_val, "kept_rows": kept, "keep": kept / N,
                "config_label": label,
                "config": {"block_r": block_r, "block_j": block_j, "block_k": block_k, "splits": splits,
                           "num_warps": warps, "programs": -(-N // block_r) * splits},
                "copies": args.copies, "rounds": args.rounds, "reps": args.reps, "graph": True,
                **timing_fields(t, nbytes, t_dense, dense_bytes, err),
            })
            sub = args.out if label == "default" else args.out / "sweep"
            write_record(sub / f"cats_gemv_bench-{name}-keep{keep:g}-{label}-{run}.json", rec)
            records.append(rec)
            rows.append((name, keep, label, t * 1e6, rec["tb_per_s"], t / byte_time, t_dense / t))
            print(f"{name:4s} keep={keep:<4g} {label:16s} {t * 1e6:8.1f} us  {rec['tb_per_s']:5.2f} TB/s  "
                  f"{t / byte_time:5.2f}x byte time  {t_dense / t:5.2f}x vs dense "
                  f"({t_dense * 1e6:.1f} us)", flush=True)
    del w_ups
    torch.cuda.empty_cache()
    return records, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the JSON records")
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
    for name in SHAPES:
        recs, shape_rows = bench_shape(name, args, dev, run)
        records += recs
        rows += shape_rows
    write_record(args.out / COMBINED, records)
    print(f"\n{'shape':5s} {'keep':>5s} {'config':16s} {'us':>8s} {'TB/s':>6s} {'x byte':>7s} {'x dense':>8s}")
    for name, keep, label, us, tbs, ratio, speed in rows:
        print(f"{name:5s} {keep:5g} {label:16s} {us:8.1f} {tbs:6.2f} {ratio:7.2f} {speed:8.2f}")


if __name__ == "__main__":
    main()
