"""Decode step with the projection branch against dense, on one GPU (ByteCross §4.1-4.2, App. A).

llama-3.1-8b dims, random init (bytes per step do not depend on values), bf16,
batch 1. TEAL-style uniform thresholds are calibrated on the model's own
activations (random token ids, since a random model has no text), every one of
the seven projections of each layer then runs the input-sparse GEMV, and the
same compiled + captured step is timed dense and sparse in one process on the
same cache at the given context. The cache is filled by a dense prefill of
random token ids (`--fill prefill`, the default), so the attention output o reads
is the model's own and o is calibrated for it; `--fill random` (every run before
this flag) fills it with random normals instead, under which o's input is far
smaller than in calibration and o reads about 1.5% of its weight. The realized
keep (fraction of projection bytes actually read, measured on the decode step)
gives the byte bound of `sparsedecode account`; each record holds the speedup
beside it.

    PYTHONPATH=src python3 benchmarks/proj_decode_h200.py --out DIR [--keeps 0.5] [--context 2K]

Writes one record per mode into DIR and all of them as a list in DIR/proj_decode_records.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from dense_decode_h200 import summary, time_steps  # benchmarks/ is the script's folder
from sparse_gemv_bench import ABLATIONS, add_knob_args, apply_knobs, knob_flag

import sparsedecode
from sparsedecode.account import bounds, parse_tokens
from sparsedecode.kernels import decode_attention, knobs, override, rope_cache
from sparsedecode.kernels import sparse_gemv as sg
from sparsedecode.projection import sparse_linear
from sparsedecode.projection.calibrate import get_calibrator
from sparsedecode.projection.cats_runtime import cats_
from sparsedecode.projection.sparse_linear import (
    densify_,
    projection_call_bytes,
    realized_projection_keep,
    sparsify_,
)
from sparsedecode.records import stamp, write_record
from sparsedecode.report.speed_tables import kernel_group
from sparsedecode.timing.sites import call_sites


def profile_step(step, steps: int) -> dict:
    """Device time per step of each kernel over `steps` replays (PyTorch profiler, CUDA activity):
    rows sorted by time, their sum, and the kernel groups the decode step is made of. A kernel
    called several times a step also gets its call sites: the mean time of its i-th call of a
    step, in launch order (the sparse GEMV's 4 per layer are q|k|v, o, gate|up, down)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    launches: dict[str, list] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            launches.setdefault(e.name, []).append((e.time_range.start, e.device_time))
    rows = {name: [len(c), sum(us for _, us in c)] for name, c in launches.items()}
    table = sorted(([name, n / steps, us / steps] for name, (n, us) in rows.items()), key=lambda r: -r[2])
    sites = call_sites(launches, steps)

    groups: dict[str, float] = {}
    for name, _, us in table:
        groups[kernel_group(name)] = groups.get(kernel_group(name), 0.0) + us
    total = sum(us for _, _, us in table)
    for name, calls, us in table[:12]:
        print(f"    {us:9.1f} us/step  {calls:6.1f} calls  {name[:90]}", flush=True)
    print(f"    kernels {total:.1f} us/step: " + ", ".join(f"{g} {us:.1f}" for g, us in groups.items()), flush=True)
    return {"steps": steps, "kernel_us_per_step": total, "groups_us_per_step": groups,
            "kernels": [{"name": name, "calls_per_step": calls, "us_per_step": us} for name, calls, us in table],
            "sites_us": sites}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--context", default="2K")
    ap.add_argument("--keeps", default="0.5", help="comma list of projection keeps")
    ap.add_argument("--method", choices=["teal", "cats"], default="teal",
                    help="teal: all seven projections input-sparse (fused q|k|v, gate|up); cats: the MLP "
                         "channels with |SiLU(gate)| <= t dropped (row-gather up, sparse down)")
    ap.add_argument("--fill", choices=("prefill", "random"), default="prefill",
                    help="the cache the timed steps attend over: a dense prefill of random token ids (seeded; "
                         "the model's own keys and values) or random normals (the records before this flag)")
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--compile-mode", default="max-autotune-no-cudagraphs")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--gemv-configs", type=Path,
                    help="sparse GEMV tile configs from sparse_gemv_bench.py --choose (else the built-in ones)")
    add_knob_args(ap)
    ap.add_argument("--attn-min-split-keys", type=int,
                    help="fewest keys per split-K attention split (decode_attention.MIN_SPLIT_KEYS; default: "
                         "the module's)")
    knob_flag(ap, "--attn-fold-tail", "decode_attention.FOLD_TAIL",
              "fold a split-K attention tail of less than one block into the split before it")
    knob_flag(ap, "--rope-cache", "kernels.rope_cache.ENABLED",
              "the dense and sparse steps' RoPE and cache write as one launch per layer")
    knob_flag(ap, "--rope-attention", "kernels.decode_attention.ROPE_IN_ATTENTION",
              "the dense and sparse steps' RoPE, cache write and attention as one launch per layer")
    ap.add_argument("--pdl-trigger", choices=("early", "exit"),
                    help="where a sparse GEMV launched with PDL lets the next kernel launch: at its start "
                         "(early) or as its programs exit (sparse_gemv.PDL_TRIGGER; default: the module's)")
    knob_flag(ap, "--attn-pdl", "decode_attention.PDL", "launch the split-K attention as a programmatic "
              "dependent (the sparse GEMVs' PDL is the 'pdl' variant)")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="also run STEPS replays under the PyTorch profiler and keep each kernel's device time "
                         "per step in the record (where the step's time goes)")
    ap.add_argument("--variants", default="default",
                    help="comma list of sparse-step variants to time after one calibration: 'default' (the "
                         "module defaults), 'plain' (none of the following), or a '+'-joined set of 'pdl' "
                         "(programmatic dependent launch of the sparse GEMVs), 'swiglu' (silu(gate) * up formed "
                         "in down's input load) and 'norms' (the RMSNorms and residual adds inside the sparse "
                         "GEMVs, sparse_linear.FUSE_NORMS), e.g. 'pdl+norms'")
    ap.add_argument("--ablate", nargs="+", choices=("x", "x+reds", "both"), default=[],
                    help="also time each variant with every sparse GEMV ablated (sparse_gemv.ABLATE; wrong by "
                    "design, timed only): 'x', rows kept by parity (keep 0.5) with no x or threshold loads; "
                    "'x+reds', that and the split-K finish's atomic adds alone (no arrival count, exchange or "
                    "output); 'both', that and no finish at all. Every sparse call then runs stages 4 (the "
                    "built-in TUNED configs set aside), so they differ only in the finish")
    a = ap.parse_args()
    if a.ablate and a.method != "teal":
        raise SystemExit("--ablate applies to the teal step's sparse GEMVs; --method cats runs other kernels")
    variants = a.variants.split(",")
    bad = [v for v in variants if v not in ("default", "plain")
           and not set(v.split("+")) <= {"pdl", "swiglu", "norms"}]
    if bad:
        raise SystemExit(f"--variants: unknown {bad}; pick default, plain, or a '+'-joined set of pdl, swiglu "
                         "and norms")
    settings = apply_knobs(a)
    settings |= override(decode_attention, MIN_SPLIT_KEYS=a.attn_min_split_keys, FOLD_TAIL=a.attn_fold_tail)
    attn_pdl = override(decode_attention, PDL=a.attn_pdl)["PDL"]
    trigger = override(sg, PDL_TRIGGER=None if a.pdl_trigger is None else a.pdl_trigger == "early")["PDL_TRIGGER"]
    rope_one_launch = override(rope_cache, ENABLED=a.rope_cache)["ENABLED"]
    rope_in_attention = override(decode_attention, ROPE_IN_ATTENTION=a.rope_attention)["ROPE_IN_ATTENTION"]
    if a.gemv_configs:
        print(f"{sg.load_tuned(a.gemv_configs)} tuned sparse GEMV configs from {a.gemv_configs}")
    n = parse_tokens(a.context)
    keeps = [float(k) for k in a.keeps.split(",")]
    if a.method == "cats" and len(keeps) > 1:
        raise SystemExit("--method cats replaces the MLP modules for good: time one keep per run")
    run_id = time.strftime("%Y%m%dT%H%M%S")
    records = []

    t0 = time.perf_counter()
    eng = sparsedecode.load(a.model, device="cuda", dtype="bfloat16", init="random",
                            max_len=max(n, a.calib_tokens) + a.new, compile=a.compile_mode or True)
    dims = eng.dims
    ids = torch.randint(0, dims.vocab, (a.calib_tokens,), generator=torch.Generator().manual_seed(0))
    base = {"kind": "proj_decode_bench", "model": {"name": a.model, "dims": dims.to_dict(),
            "init": "random"}, "dtype": "bfloat16", "batch": 1, "context": n,
            "compile_mode": a.compile_mode, "attention": eng.attention, "run_id": run_id,
            "fill": a.fill, "calibration": {"method": a.method, "greedy": False,
                                              "tokens": a.calib_tokens, "text": "random token ids"},
            "gemv_configs": {f"{k[0]}x{k[1]}": list(v) for k, v in sg.TUNED.items()},
            "gemv_configs_file": None if a.gemv_configs is None else str(a.gemv_configs),
            "register_cap": settings["REGISTER_CAP"], "evict_first": settings["WEIGHTS_EVICT_FIRST"],
            "bf16_pairs": settings["BF16_PAIRS"], "finish_load": settings["FINISH_LOAD"], "reset_store": settings["RESET_STORE"], "stride_const": settings["ROW_STRIDE_CONST"], "gemv_warps": settings["NUM_WARPS"],
            "attn_min_split_keys": settings["MIN_SPLIT_KEYS"], "attn_fold_tail": settings["FOLD_TAIL"], "attn_pdl": attn_pdl,
            "pdl_trigger": "early" if trigger else "exit",
            "rope_cache_one_launch": rope_one_launch, "rope_in_attention": rope_in_attention,
            "protocol": f"{a.warmup} warm-up steps, {a.repeats} repeats x {a.steps} steps, CUDA events"}

    context_ids = torch.randint(0, dims.vocab, (n,), generator=torch.Generator().manual_seed(n))

    def prepare() -> None:
        # Filled again before every timing: calibration runs the layers over its own tokens, which
        # rewrites the cache. The prefill is dense whatever is installed (one token only is sparse).
        if a.fill == "prefill":
            eng.prefill(context_ids)
        else:
            gen = torch.Generator("cuda").manual_seed(1)
            for layer in eng.model.layers:
                layer.self_attn.cache.k.normal_(generator=gen)
                layer.self_attn.cache.v.normal_(generator=gen)
        eng.pos = n
        eng._pos.fill_(n)  # the step writes slot n and attends [0, n+1)
        eng._tok.fill_(1)
        eng._graph = None  # capture again for the modules now in place

    def timed(mode: str, extra: dict) -> dict:
        prepare()
        t = time.perf_counter()
        eng.decode_replay()
        torch.cuda.synchronize()
        ms = time_steps(eng.decode_replay, a.warmup, a.repeats, a.steps)
        rec = {**base, "mode": mode, "capture_s": time.perf_counter() - t, **extra,
               **summary(ms, dims, n)}
        rec.pop("target_ms", None)
        print(f"{mode:>10} n={n}: {rec['step_ms_median']:.3f} ms/step", flush=True)
        if a.profile:
            rec["profile"] = profile_step(eng.decode_replay, a.profile)
        return rec

    def keep_record(rec: dict) -> None:  # written at once: an interrupted run keeps what it timed
        rec = stamp(rec)
        write_record(a.out / f"proj_decode_{rec['mode']}_{n}_{run_id}.json", rec)
        records.append(rec)

    dense = timed("dense", {"load_s": time.perf_counter() - t0})
    keep_record(dense)
    for keep in keeps:
        t = time.perf_counter()
        th = get_calibrator(a.method, keep=keep).calibrate(eng, ids, text="random token ids")
        calib_s = time.perf_counter() - t
        install = cats_ if a.method == "cats" else sparsify_
        mods = install(eng.model, th.values, track=True)
        with torch.inference_mode():  # one eager tracked step: the keep this step realizes
            prepare()
            eng.model(eng._tok, eng._pos, None)
        if a.method == "cats":  # kept SiLU(gate) channels; gate is read whole, up and down at keep
            realized = sum(m.kept[0].item() for m in mods) / sum(m.kept[1].item() for m in mods)
            total = dense["bytes"]["total"]
            bound = total / (total - (1 - realized) * 2 / 3 * dense["bytes"]["mlp"])
        else:
            realized = realized_projection_keep(eng.model)
            bound = bounds(dims, n, realized, 1.0).projection
            per_call = projection_call_bytes(eng.model)
        install(eng.model, th.values, track=False)  # timed without the counting adds
        for variant in variants:  # each variant's knobs set for its timings and restored after
            flags = ((None,) * 3 if variant == "default"
                     else tuple(part in variant.split("+") for part in ("pdl", "swiglu", "norms")))
            with knobs(sg, PDL=flags[0]), knobs(sparse_linear, FUSE_SWIGLU=flags[1], FUSE_NORMS=flags[2]):
                mode = f"{'cats' if a.method == 'cats' else 'proj'}{keep:g}" + ("" if variant == "default" else
                                                                             f"+{variant}")
                fused = sum(layer.fused() for layer in eng.model.layers)  # layers that run forward_fused
                rec = timed(mode, {"proj_keep": keep, "realized_keep": realized, "calibrate_s": calib_s,
                                   "call_bytes": per_call if a.method == "teal" else None,
                                   "variant": variant, "pdl": sg.PDL, "fuse_swiglu": sparse_linear.FUSE_SWIGLU,
                                   "fuse_norms": sparse_linear.FUSE_NORMS, "layers_norms_fused": fused})
                speedup = dense["step_ms_median"] / rec["step_ms_median"]
                rec.update(speedup=speedup, bound=bound, fraction_of_bound=speedup / bound,
                           paired_dense_ms=dense["step_ms_median"])
                print(f"  keep {keep:g} {variant} ({fused} layers with fused norms): realized {realized:.3f}, "
                      f"speedup {speedup:.3f}x, bound "
                      f"{bound:.3f}x, {100 * speedup / bound:.1f}% of bound", flush=True)
                keep_record(rec)
                for ablation in a.ablate:  # the same variant, every sparse GEMV ablated: its step time only
                    # every call on stages 4 (TUNED set aside), the loop the ablations apply to
                    with knobs(sg, ABLATE=ABLATIONS[ablation], TUNED={}):
                        ab = timed(f"{mode}+ablate-{ablation}", {
                            "proj_keep": keep, "ablated_keep": 0.5, "gemv_ablate": ablation, "gemv_configs": {},
                            "call_bytes": {c: {"read": 0.5 * b["dense"], "dense": b["dense"]} for c, b in per_call.items()},
                            "variant": variant, "pdl": sg.PDL, "fuse_swiglu": sparse_linear.FUSE_SWIGLU,
                            "fuse_norms": sparse_linear.FUSE_NORMS, "paired_sparse_ms": rec["step_ms_median"]})
                    print(f"  ablated ({ablation}): {ab['step_ms_median']:.3f} ms against {rec['step_ms_median']:.3f} "
                          "(timing only: every sparse GEMV keeps even rows, its output wrong by design)", flush=True)
                    keep_record(ab)
        if a.method == "teal":
            densify_(eng.model)
    (a.out / "proj_decode_records.json").write_text(json.dumps(records, indent=1))
    print("median dense ms", statistics.median(dense["step_ms"]))


if __name__ == "__main__":
    main()
