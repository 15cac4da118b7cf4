"""Decode step with the KV branch (and both branches) against dense, on one GPU (ByteCross §4.1-4.2, App. A).

llama-3.1-8b dims, random init (bytes per step do not depend on values), bf16,
batch 1. Per context n: the cache is filled with random keys and values and the
last `--window` prompt positions are prefilled for real (the observation window
of the selection needs their token ids); then, in one process and one compiled
+ captured step per mode:

- dense: the whole cache;
- sel{keep}: snapkv keeps round(keep x n) - new entries per KV head in a
  compact buffer that the step appends to;
- window{keep}: 4 sinks + recent entries read in place;
- both{p}/{keep}: projection keep p (teal, calibrated on the model's own
  activations) with the selection at keep.

Each record holds the step time, the paired dense time, the speedup and the byte
bound from `sparsedecode account` (the selection reads budget + new entries at
its last step; the bound uses the realized keeps), and the one-time selection cost.

    PYTHONPATH=src python3 benchmarks/kv_decode_h200.py --out DIR [--contexts 32K,128K] \\
        [--sel 0.3] [--window 0.3] [--both 0.5/0.3]

Writes one record per (context, mode) into DIR as soon as it is measured, and at the end all of them as a list in DIR/kv_decode_records.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from dense_decode_h200 import summary, time_steps  # benchmarks/ is the script's folder

import sparsedecode
from sparsedecode.account import bounds
from sparsedecode.account.units import parse_token_list
from sparsedecode.kv.apply import clear_kv
from sparsedecode.projection.calibrate import get_calibrator
from sparsedecode.projection.sparse_linear import densify_, realized_projection_keep, sparsify_
from sparsedecode.records import stamp, write_record
from sparsedecode.timing.clock import time_blocks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--config", type=Path, help="a config.json instead of --model (dry runs)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--contexts", default="32K,128K")
    ap.add_argument("--sel", default="0.3", help="comma list of selection keeps ('' for none)")
    ap.add_argument("--window", default="0.3", help="comma list of window keeps ('' for none)")
    ap.add_argument("--both", default="0.5/0.3", help="comma list of proj/kv keep pairs ('' for none)")
    ap.add_argument("--new", type=int, default=64, help="tokens the selection leaves room for")
    ap.add_argument("--obs", type=int, default=64, help="observation window of snapkv")
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--compile-mode", default="", help="'' for torch.compile's default")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=50)
    a = ap.parse_args()
    contexts = parse_token_list(a.contexts)
    keeps = lambda s: [float(k) for k in s.split(",") if k]  # noqa: E731
    both = [tuple(float(x) for x in pair.split("/")) for pair in a.both.split(",") if pair]
    run_id = time.strftime("%Y%m%dT%H%M%S")
    ref = json.loads(a.config.read_text()) if a.config else a.model
    cuda = a.device.startswith("cuda")
    eng = sparsedecode.load(ref, device=a.device, dtype="bfloat16" if cuda else "float32", init="random",
                            max_len=max(contexts) + a.new + 1, compile=(a.compile_mode or True) if cuda else False)
    dims = eng.dims
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    timer = time_steps if cuda else _cpu_steps
    records = []
    base = {"kind": "kv_decode_bench", "model": {"name": a.model, "dims": dims.to_dict(), "init": "random"},
            "dtype": str(eng.dtype).removeprefix("torch."), "batch": 1, "compile_mode": a.compile_mode,
            "attention": eng.attention, "run_id": run_id, "new": a.new,
            "runtime": "CUDA graph" if eng.cuda_graph else "CPU eager",
            "protocol": f"{a.warmup} warm-up steps, {a.repeats} repeats x {a.steps} steps"}
    th_by_keep = {}

    def fill(n: int) -> None:
        """Random cache of n entries, the last `obs` of them from a real prefill of token ids."""
        gen = torch.Generator(eng.device).manual_seed(n)
        for layer in eng.model.layers:
            layer.self_attn.cache.k.normal_(generator=gen)
            layer.self_attn.cache.v.normal_(generator=gen)
        ids = torch.randint(0, dims.vocab, (a.obs,), generator=torch.Generator().manual_seed(n))
        eng.prefill(ids, start=n - a.obs)

    def timed(n: int, mode: str, extra: dict) -> dict:
        eng.pos = n
        eng._pos.fill_(n)
        eng._tok.fill_(1)
        t = time.perf_counter()
        eng.decode_replay()
        sync()
        ms = timer(eng.decode_replay, a.warmup, a.repeats, a.steps)
        rec = {**base, "context": n, "mode": mode, "capture_s": time.perf_counter() - t, **extra,
               **summary(ms, dims, n)}
        rec.pop("target_ms", None)
        print(f"{mode:>14} n={n}: {rec['step_ms_median']:.3f} ms/step", flush=True)
        return rec

    def save(rec: dict) -> dict:
        """Stamp and write one record as soon as it is measured: an interrupted run keeps what it timed."""
        rec = stamp(rec)
        write_record(a.out / f"kv_decode_{rec['mode'].replace('/', '-')}_{rec['context']}_{run_id}.json", rec)
        return rec

    for n in contexts:
        fill(n)
        clear_kv(eng)
        dense = timed(n, "dense", {})
        records.append(save(dense))
        plan = [("sel", None, k) for k in keeps(a.sel)] + [("window", None, k) for k in keeps(a.window)]
        plan += [("both", p, k) for p, k in both]
        for kind, pkeep, kkeep in plan:
            if pkeep is not None:
                if pkeep not in th_by_keep:
                    ids = torch.randint(0, dims.vocab, (a.calib_tokens,), generator=torch.Generator().manual_seed(0))
                    clear_kv(eng)
                    th_by_keep[pkeep] = get_calibrator("teal", keep=pkeep).calibrate(eng, ids, text="random ids")
                    fill(n)  # calibration ran a prefill over the cache
                sparsify_(eng.model, th_by_keep[pkeep].values, track=True)
            eng.pos = n
            sel = eng.select_kv("window" if kind == "window" else "snapkv", kkeep, a.new, window=a.obs)
            proj_realized = 1.0
            if pkeep is not None:
                with torch.inference_mode():  # one eager tracked step: the keep it realizes
                    eng._pos.fill_(n)
                    eng.model(eng._tok, eng._pos, None)
                proj_realized = realized_projection_keep(eng.model)
                sparsify_(eng.model, th_by_keep[pkeep].values, track=False)
            read = (sel.budget + a.new) / n  # entries read at the last generated token, over n
            mode = f"{kind}{kkeep:g}" if pkeep is None else f"both{pkeep:g}/{kkeep:g}"
            rec = timed(n, mode, {"kv_method": sel.method, "kv_keep": kkeep, "kv_budget": sel.budget,
                                  "kv_read_fraction": read, "select_s": sel.select_s,
                                  "proj_keep": pkeep, "proj_realized_keep": proj_realized})
            b = bounds(dims, n, proj_realized, min(read, 1.0))
            bound = b.both if pkeep is not None else b.kv
            rec.update(speedup=dense["step_ms_median"] / rec["step_ms_median"], bound=bound,
                       paired_dense_ms=dense["step_ms_median"])
            rec["fraction_of_bound"] = rec["speedup"] / bound
            print(f"  {mode}: budget {sel.budget}, select {sel.select_s * 1e3:.0f} ms, speedup "
                  f"{rec['speedup']:.3f}x, bound {bound:.3f}x, {100 * rec['fraction_of_bound']:.1f}% of bound",
                  flush=True)
            records.append(save(rec))
            clear_kv(eng)
            if pkeep is not None:
                densify_(eng.model)
    (a.out / "kv_decode_records.json").write_text(json.dumps(records, indent=1))


def _cpu_steps(step, warmup: int, repeats: int, steps: int) -> list[float]:
    """Per-step ms with the host clock (dry runs on CPU)."""
    return time_blocks(step, warmup, repeats, steps, cuda=False)


if __name__ == "__main__":
    main()
