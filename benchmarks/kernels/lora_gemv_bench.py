"""What an unmerged LoRA adapter costs a sparse decode projection (SATS paper §4.2; issue 45 item 3).

Llama-3.1-8B projection shapes and the widths of its fused q|k|v and gate|up launches, one token, rank `--rank` (16), bf16 (`--dtype`), at keeps 0.3, 0.5,
0.7 and 1.0 (x random normal, the threshold its |x| quantile: the kept count is exact). Four ways
to compute one adapter site, each checked against `lora_gemv_ref` first:
- `base`: the sparse GEMV alone (no adapter): the floor;
- `fused`: the adapter in the base launch (`kernels.lora_gemv`; CPU: `sparse_gemv_lora_cpu`);
- `separate`: three launches of the same sparse GEMV, base, shrink u = A x_m over A^T's kept rows,
  and expand s B u with the residual add into the base output (CPU: three C calls and an add);
- `merged`: the base GEMV over the merged weight W + s B A (same bytes as `base`, no adapter).
On CUDA each variant is `--calls` calls over distinct weight copies spanning `--span-mb` MiB (a
copy is revisited after the others flushed the L2) captured in one CUDA graph, `--reps` replays,
the median per call; on CPU the copies are called round-robin, the variants interleaved round by
round (`--rounds`), the median per call. The adapter's own bytes are its kept rows of A^T plus all
of B^T (kept * r + r * N elements); each row sets the extra time of `fused` and `separate` over
`base` beside the time those bytes take at the measured ceiling (`--ceiling`, a `sparsedecode
bench ceiling` record of the same machine, else measured here), so a fused adapter at its byte
time costs what its bytes cost and no more. Decisions: docs/kernels/lora_gemv.md.

    PYTHONPATH=src python3 benchmarks/kernels/lora_gemv_bench.py --out R.json [--ceiling C.json] [--device cpu]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch

from sparsedecode.kernels.cpu_gemv import cpu_kernel, sparse_gemv_cpu, sparse_gemv_lora_cpu
from sparsedecode.kernels.lora_gemv import lora_gemv, lora_gemv_ref, lora_workspace
from sparsedecode.kernels.sparse_gemv import sparse_gemv, workspace
from sparsedecode.records import stamp, write_record

SHAPES = {"q|o": (4096, 4096), "gate|up": (4096, 14336), "down": (14336, 4096), "k|v": (4096, 1024),  # (in, out)
          # the fused launches a step makes (`SparseConcat`: q|k|v, gate|up), one adapter of their width: the
          # grid a step launches (more tiles, fewer splits, another register cap), which the sites' shapes miss
          "qkv": (4096, 6144), "gateup": (4096, 28672)}
KEEPS = (0.3, 0.5, 0.7, 1.0)
VARIANTS = ("base", "fused", "separate", "merged")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SCALE = 2.0  # alpha / r of a common adapter (alpha = 2r); the value does not change the time


def copy_of(K, N, r, dtype, dev, gen):
    """One weight copy: w_t (K, N), the adapter's a_t (K, r), b_t (r, N), s * b_t, the merged weight."""
    w_t = torch.randn(K, N, device=dev, generator=gen).div_(math.sqrt(K)).to(dtype)
    a_t = torch.randn(K, r, device=dev, generator=gen).div_(math.sqrt(K)).to(dtype)
    b_t = torch.randn(r, N, device=dev, generator=gen).div_(math.sqrt(r)).to(dtype)
    merged = (w_t.float() + SCALE * (a_t.float() @ b_t.float())).to(dtype)
    return {"w_t": w_t, "a_t": a_t, "b_t": b_t, "sb_t": (SCALE * b_t.float()).to(dtype), "merged": merged}


