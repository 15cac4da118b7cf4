"""Input-sparse GEMV against its byte time on one GPU (ByteCross §3.2, §4.1, App. A).

Llama-3.1-8B MLP shapes in bf16, one token: gate/up (K=4096 in, N=14336 out) and
down (K=14336, N=4096), at keeps 1.0, 0.5 and 0.3. x is random normal and the
threshold is the |x| quantile, so the kept channel count is exact. Each cell
captures `--copies` distinct weight copies x `--rounds` calls in one CUDA graph
(a copy is revisited only after the others have flushed the 50 MB L2), times
`--reps` replays with CUDA events and takes the median per call. Calls launch with the kernel
options of `--kernels` (default `GemvOptions()`: as programmatic dependents, each call's launch
overlapping the tail of the call before; `--kernels gemv.pdl=false` times them one after
another), recorded per cell under 'kernels'.

Bytes read are what the kernel must read: kept rows * N * 2 + the K * 2 bytes of
x. The byte time is bytes / 4.15 TB/s (the H200's measured streaming rate, as
in the attention benchmark); the target is time <= 1.15x byte time at keeps 0.5
and 0.3. Dense F.linear (x @ W^T with W (N, K), cuBLAS's GEMV) at the same shape
is timed the same way for comparison.

  PYTHONPATH=src python3 benchmarks/kernels/sparse_gemv_bench.py --out DIR [--sweep] [--choose FILE]

Writes one record per cell of kind 'sparse_gemv_bench' into DIR (sweep cells into
DIR/sweep) and all of them as one JSON list in DIR/sparse_gemv_records.json. `--choose`
writes the fastest config per shape as a tuned file (src/sparsedecode/kernels/tuned/<device>.json).
Decisions and their records: docs/kernels/sparse_gemv.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from sparsedecode.kernels import common
from sparsedecode.kernels import sparse_gemv as sg
from sparsedecode.kernels.options import KernelOptions, option_names
from sparsedecode.models.decoder import rms_norm
from sparsedecode.records import stamp, write_record
from sparsedecode.timing.clock import time_graph

# name: (K in, N out). The default two are the issue's; q_o and kv are the attention projections
# the decode step also runs sparse, and qkv / gate_up2 the concatenated (fused) weights.
SHAPES = {"gate_up": (4096, 14336), "down": (14336, 4096), "q_o": (4096, 4096), "kv": (4096, 1024),
          "qkv": (4096, 6144), "gate_up2": (4096, 28672)}
DEFAULT_SHAPES = ("gate_up", "down")
KEEPS = (1.0, 0.5, 0.3)
BYTE_RATE = 4.15e12  # B/s: the H200 streaming rate the target is set against
TARGET = 1.15
# Tile configs tried by --sweep beside the default: (BLOCK_N, BLOCK_K, split size, num_warps,
# num_stages), the split size either 'pN' (splits for about N programs per SM) or 'rN' (N rows
# per split; r == BLOCK_K is one tile per program, more rows loop, pipelined when stages > 1).
# The loops that lost are removed from the kernel and their entries from here
# (docs/kernels/sparse_gemv.md#stages); the neighbourhood of the default stays.
SWEEP = [(256, 16, "p16", 1, 1), (256, 16, "p32", 1, 1), (256, 32, "p12", 1, 1), (512, 16, "p16", 2, 1),
         (256, 8, "p32", 1, 1), (256, 8, "p48", 1, 1), (256, 8, "p64", 1, 1), (512, 8, "p24", 1, 1),
         # stages 4: two tiles' weight loads in flight per warp
         (256, 16, "p24", 1, 4), (256, 16, "p16", 1, 4), (256, 16, "p32", 1, 4), (256, 8, "p24", 1, 4),
         (256, 8, "p32", 1, 4), (256, 8, "p48", 1, 4), (256, 32, "p12", 1, 4), (512, 16, "p24", 2, 4),
         (256, 16, "p12", 1, 4), (256, 16, "p8", 1, 4), (256, 16, "p24", 1, 1), (256, 16, "p64", 1, 4),
         (256, 4, "p24", 1, 4), (256, 4, "p32", 1, 4)]
COMBINED = "sparse_gemv_records.json"


def add_cell_args(ap: argparse.ArgumentParser) -> None:
    """The cells and the timing protocol (this benchmark's and read_floor_bench.py's)."""
    ap.add_argument("--out", type=Path, required=True, help="folder for the JSON records")
    ap.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), choices=list(SHAPES))
    ap.add_argument("--keeps", type=float, nargs="+", default=list(KEEPS))
    ap.add_argument("--copies", type=int, default=4, help="distinct weight copies per graph (beat the L2)")
    ap.add_argument("--rounds", type=int, default=8, help="calls per copy and graph")
    ap.add_argument("--reps", type=int, default=50)


def cell_input(K: int, dev: torch.device) -> tuple[torch.Tensor, torch.Generator]:
    """A cell's x (1, K) in bf16, random normal seeded by K, and the generator its weights are
    drawn from next (read_floor_bench.py draws the same x to read the same bytes)."""
    gen = torch.Generator(device=dev).manual_seed(K)
    return torch.randn(1, K, device=dev, dtype=torch.bfloat16, generator=gen), gen


def quantile_threshold(v: torch.Tensor, keep: float) -> float:
    """The |v| quantile that keeps `keep` of its channels (0.0 at keep 1: every channel)."""
    return 0.0 if keep >= 1.0 else float(v.float().abs().quantile(1.0 - keep))


def time_calls(fn, args_list, reps: int) -> list[float]:
    """Per-call seconds of `reps` replays of one graph that calls fn(*args) for each args."""
    def calls():
        for a in args_list:
            fn(*a)
    return time_graph(calls, reps, warmup=3, per_replay=len(args_list))


def timing_fields(t: float, nbytes: int, t_dense: float, dense_bytes: int, err: float) -> dict:
    """The record fields of one timed cell: rate, ratio to byte time and target, dense peer."""
    byte_time = nbytes / BYTE_RATE
    return {"time_s": t, "bytes_read": nbytes, "tb_per_s": nbytes / t / 1e12,
            "byte_rate": BYTE_RATE, "byte_time_s": byte_time, "ratio_to_byte_time": t / byte_time,
            "target_ratio": TARGET, "meets_target": t / byte_time <= TARGET,
            "dense_time_s": t_dense, "dense_bytes": dense_bytes, "dense_tb_per_s": dense_bytes / t_dense / 1e12,
            "speedup_vs_dense": t_dense / t, "max_abs_err_vs_ref": err}


def sweep_config(K: int, N: int, block_n: int, block_k: int, size: str, warps: int, stages: int) -> tuple:
    """(BLOCK_N, BLOCK_K, splits, num_warps, num_stages) of one SWEEP entry at shape (K, N)."""
    if size[0] == "p":
        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        want = max(1, round(int(size[1:]) * sms / -(-N // block_n)))
    else:
        want = -(-K // int(size[1:]))
    return block_n, block_k, common.splits(K, block_k, want), warps, stages


def sweep_label(block_n: int, block_k: int, size: str, warps: int, stages: int) -> str:
    return f"b{block_n}k{block_k}{size}w{warps}s{stages}"


def parse_label(label: str) -> tuple:
    """The SWEEP entry (BLOCK_N, BLOCK_K, split size, num_warps, num_stages) a label names,
    e.g. 'b2048k16p2w8s4' (the inverse of `sweep_label`)."""
    m = re.fullmatch(r"b(\d+)k(\d+)([pr]\d+)w(\d+)s(\d+)", label)
    if m is None:
        raise argparse.ArgumentTypeError(
            f"config {label!r} is not a label like b2048k16p2w8s4 (BLOCK_N, BLOCK_K, p<programs per SM> or "
            "r<rows per split>, warps, stages)")
    return int(m[1]), int(m[2]), m[3], int(m[4]), int(m[5])


def choose(records: list[dict], keeps=(0.5, 0.3), fused: str | None = None) -> list[dict]:
    """Per shape, the config with the least summed time over `keeps` (the decode regime), among
    the calls of one kind (`fused`: None for the plain call, else a `fused_fn` kind): the rows
    of a tuned file (`sparse_gemv.read_tuned` reads K, N, dtype, sm_count and config)."""
    by_shape: dict[str, dict[str, float]] = {}
    first: dict[tuple[str, str], dict] = {}
    records = [r for r in records if r["kind"] == "sparse_gemv_bench" and r.get("fused") == fused]
    for r in records:
        if any(abs(r["keep_target"] - k) < 1e-9 for k in keeps):
            cell = by_shape.setdefault(r["shape"], {})
            cell[r["config_label"]] = cell.get(r["config_label"], 0.0) + r["time_s"]
            first.setdefault((r["shape"], r["config_label"]), r)
    out = []
    for shape, times in by_shape.items():
        n_keeps = {lab: sum(1 for r in records if r["shape"] == shape and r["config_label"] == lab
                            and any(abs(r["keep_target"] - k) < 1e-9 for k in keeps)) for lab in times}
        full = [lab for lab in times if n_keeps[lab] == len(keeps)]  # configs that ran at every keep
        best = min(full, key=times.get)
        r = first[(shape, best)]
        c = r["config"]
        out.append({"K": r["K"], "N": r["N"], "dtype": r["dtype"], "sm_count": r["sm_count"],
                    "config": [c["block_n"], c["block_k"], c["splits"], c["num_warps"], c["num_stages"]],
                    "shape": shape, "label": best, "summed_time_s": times[best], "keeps": list(keeps)})
    return out


def tuned_file_json(rows: list[dict], device: str, source: str) -> dict:
    """A tuned file (kernels/tuned/<device>.json) of `choose`'s rows, naming the records they came from."""
    return {"device": device, "source": f"{source}: sparse_gemv_bench.py --choose, the fastest config per shape "
                                        "summed over keeps 0.5 and 0.3", "rows": rows}


