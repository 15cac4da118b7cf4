"""CPU input-sparse GEMV: which implementation reads only the kept rows fastest (issue 46 item 1).

One decode token on CPU through the projection shapes of the embedded models (smollm2-135m and
qwen2.5-coder-0.5b, float32 and bfloat16), at keeps 1.0, 0.7, 0.5 and 0.3, against:
- `dense`: F.linear over nn.Linear's (out, in) weight, what the dense CPU step runs (MKL/oneDNN);
- `masked`: `sparse_gemv_ref`, the masked reference the CPU path ran before (reads every row);
- `index_select`: the kept rows gathered by `index_select`, then one GEMV (reads kept rows, writes
  and reads them again);
- `rows`: `kernels.cpu_gemv`, the C kernel (reads kept rows once).
Every candidate is checked against the masked reference first. Each cell is timed in
`--rounds` rounds of `--calls` calls through distinct weight copies spanning `--span-mb` MiB (a copy
is revisited only after the others have pushed it out of the last-level cache: the decode step streams each weight once per
token), the candidates of a cell interleaved round by round; the figure is the median per call.
Bytes are the weight rows a candidate must read (kept rows x N x element size; dense and masked
all rows). GB/s is those bytes over the median time.

    PYTHONPATH=src python3 benchmarks/kernels/cpu_gemv_bench.py --out DIR [--threads 2]

Writes DIR/cpu_gemv_bench.json (one record, a row per cell); `--table DIR/cpu_gemv_bench.json`
prints its markdown table (docs/kernels/cpu_gemv.md).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sparsedecode.kernels.cpu_gemv import cpu_kernel, sparse_gemv_cpu
from sparsedecode.kernels.sparse_gemv import sparse_gemv_ref
from sparsedecode.records import read_record, stamp, write_record

# (model, site): (K in, N out) of the (in, out) weight the sparse path keeps
SHAPES = {
    ("smollm2-135m", "qkv"): (576, 960), ("smollm2-135m", "o"): (576, 576),
    ("smollm2-135m", "gate_up"): (576, 3072), ("smollm2-135m", "down"): (1536, 576),
    ("qwen2.5-coder-0.5b", "q"): (896, 896), ("qwen2.5-coder-0.5b", "gate"): (896, 4864),
    ("qwen2.5-coder-0.5b", "down"): (4864, 896),
}
KEEPS = (1.0, 0.7, 0.5, 0.3)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def candidates(x, w_t, w, t):
    """name -> a zero-argument call on one copy's weights."""
    def index_select():
        idx = (x.float().abs() > t).reshape(-1).nonzero().reshape(-1)
        return (x.reshape(-1)[idx].float() @ w_t.index_select(0, idx).float()).to(x.dtype)
    return {"dense": lambda: F.linear(x, w), "masked": lambda: sparse_gemv_ref(x, w_t, t),
            "index_select": index_select, "rows": lambda: sparse_gemv_cpu(x, w_t, t)}


def bench_cell(K, N, dtype, keep, args) -> list[dict]:
    gen = torch.Generator().manual_seed(K * 7 + N)
    x = torch.randn(1, K, generator=gen).to(dtype)
    t = 0.0 if keep >= 1.0 else float(x.float().abs().quantile(1.0 - keep))
    kept = int((x.float().abs() > t).sum())
    elem = torch.empty((), dtype=dtype).element_size()
    n_copies = max(2, -(-args.span_mb * 2**20 // (K * N * elem * 2)))  # w_t and w: both held per copy
    copies = []
    for _ in range(n_copies):
        w_t = (torch.randn(K, N, generator=gen) / K**0.5).to(dtype)  # (K, N)
        copies.append(candidates(x, w_t, w_t.t().contiguous(), t))
    want = copies[0]["masked"]().float()
    for name, fn in copies[0].items():
        if name == "dense" and keep < 1.0:
            continue
        err = (fn().float() - want).abs().max().item()
        if err > 1e-2 * max(1.0, want.abs().max().item()):
            raise SystemExit(f"{name} disagrees with the masked reference at K={K} N={N} keep={keep}: {err}")
    times: dict[str, list[float]] = {name: [] for name in copies[0]}
    for _ in range(args.rounds):
        for name in times:
            t0 = time.perf_counter()
            for i in range(args.calls):
                copies[i % n_copies][name]()
            times[name].append((time.perf_counter() - t0) / args.calls)
    rows = []
    for name, ts in times.items():
        rows_read = K if name in ("dense", "masked") else kept
        med = statistics.median(ts)
        rows.append({"K": K, "N": N, "dtype": str(dtype).removeprefix("torch."), "keep": keep, "kept_rows": kept,
                     "impl": name, "copies": n_copies, "us": med * 1e6, "us_rounds": [v * 1e6 for v in ts],
                     "bytes": rows_read * N * elem, "gb_s": rows_read * N * elem / med / 1e9})
    return rows


def table(rec: dict) -> str:
    """The record as markdown: a row per (model, site, dtype, keep), the median µs per call of each
    implementation and the kernel's time over dense F.linear's."""
    impls = ["dense", "masked", "index_select", "rows"]
    cells: dict[tuple, dict] = {}
    for r in rec["rows"]:
        cells.setdefault((r["model"], r["site"], r["K"], r["N"], r["dtype"], r["keep"]), {})[r["impl"]] = r
    out = [f"CPU, {rec['threads']} threads, median µs per call (GB/s of the rows each must read):", "",
           "| model | site | K x N | dtype | keep | " + " | ".join(impls) + " | rows / dense |",
           "|---|---|---|---|---|" + "---|" * (len(impls) + 1)]
    for (model, site, K, N, dtype, keep), c in cells.items():
        vals = [f"{c[i]['us']:.1f} ({c[i]['gb_s']:.1f})" for i in impls]
        out.append(f"| {model} | {site} | {K} x {N} | {dtype} | {keep:g} | " + " | ".join(vals)
                   + f" | {c['rows']['us'] / c['dense']['us']:.2f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", type=Path, help="print the markdown table of this record and exit")
    ap.add_argument("--out", type=Path, help="folder for the record")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--span-mb", type=int, default=256,
                    help="the weight copies of a cell span this many MiB (beyond the last-level cache)")
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    if args.table is not None:
        print(table(read_record(args.table)))
        return
    if args.out is None:
        raise SystemExit("give --out DIR (or --table RECORD)")
    if cpu_kernel().lib is None:
        raise SystemExit(f"the CPU kernel is not built: {cpu_kernel().reason}")
    if (args.out / "cpu_gemv_bench.json").exists():
        raise SystemExit(f"{args.out / 'cpu_gemv_bench.json'} exists; records are never overwritten: pick a new --out")
    torch.set_num_threads(args.threads)
    rows = []
    for (model, site), (K, N) in SHAPES.items():
        for dname, dtype in DTYPES.items():
            for keep in KEEPS:
                for r in bench_cell(K, N, dtype, keep, args):
                    rows.append({"model": model, "site": site, **r})
                    print(f"{model:20s} {site:8s} {dname:9s} keep {keep:<4g} {r['impl']:13s} "
                          f"{r['us']:9.1f} us {r['gb_s']:6.1f} GB/s", flush=True)
    rec = stamp({"kind": "cpu_gemv_bench", "threads": args.threads, "span_mb": args.span_mb, "calls": args.calls,
                 "rounds": args.rounds, "library": str(cpu_kernel().path), "rows": rows})
    write_record(args.out / "cpu_gemv_bench.json", rec)


if __name__ == "__main__":
    main()