def cuda_calls(x, t, K, N, r):
    """variant -> call(copy) on CUDA; each variant holds its persistent workspaces, as a module does."""
    ws, ws_l, ws_a, ws_b = workspace(N, x.device), lora_workspace(N, r, x.device), workspace(r, x.device), \
        workspace(N, x.device)

    def separate(c):
        y = sparse_gemv(x, c["w_t"], t, ws=ws)
        shrunk = sparse_gemv(x, c["a_t"], t, ws=ws_a)  # (1, r): A's kept rows
        return sparse_gemv(shrunk, c["sb_t"], -math.inf, ws=ws_b, residual=y)[0]

    return {"base": lambda c: sparse_gemv(x, c["w_t"], t, ws=ws),
            "fused": lambda c: lora_gemv(x, c["w_t"], t, c["a_t"], c["b_t"], SCALE, ws=ws_l),
            "separate": separate,
            "merged": lambda c: sparse_gemv(x, c["merged"], t, ws=ws)}


def cpu_calls(x, t, K, N, r):
    """variant -> call(copy) on CPU (kernels/cpu_gemv.c)."""
    def separate(c):
        y = sparse_gemv_cpu(x, c["w_t"], t)
        return y + sparse_gemv_cpu(sparse_gemv_cpu(x, c["a_t"], t), c["sb_t"], -math.inf)

    return {"base": lambda c: sparse_gemv_cpu(x, c["w_t"], t),
            "fused": lambda c: sparse_gemv_lora_cpu(x, c["w_t"], t, c["a_t"], c["b_t"], SCALE),
            "separate": separate,
            "merged": lambda c: sparse_gemv_cpu(x, c["merged"], t)}


def timed_cuda(fn, copies, calls, reps) -> float:
    from sparsedecode.timing.clock import time_graph

    def run():
        for i in range(calls):
            fn(copies[i % len(copies)])
    return statistics.median(time_graph(run, reps, warmup=2, per_replay=calls))


def timed_cpu(fns: dict, copies, calls, rounds) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for i in range(calls):
                fn(copies[i % len(copies)])
            times[name].append((time.perf_counter() - t0) / calls)
    return {name: statistics.median(ts) for name, ts in times.items()}


def ceiling_gbps(a, dev) -> tuple[float, str]:
    if a.ceiling is not None:
        from sparsedecode.timing.ceiling import read_ceiling

        return read_ceiling(a.ceiling)["gbps"], Path(a.ceiling).name
    from sparsedecode.timing.ceiling import measure_ceiling

    cpu = dev.type == "cpu"  # float32 there: a CPU without bf16 GEMV hardware widens in compute, not memory
    rec = measure_ceiling(dev.type, "float32" if cpu else a.dtype, gib=0.25 if cpu else 1.0, replays=5 if cpu else 20,
                          calls=4 if cpu else 10, shared_gpu="allow")
    return rec["gbps"], f"measured here: {rec['method']}"