# How the fused decoder layer calls each shape (docs/kernels/sparse_gemv.md#fuse-norms, #fuse-swiglu).
FUSED_KINDS = ("residual", "norm", "glu+residual")


def fused_fn(kind: str | None, residual, norm, up=None, options=KernelOptions().gemv):
    """sparse_gemv as the bench calls it, with `options`: plain, with residual= (its new stream
    only), norm=, or up= and residual= (down forming silu(gate) * up in its load as it adds the
    residual)."""
    kw = dict(options=options)
    if kind == "residual":
        return lambda x, w, t, b, ws, cfg: sg.sparse_gemv(x, w, t, b, ws, cfg, residual=residual, **kw)[0]
    if kind == "norm":
        return lambda x, w, t, b, ws, cfg: sg.sparse_gemv(x, w, t, b, ws, cfg, norm=norm, **kw)
    if kind == "glu+residual":
        return lambda x, w, t, b, ws, cfg: sg.sparse_gemv(x, w, t, b, ws, cfg, up=up, residual=residual, **kw)[0]
    return lambda x, w, t, b, ws, cfg: sg.sparse_gemv(x, w, t, b, ws, cfg, **kw)


def kernel_input(kind: str | None, x, norm, up):
    """The input the threshold of a call of `kind` applies to: x, its RMSNorm, or silu(x) * up."""
    if kind == "norm":
        return rms_norm(x, norm[0], norm[2])
    if kind == "glu+residual":
        return F.silu(x) * up
    return x


