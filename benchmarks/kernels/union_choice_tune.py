"""Where the CPU union kernel stops paying (issue 44 item 3; ByteCross §3.3, App. F).

For a decode batch of B tokens a sparse projection may read the union of their kept rows once
(`sparse_gemv_union_cpu`, time growing with the union) or run one GEMM of the masked tokens
(F.linear, every row read, time flat in the union). For each B this measures both on the seven
projection shapes of a model at union fractions 0.1 .. 1.0 (each token keeping its own random
half of a union of that size), sums the shapes weighted by their calls per layer, and records
the largest union at which the union kernel is still the faster: `max_union`. A per-call choice
made from this table lost in the whole step and was deleted (docs/kernels/union_gemv.md#cpu-choice);
the tuner stays to measure the kernel-level crossover again (e.g. on another CPU).

    PYTHONPATH=src python benchmarks/kernels/union_choice_tune.py --threads 2 \\
        --out benchmarks/records/cpu/kernels/union_choice [--table FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sparsedecode.kernels.cpu_gemv import sparse_gemv_union_cpu
from sparsedecode.records import stamp, write_record

UNIONS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def shapes(model: str) -> list[tuple[str, int, int]]:
    """(site, K, N) of one layer's seven projections."""
    from sparsedecode.account.dims import ModelDims
    from sparsedecode.account.known import known_model

    d = ModelDims.from_config(known_model(model).config, model)
    return [("q", d.d, d.q_width), ("k", d.d, d.kv_width), ("v", d.d, d.kv_width), ("o", d.q_width, d.d),
            ("gate", d.d, d.d_ff), ("up", d.d, d.d_ff), ("down", d.d_ff, d.d)]


def batch_at(B: int, K: int, u: float, gen: torch.Generator) -> torch.Tensor:
    """x (B, K): the union of kept channels (|x| > 1) is round(u K) channels, each token keeping a
    random half of them (at least one), the other channels below the threshold."""
    x = torch.rand(B, K, generator=gen) * 0.5  # below the threshold 1.0
    n = max(1, round(u * K))
    union = torch.randperm(K, generator=gen)[:n]
    keep = torch.rand(B, n, generator=gen) < 0.5
    keep[torch.randint(0, B, (n,), generator=gen), torch.arange(n)] = True  # every union channel kept by someone
    x[:, union] = torch.where(keep, 2.0, x[:, union])
    return x


def ms(f, reps: int) -> float:
    f()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", type=int, nargs="+", default=[2, 3, 4, 6, 8, 12, 16])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", type=Path, required=True, help="folder for the record")
    ap.add_argument("--table", type=Path, help="write the tuned table here too")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    sites = shapes(a.model)
    weights = {(K, N): torch.randn(K, N, generator=gen) for _, K, N in sites}
    rows, table = [], []
    for B in a.batches:
        per_u = {}
        for u in UNIONS:
            t_union = t_gemm = 0.0
            for _, K, N in sites:
                w = weights[(K, N)]
                x = batch_at(B, K, u, gen)
                t_union += ms(lambda x=x, w=w: sparse_gemv_union_cpu(x, w, 1.0), a.reps)
                t_gemm += ms(lambda x=x, w=w: F.linear(torch.where(x.abs() > 1.0, x, 0.0), w.t()), a.reps)
            per_u[u] = (t_union, t_gemm)
            rows.append({"batch": B, "union": u, "union_kernel_ms": t_union, "masked_gemm_ms": t_gemm})
        wins = [u for u, (tu, tg) in per_u.items() if tu < tg]
        best = max(wins) if wins else 0.0
        table.append({"B": B, "max_union": best})
        print(f"B={B:>3}: union kernel faster up to u = {best:g}  "
              + "  ".join(f"{u:g}:{tu:.2f}/{tg:.2f}" for u, (tu, tg) in per_u.items()), flush=True)
    rec = stamp({"kind": "union_choice_tune", "model": a.model, "label": "CPU", "threads": a.threads,
                 "shapes": sites, "rows": rows, "table": table,
                 "protocol": f"median of {a.reps} calls after one, per shape, summed over one layer's seven projections",
                 "command": "PYTHONPATH=src python benchmarks/kernels/union_choice_tune.py " + " ".join(
                     f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(a).items()
                     if v is not None)})
    when = rec["timestamp"].replace(":", "").replace("-", "")[:15]
    path = write_record(a.out / f"union_choice_{a.model}_cpu{a.threads}t_{when}.json", rec)
    print(path)
    if a.table is not None:
        a.table.write_text(json.dumps({
            "device": "CPU", "threads": a.threads,
            "source": f"{path.relative_to(Path.cwd()) if path.is_absolute() else path}: benchmarks/kernels/"
                      f"union_choice_tune.py on {a.model}'s projection shapes; the largest union at which the union "
                      "kernel beat the masked GEMM, per B (docs/kernels/union_gemv.md#cpu-choice)",
            "rows": table}, indent=1) + "\n")
        print(a.table)


if __name__ == "__main__":
    main()