def bench_cell(name, K, N, keep, a, dev, dtype, ceiling) -> dict:
    r, elem = a.rank, torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator(device=dev).manual_seed(K * 7 + N)
    x = torch.randn(1, K, device=dev, generator=gen).to(dtype)
    t_host = -math.inf if keep >= 1.0 else float(x.float().abs().quantile(1.0 - keep))
    kept = int((x.float().abs() > t_host).sum())
    per_copy = (2 * K * N + K * r + 2 * r * N) * elem
    copies = [copy_of(K, N, r, dtype, dev, gen) for _ in range(max(2, -(-a.span_mb * 2**20 // per_copy)))]
    t = torch.tensor(t_host, device=dev) if dev.type == "cuda" else t_host  # on the device, as a module holds it
    fns = (cuda_calls if dev.type == "cuda" else cpu_calls)(x, t, K, N, r)
    c = copies[0]
    want = lora_gemv_ref(x, c["w_t"], t_host, c["a_t"], c["b_t"], SCALE).float()
    for v in ("fused", "separate", "merged"):  # base has no adapter: nothing to compare
        err = (fns[v](c).float() - want).abs().max().item()
        if err > 2e-2 * max(1.0, want.abs().max().item()):
            raise SystemExit(f"{v} disagrees with lora_gemv_ref at {name} keep={keep}: {err}")
    if dev.type == "cuda":
        sec = {v: timed_cuda(fns[v], copies, a.calls, a.reps) for v in VARIANTS}
    else:
        sec = timed_cpu(fns, copies, a.calls, a.rounds)
    base_bytes, lora_bytes = kept * N * elem, (kept * r + r * N) * elem
    us = {v: s * 1e6 for v, s in sec.items()}
    return {"shape": name, "K": K, "N": N, "rank": r, "keep": keep, "kept_rows": kept, "copies": len(copies),
            "us": us, "base_bytes": base_bytes, "adapter_bytes": lora_bytes,
            "base_pct_of_ceiling": 100 * base_bytes / sec["base"] / 1e9 / ceiling,
            "adapter_bytes_us": lora_bytes / (ceiling * 1e9) * 1e6,
            "fused_extra_us": us["fused"] - us["base"], "separate_extra_us": us["separate"] - us["base"],
            "merged_extra_us": us["merged"] - us["base"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="the record (never overwritten)")
    ap.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda where there is one)")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"some of {', '.join(SHAPES)}")
    ap.add_argument("--keeps", default=",".join(map(str, KEEPS)))
    ap.add_argument("--ceiling", help="a `sparsedecode bench ceiling` record of this machine (else measured here)")
    ap.add_argument("--span-mb", type=int, default=256, help="the weight copies of a cell span this many MiB")
    ap.add_argument("--calls", type=int, default=None, help="calls per graph replay (CUDA, 40) or round (CPU, 4)")
    ap.add_argument("--reps", type=int, default=30, help="CUDA graph replays")
    ap.add_argument("--rounds", type=int, default=5, help="CPU rounds")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    a = ap.parse_args()
    if a.out.exists():
        raise SystemExit(f"{a.out} exists; records are never overwritten: pick a new --out")
    dev = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else
                       "cpu" if a.device == "auto" else a.device)
    if dev.type == "cpu":
        if cpu_kernel().lib is None:
            raise SystemExit(f"the CPU kernel is not built: {cpu_kernel().reason}")
        if a.threads:
            torch.set_num_threads(a.threads)
    a.calls = a.calls or (40 if dev.type == "cuda" else 4)
    dtype = DTYPES[a.dtype]
    ceiling, source = ceiling_gbps(a, dev)
    print(f"ceiling {ceiling:.0f} GB/s ({source})", flush=True)
    rows = []
    for name in a.shapes.split(","):
        K, N = SHAPES[name]
        for keep in (float(k) for k in a.keeps.split(",")):
            row = bench_cell(name, K, N, keep, a, dev, dtype, ceiling)
            rows.append(row)
            us = row["us"]
            print(f"{name:8s} {K:5d}x{N:<5d} keep {keep:<4g} base {us['base']:8.1f} us ({row['base_pct_of_ceiling']:3.0f}% "
                  f"of ceiling) | fused +{row['fused_extra_us']:6.2f} | separate +{row['separate_extra_us']:6.2f} | "
                  f"merged +{row['merged_extra_us']:6.2f} us | adapter bytes {row['adapter_bytes'] / 1e3:6.1f} KB = "
                  f"{row['adapter_bytes_us']:5.2f} us at the ceiling", flush=True)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    write_record(a.out, stamp({"kind": "lora_gemv_bench", "device": dev.type, "gpu": gpu, "dtype": a.dtype,
                               "rank": a.rank, "scale": SCALE, "ceiling_gbps": ceiling, "ceiling_source": source,
                               "calls": a.calls, "reps": a.reps, "rounds": a.rounds, "span_mb": a.span_mb,
                               "threads": torch.get_num_threads() if dev.type == "cpu" else None, "rows": rows}))


if __name__ == "__main__":
    main()