def check(x, w_t, thr, ws, config, what: str, fused: str | None = None, residual=None, norm=None,
          up=None, options=KernelOptions().gemv) -> float:
    """Max error of the kernel against the masked reference; raises when any element is off.
    fused: a `fused_fn` kind, checked against the reference of its math."""
    got = fused_fn(fused, residual, norm, up, options)(x, w_t, thr, None, ws, config).float()
    want = sg.sparse_gemv_ref(kernel_input(fused, x, norm, up), w_t, thr)
    want = (want + residual if fused in ("residual", "glu+residual") else want).float()
    err = (got - want).abs()
    tol = 2 * 2.0**-8 * want.abs().max().item() + 1e-3  # two bf16 ulps of the largest output
    bad = int((err > tol).sum())
    if bad:
        worst = int(err.argmax())
        raise AssertionError(f"{what}: {bad} of {err.numel()} outputs off by > {tol:.3g} (max "
                             f"{err.max().item():.3g} at {worst}: got {got.flatten()[worst].item():.5g}, "
                             f"want {want.flatten()[worst].item():.5g})")
    return err.max().item()


def even_input(K: int, keep: float, dev, dtype, gen) -> tuple[torch.Tensor, float]:
    """(x (1, K), threshold) whose kept channels are spread evenly: channel i is kept when
    floor((i + 1) x keep) > floor(i x keep), so every split of r rows keeps r x keep +- 1
    (random x keeps a binomial count per split, and the fullest split sets the kernel's tail)."""
    i = torch.arange(K, device=dev, dtype=torch.float64)
    kept = torch.floor((i + 1) * keep) > torch.floor(i * keep)  # (K,)
    mag = torch.rand(K, device=dev, generator=gen, dtype=torch.float32)
    sign = torch.where(torch.rand(K, device=dev, generator=gen) < 0.5, -1.0, 1.0)
    x = torch.where(kept, 1.0 + mag, 0.25 * mag) * sign  # kept in [1, 2), dropped below 0.25
    return x.to(dtype)[None], 0.5


