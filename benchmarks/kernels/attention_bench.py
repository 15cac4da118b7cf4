"""Decode-attention backends on one GPU at a Llama-3.1-8B layer shape (ByteCross §4.4, App. D).

One query, 32 query heads over 8 KV heads of 128, bf16, batch 1, at contexts
2K, 32K and 128K. Each backend's calls for `--layers` separate caches (one per
layer, as in a decode step, so a 2K cache does not sit in L2 between calls) are
captured in one CUDA graph; a replay is timed with CUDA events, and the time per
call is the median replay over `--reps` divided by the layer count. Achieved
TB/s counts the K and V bytes of the valid context, 2 * Hkv * D * n * 2 bytes.
split_k (merge fused into the split kernel) and split_k_2kernel (the merge as a
second launch) time our kernel's two paths side by side.

  PYTHONPATH=src python benchmarks/kernels/attention_bench.py --out DIR [--check] [--sweep]
      [--kernels attention.min_split_keys=none,...]

Writes one record per (backend, context) of kind 'attention_bench' into DIR, with the kernel
options it ran under (`--kernels`, the attention part reaching split_k) under 'kernels'.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from sparsedecode.kernels.decode_attention import (
    _kernel_config,
    default_num_splits,
    split_k_attention,
    split_k_ref,
)
from sparsedecode.kernels.options import AttentionOptions, KernelOptions
from sparsedecode.models.attention import decode_attention
from sparsedecode.records import stamp, write_record
from sparsedecode.timing.clock import time_graph

HQ, HKV, D = 32, 8, 128  # llama-3.1-8b attention
GENERATED = 64  # cache slack for generated tokens, as the timing protocol allocates
BACKENDS = ["split_k", "split_k_2kernel", "sdpa_fused", "sdpa_fused_gqa", "sdpa_masked"]
SPLIT_K = {"split_k": True, "split_k_2kernel": False}  # our kernel's backends -> fused_merge
SWEEP_CONFIGS = [(64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 8, 3), (32, 4, 4)]  # BLOCK_N, warps, stages


def _fused_gqa(q, k, v, end):
    """What a user writes: SDPA with enable_gqa over the valid prefix, q as (B, Hq, 1, D)."""
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k[:, :, :end], v[:, :, :end], enable_gqa=True)
    return out.squeeze(2)  # (B, Hq, D)


def calls(name: str, n: int, end_t: torch.Tensor, config=None, splits=None, opts=AttentionOptions()):
    """fn(q, k, v) for one backend; tensor bounds where the backend is capturable with them."""
    if name == "split_k" and not (config or splits):
        return lambda q, k, v: decode_attention(q, k, v, end_t, backend="split_k", options=opts)
    if name in SPLIT_K:
        fused = SPLIT_K[name]
        return lambda q, k, v: split_k_attention(q, k, v, end_t, num_splits=splits, config=config,
                                                 fused_merge=fused, options=opts)[0]
    if name == "sdpa_masked":
        return lambda q, k, v: decode_attention(q, k, v, end_t, backend="sdpa_masked")
    if name == "sdpa_fused":
        return lambda q, k, v: decode_attention(q, k, v, n, backend="sdpa_fused")
    if name == "sdpa_fused_gqa":
        return lambda q, k, v: _fused_gqa(q, k, v, n)
    raise ValueError(name)


def time_layers(fn, q, caches, reps: int) -> list[float]:
    """Per-call seconds of `reps` replays of a graph that calls fn once per cache."""
    def calls():
        for k, v in caches:
            fn(q, k, v)
    return time_graph(calls, reps, per_replay=len(caches))


def check(q, caches, n: int, end_t: torch.Tensor, names, opts: AttentionOptions) -> None:
    k, v = caches[0]
    want, want_lse = split_k_ref(q, k, v, end_t, num_splits=8)
    got, lse_errs = {}, []
    for name, fused in SPLIT_K.items():
        got[name], lse = split_k_attention(q, k, v, end_t, fused_merge=fused, options=opts)
        lse_errs.append((lse - want_lse).abs().max().item())
        assert lse_errs[-1] < 1e-3, f"{name} lse off by {lse_errs[-1]:.3g} at n={n}"
    lse_err = max(lse_errs)
    for name in names:
        out = got[name] if name in got else calls(name, n, end_t, opts=opts)(q, k, v)
        err = (out.float() - want.float()).abs()
        tol = 2e-2 * want.abs().max().item() + 1e-3
        bad = int((err > tol).sum())
        assert bad == 0, (
            f"{name} at n={n}: {bad} of {err.numel()} elements off by > {tol:.3g} "
            f"(max {err.max().item():.3g} at {tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))})"
        )
    print(f"check n={n}: all backends agree with split_k_ref (lse err {lse_err:.2g})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the JSON records")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 32768, 131072])
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS))
    ap.add_argument("--layers", type=int, default=32, help="caches per graph (a step's layers)")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--check", action="store_true", help="assert correctness against split_k_ref first")
    ap.add_argument("--sweep", action="store_true", help="also time split_k kernel configs and split counts")
    ap.add_argument("--sweep-splits", default="", help="split counts for --sweep, e.g. 16,33,49 "
                    "(default: half, equal and twice the default count)")
    ap.add_argument("--sweep-configs", default="", help="BLOCK_N:warps:stages list for --sweep, "
                    "e.g. 64:4:3,128:4:3 (default: a built-in list)")
    ap.add_argument("--kernels", default="", help="kernel options as key=value, e.g. "
                    "attention.min_split_keys=none,attention.programs_per_sm=3 (default: the defaults)")
    args = ap.parse_args()
    kernels = KernelOptions.parse(args.kernels)
    opts = kernels.attention
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    dev, dtype = torch.device("cuda"), torch.bfloat16
    run = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    rows = []
    for n in args.contexts:
        T = n + GENERATED
        gen = torch.Generator(device=dev).manual_seed(n)
        q = torch.randn(1, HQ, D, device=dev, dtype=dtype, generator=gen)  # (B, Hq, D)
        caches = [
            tuple(torch.randn(1, HKV, T, D, device=dev, dtype=dtype, generator=gen) for _ in range(2))
            for _ in range(args.layers)
        ]  # each (B, Hkv, T, D)
        end_t = torch.tensor([n], device=dev)
        if args.check:
            check(q, caches, n, end_t, args.backends, opts)
        variants = [(name, None, None) for name in args.backends]
        if args.sweep:
            base = default_num_splits(T, HKV, dev, options=opts)
            splits_list = ([int(x) for x in args.sweep_splits.split(",")] if args.sweep_splits
                           else (base // 2 or 1, base, min(2 * base, 128)))
            configs = ([tuple(int(v) for v in c.split(":")) for c in args.sweep_configs.split(",")]
                       if args.sweep_configs else SWEEP_CONFIGS)
            variants += [("split_k", cfg, s) for cfg in configs for s in splits_list]
        nbytes = 2 * HKV * D * n * 2
        for name, cfg, splits in variants:
            try:
                t = statistics.median(time_layers(calls(name, n, end_t, cfg, splits, opts), q, caches, args.reps))
            except RuntimeError as e:  # a sweep config can exceed shared memory; report and go on
                if cfg is None:
                    raise
                print(f"{name} cfg={cfg} splits={splits} n={n}: failed ({str(e).splitlines()[0]})")
                continue
            label = name if cfg is None else f"{name} cfg={cfg} splits={splits}"
            rec = stamp({
                "kind": "attention_bench", "backend": name, "context": n, "t_alloc": T,
                "shape": {"B": 1, "Hq": HQ, "Hkv": HKV, "D": D}, "dtype": "bfloat16",
                "layers": args.layers, "reps": args.reps, "graph": True, "kernels": kernels.to_dict(),
                "time_s": t, "kv_bytes": nbytes, "tb_per_s": nbytes / t / 1e12,
                "bytes_read_masked": 2 * HKV * D * T * 2 if name == "sdpa_masked" else None,
                "split_k": None if name not in SPLIT_K else {
                    "config": list(cfg or _kernel_config(D, dtype)),
                    "num_splits": splits or default_num_splits(T, HKV, dev, options=opts),
                    "fused_merge": SPLIT_K[name],
                },
            })
            tag = "" if cfg is None else f"-b{cfg[0]}w{cfg[1]}s{cfg[2]}-S{splits}"
            write_record(args.out / f"attention_bench-{name}{tag}-{n}-{run}.json", rec)
            rows.append((label, n, t * 1e6, rec["tb_per_s"]))
            print(f"{label:44s} n={n:>7d}  {t * 1e6:9.1f} us  {rec['tb_per_s']:6.2f} TB/s", flush=True)
        del caches
        torch.cuda.empty_cache()
    print(f"\n{'backend':44s} {'context':>8s} {'us':>9s} {'TB/s':>6s}")
    for label, n, us, tbs in rows:
        print(f"{label:44s} {n:>8d} {us:9.1f} {tbs:6.2f}")


if __name__ == "__main__":
    main()
