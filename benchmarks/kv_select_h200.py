"""One-time cost of the KV branch on one GPU: observation pass + scoring + gather (ByteCross App. A).

llama-3.1-8b dims, random init, bf16, batch 1: a chunked prefill of n random
token ids, then `Engine.select_kv` (snapkv: the prefill's last 64 queries,
scores, top-k, gather into the compact buffer; window: nothing to gather), timed
with device synchronisation, `--repeats` times per (context, method, keep) after
a first (cold) call that is recorded apart. The paper reports 0.24 s for scoring
+ gather at 32K on an A100; the targets (issue 26) are 50 ms at 32K and 150 ms at
128K, read as a straight line in the context between and beyond them.

    PYTHONPATH=src python3 benchmarks/kv_select_h200.py --out DIR [--contexts 32K] [--keeps 0.3]

Writes one record (kind 'kv_select_bench') per cell into DIR and all of them as
a list in DIR/kv_select_records.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import sparsedecode
from sparsedecode.account.units import parse_token_list
from sparsedecode.records import stamp, write_record

TARGETS_S = ((32768, 0.050), (131072, 0.150))  # (context, select_s target), issue 26


def target_s(n: int) -> float:
    """The select_s target at context n: the line through TARGETS_S."""
    (n0, t0), (n1, t1) = TARGETS_S
    return t0 + (t1 - t0) * (n - n0) / (n1 - n0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--contexts", default="32K")
    ap.add_argument("--keeps", default="0.3")
    ap.add_argument("--methods", default="snapkv")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a dry run)")
    ap.add_argument("--config", type=Path, help="a config.json instead of --model (dry runs)")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed calls, one more under torch.profiler: its kernel table "
                         "(by device time) goes to DIR/profile_<cell>.txt")
    ap.add_argument("--profile-first", action="store_true",
                    help="run the first (cold) call of each cell under cProfile: the Python functions "
                         "by cumulative time go to DIR/cold_<cell>.txt (where a fresh process's first "
                         "selection spends its time: JIT, module loads, allocations)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    contexts = parse_token_list(a.contexts)
    keeps = [float(k) for k in a.keeps.split(",")]
    ref = json.loads(a.config.read_text()) if a.config else a.model
    eng = sparsedecode.load(ref, device=a.device, dtype="bfloat16", init="random",
                            max_len=max(contexts) + a.new, compile=False)
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    records = []
    for n in contexts:
        ids = torch.randint(0, eng.dims.vocab, (n,), generator=torch.Generator().manual_seed(n))
        sync()
        t = time.perf_counter()
        eng.prefill(ids, chunk=4096)
        sync()
        prefill_s = time.perf_counter() - t
        for method in a.methods.split(","):
            for keep in keeps:
                times, phases = [], []
                for i in range(a.repeats + 1):  # the first call warms up (allocations, kernels)
                    eng.pos = n
                    if i == 0 and a.profile_first:
                        s = _cold(eng, method, keep, a.new, a.out / f"cold_{method}{keep:g}_{n}.txt")
                    else:
                        s = eng.select_kv(method, keep, a.new)
                    times.append(s.select_s)
                    phases.append(s.phases)
                sel = eng.kv
                if a.profile:
                    _profile(eng, method, keep, a.new, a.out / f"profile_{method}{keep:g}_{n}.txt")
                med = statistics.median(times[1:])
                rec = stamp({
                    "kind": "kv_select_bench", "model": {"name": a.model, "dims": eng.dims.to_dict(),
                                                         "init": "random"},
                    "dtype": "bfloat16", "context": n, "method": method, "keep": keep, "max_new": a.new,
                    "budget": sel.budget, "prefill_s": prefill_s, "select_s": times[1:], "first_s": times[0],
                    "phases": phases[1:], "first_phases": phases[0],
                    "select_s_median": med, "target_s": target_s(n), "meets_target": med <= target_s(n),
                    "protocol": f"1 warm-up + {a.repeats} timed select_kv calls, device-synchronised",
                })
                records.append(rec)
                write_record(a.out / f"kv_select_{method}{keep:g}_{n}.json", rec)
                print(f"n={n} {method} keep {keep:g}: budget {sel.budget}, select {med * 1e3:.1f} ms "
                      f"(first {times[0] * 1e3:.1f} ms), prefill {prefill_s:.2f} s", flush=True)
    (a.out / "kv_select_records.json").write_text(json.dumps(records, indent=1))


def _cold(eng, method: str, keep: float, new: int, path: Path):
    """The first selection under cProfile; its 40 costliest functions (cumulative) to `path`."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    s = eng.select_kv(method, keep, new)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(40)
    path.write_text(f"first select_kv: {s.select_s:.3f} s, phases {s.phases}\n\n{buf.getvalue()}")
    return s


def _profile(eng, method: str, keep: float, new: int, path: Path) -> None:
    """One more selection under torch.profiler; its kernels by total device time, to `path`."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if eng.device.type == "cuda" else [])
    eng.pos = eng.kv.n
    with profile(activities=acts) as prof:
        eng.select_kv(method, keep, new)
    key = "cuda_time_total" if eng.device.type == "cuda" else "cpu_time_total"
    path.write_text(prof.key_averages().table(sort_by=key, row_limit=40))


if __name__ == "__main__":
    main()