def launch_probe(name: str, args, dev: torch.device, run: str, cfg: tuple | None = None, label: str = "default",
                 timer=time_calls) -> dict:
    """Per-call time of a kernel that does nothing on a config's grid (the default config's when
    cfg is None) with its warps: what any launch of that grid costs in the graph, whatever its
    bytes (the fixed cost)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _noop(Y, n):
        if tl.program_id(0) + tl.program_id(1) == n:  # never true: a store the compiler keeps
            tl.store(Y, 1.0)

    K, N = SHAPES[name]
    block_n, block_k, splits, warps, stages = cfg or sg.default_config(K, N, torch.bfloat16, dev,
                                                                       args.gemv.programs_per_sm)
    grid = (-(-N // block_n), splits)
    y = torch.zeros(1, device=dev)

    def call(y):
        _noop[grid](y, -1, num_warps=warps, **({"launch_pdl": True} if args.gemv.pdl else {}))

    t = statistics.median(timer(call, [(y,)] * (args.copies * args.rounds), args.reps))
    rec = stamp({"kind": "launch_probe", "shape": name, "K": K, "N": N, "config_label": label,
                 "grid": list(grid), "num_warps": warps, "pdl": args.pdl, "time_s": t, "copies": args.copies,
                 "rounds": args.rounds, "reps": args.reps, "graph": True})
    write_record(args.out / f"launch_probe-{name}-{label}-pdl{args.pdl}-{run}.json", rec)
    print(f"{name:8s} {label:14s} empty kernel on grid {grid[0]}x{grid[1]} ({warps} warp{'s' * (warps > 1)}"
          f", PDL {args.pdl}): {t * 1e6:.2f} us per call", flush=True)
    return rec


def dense_equivalent(kept: int, N: int, args, dev: torch.device, timer=time_calls) -> float:
    """Per-call time of cuBLAS's dense GEMV over a weight of just the kept rows ((N, kept) in
    nn.Linear's layout): the same bytes as the sparse call, read by the dense library kernel.
    What the sparse kernel's time is measured against when the byte time is out of reach of
    any single launch at that size."""
    gen = torch.Generator(device=dev).manual_seed(kept)
    x = torch.randn(1, kept, device=dev, dtype=torch.bfloat16, generator=gen)
    ws = [torch.randn(N, kept, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(args.copies)]
    t = statistics.median(timer(F.linear, [(x, w) for w in ws] * args.rounds, args.reps))
    del ws
    return t


def bench_shape(name: str, args, dev: torch.device, run: str, timer=time_calls) -> tuple[list, list]:
    """Records and table rows of one shape: dense once, then every keep x config."""
    dtype = torch.bfloat16
    records, rows = [], []
    K, N = SHAPES[name]
    x, gen = cell_input(K, dev)  # (1, K): one token
    w_ts = [torch.randn(K, N, device=dev, dtype=dtype, generator=gen) for _ in range(args.copies)]  # (K, N)
    ws = sg.workspace(N, dev)
    dense_ws = [w.t().contiguous() for w in w_ts]  # (N, K): nn.Linear's layout, as cuBLAS runs it
    t_dense = statistics.median(timer(F.linear, [(x, w) for w in dense_ws] * args.rounds, args.reps))
    del dense_ws
    dense_bytes = K * N * 2 + K * 2
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    default = args.tuned.get((K, N, "bfloat16", sms)) or sg.default_config(K, N, dtype, dev, args.gemv.programs_per_sm)
    variants = [("default", default, None)]
    if args.sweep:
        variants += [(sweep_label(*c), sweep_config(K, N, *c), None) for c in SWEEP
                     if args.sweep_stages is None or c[4] in args.sweep_stages]
    variants += [(sweep_label(*c), sweep_config(K, N, *c), None) for c in args.configs]
    if args.probe:  # an empty kernel on each config's grid: what launching that grid costs
        records += [launch_probe(name, args, dev, run, cfg, label) for label, cfg, fused in variants if fused is None]
    if args.fused:  # the default config as the fused decoder layer calls it
        variants += [("default+residual", default, "residual"), ("default+norm", default, "norm")]
    if args.fused_sweep:  # every swept config (and the default) called as the fused layer calls it
        kind = args.fused_sweep
        variants = [v for v in variants if v[2] is None and v[0] == "default"] + [
            (f"{label}+{kind}", cfg, kind) for label, cfg, fused in variants if fused is None]
    residual = torch.randn(1, N, device=dev, dtype=dtype, generator=gen)  # (1, N): the stream o / down add to
    norm_w = (1.0 + 0.1 * torch.randn(K, device=dev, generator=gen)).to(dtype)  # (K,): an RMSNorm weight
    up = torch.randn(1, K, device=dev, dtype=dtype, generator=gen)  # (1, K): SwiGLU's up, x being the gate
    for keep in args.keeps:
        if args.pattern == "even" and keep < 1.0:
            x, t_val = even_input(K, keep, dev, dtype, gen)
        else:
            t_val = quantile_threshold(x, keep)
        norm = (norm_w, sg.sumsq(x), 1e-5)  # x read as the residual stream its norm is taken of
        inputs = {kind: kernel_input(kind, x, norm, up) for kind in ("norm", "glu+residual")}
        t_kind = {kind: quantile_threshold(v, keep) for kind, v in inputs.items()}
        equiv = None
        for label, cfg, fused in variants:
            t_cell = t_kind.get(fused, t_val)
            thr = torch.tensor(t_cell, device=dev)
            kept = int((inputs.get(fused, x).float().abs() > thr).sum())
            nbytes = kept * N * 2 + K * 2
            byte_time = nbytes / BYTE_RATE
            if label == "default":
                equiv = dense_equivalent(kept, N, args, dev, timer) if 0 < kept < K else None
            try:
                calls = [(x, w, thr, None, ws, cfg) for w in w_ts] * args.rounds
                err = check(x, w_ts[0], thr, ws, cfg, f"{name} keep={keep} {label}", fused, residual, norm, up,
                            args.gemv)
                t = statistics.median(timer(fused_fn(fused, residual, norm, up, args.gemv), calls, args.reps))
            except Exception as e:  # a sweep config can fail to compile or fit; report and go on
                if label == "default":
                    raise
                print(f"{name} keep={keep} {label}: failed ({str(e).splitlines()[0]})", flush=True)
                continue
            block_n, block_k, splits, warps, stages = cfg
            rec = stamp({
                "kind": "sparse_gemv_bench", "shape": name, "K": K, "N": N, "dtype": "bfloat16",
                "keep_target": keep, "threshold": t_cell, "kept_rows": kept, "keep": kept / K,
                "pattern": args.pattern if keep < 1.0 else "all",
                "config_label": label, "fused": fused, "pdl": args.pdl, "kernels": args.kernels.to_dict(),
                "finish": common.finish_mode(warps),
                "config": {"block_n": block_n, "block_k": block_k, "splits": splits, "num_warps": warps,
                           "num_stages": stages, "programs": -(-N // block_n) * splits},
                "sm_count": sms,
                "copies": args.copies, "rounds": args.rounds, "reps": args.reps, "graph": True,
                **timing_fields(t, nbytes, t_dense, dense_bytes, err),
                **({} if equiv is None or fused else {"dense_equiv_time_s": equiv, "dense_equiv_shape": [kept, N],
                                                      "ratio_to_dense_equiv": t / equiv}),
            })
            sub = args.out if label == "default" else args.out / ("sweep" if label[:1] == "b" else "fused")
            write_record(sub / f"sparse_gemv_bench-{name}-keep{keep:g}-{label}-{run}.json", rec)
            records.append(rec)
            rows.append((name, keep, label, t * 1e6, rec["tb_per_s"], t / byte_time, t_dense / t))
            same = ("" if equiv is None or fused else
                    f"  {t / equiv:5.2f}x cuBLAS on the kept rows ({equiv * 1e6:.1f} us)")
            print(f"{name:8s} keep={keep:<4g} {label:14s} {t * 1e6:8.1f} us  {rec['tb_per_s']:5.2f} TB/s  "
                  f"{t / byte_time:5.2f}x byte time  {t_dense / t:5.2f}x vs dense "
                  f"({t_dense * 1e6:.1f} us){same}", flush=True)
    del w_ts
    torch.cuda.empty_cache()
    return records, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_cell_args(ap)
    ap.add_argument("--pattern", choices=("random", "even"), default="random",
                    help="kept channels: those of random normal x above its quantile, or spread evenly "
                    "(every split keeps the same count: no tail from the fullest split)")
    ap.add_argument("--sweep", action="store_true", help="also time the tile configs of SWEEP")
    ap.add_argument("--fused", action="store_true",
                    help="also time the default config with residual= and with norm= (the fused decoder "
                         "layer's calls), records under OUT/fused")
    ap.add_argument("--fused-sweep", choices=FUSED_KINDS,
                    help="time the default and every --sweep config as the fused decoder layer calls the shape "
                    "(residual: o and down; norm: q|k|v and gate|up; glu+residual: down forming silu(gate) * up); "
                    "--choose then picks among those calls")
    ap.add_argument("--sweep-stages", type=int, nargs="+", choices=sg.STAGES,
                    help="sweep only the SWEEP configs of these loop variants (1: plain, 4: two tiles in flight)")
    ap.add_argument("--configs", nargs="+", type=parse_label, default=[], metavar="LABEL",
                    help="also time these tile configs, labelled as the sweep labels them (b2048k16p2w8s4: "
                    "BLOCK_N 2048, BLOCK_K 16, about 2 programs per SM, 8 warps, stages 4)")
    ap.add_argument("--choose", type=Path,
                    help="write the fastest config per shape (keeps 0.5, 0.3) here as a tuned file; it goes to "
                    "src/sparsedecode/kernels/tuned/<device>.json (the device name with non-alphanumerics as "
                    "'_', e.g. NVIDIA_H200.json), where default_config reads it")
    ap.add_argument("--tuned", type=Path, help="a tuned file (--choose): its configs are timed as the defaults")
    ap.add_argument("--kernels", default="",
                    help="kernel options as KEY=VALUE,... (the GEMV's: gemv.pdl, gemv.programs_per_sm; "
                    f"all: {', '.join(option_names())}); recorded per cell")
    ap.add_argument("--probe", action="store_true",
                    help="also time an empty kernel on the grid of each shape's default and other configs "
                    "(the fixed cost of a launch)")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    if (args.out / COMBINED).exists():
        raise SystemExit(f"{args.out / COMBINED} exists; records are never overwritten: pick a new --out")
    dev = torch.device("cuda")
    args.kernels = KernelOptions.parse(args.kernels)
    args.gemv = args.kernels.gemv
    args.pdl = "early" if args.gemv.pdl else "off"  # the launch mode as records name it (trigger at the start)
    args.tuned = sg.read_tuned(args.tuned) if args.tuned else {}
    if args.tuned:
        print(f"{len(args.tuned)} tuned configs timed as the defaults")
    run = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    records, rows = [], []
    for name in args.shapes:
        recs, shape_rows = bench_shape(name, args, dev, run)
        records += recs
        rows += shape_rows
    write_record(args.out / COMBINED, records)
    if args.choose:
        chosen = choose(records, fused=args.fused_sweep)
        write_record(args.choose, tuned_file_json(chosen, torch.cuda.get_device_name(dev), str(args.out)))
        for c in chosen:
            print(f"chosen {c['shape']}: {c['label']} {c['config']}")
    print(f"\n{'shape':8s} {'keep':>5s} {'config':14s} {'us':>8s} {'TB/s':>6s} {'x byte':>7s} {'x dense':>8s}")
    for name, keep, label, us, tbs, ratio, speed in rows:
        print(f"{name:8s} {keep:5g} {label:14s} {us:8.1f} {tbs:6.2f} {ratio:7.2f} {speed:8.2f}")


if __name__ == "__main__":
    main()
