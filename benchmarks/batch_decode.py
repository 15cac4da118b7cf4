"""Batched decode step against batch size, per mode and context (issue 44; ByteCross §3.3, App. F).

One engine per context, loaded with the largest batch asked (`load(..., batch=B)`), its cache
rows filled with seeded normal keys and values (what a step reads costs the same whatever the
values, as a timing cell's 'random' fill). For each mode (dense, proj<keep>, sel<keep>,
both<p>/<s>) and batch B, the decode step of B sequences at position `context` (each row its
own cache row, or its own compact region of round(keep x context) entries where the mode
selects: timing only, the entries are not scored) is timed: a CUDA graph's replays on a GPU,
the eager step on CPU. With `--fill prefill` (the default) and a model with a tokenizer, each row
is instead a dense prefill of its own WikiText-2 test window and decodes that window's next
token, so the union of kept channels is the one real text gives. Projection thresholds are TEAL's at the mode's keep, calibrated on the
model's own activations (`own_teal`: WikiText-2 validation with a tokenizer, seeded random ids
for a random-init model); the union they realize over the batch's B tokens is measured in
tracked eager steps and goes into the byte count. Random weights have no meaningful union:
their rows say so (`union_source`), and the account's n*_B uses the real-text union records.

    PYTHONPATH=src python benchmarks/batch_decode.py --model smollm2-135m --device cpu \\
        --contexts 1024 --batches 1 2 4 8 --modes dense proj0.5 sel0.3 --out benchmarks/records/cpu/batch
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

import sparsedecode
from sparsedecode.config import SparsityConfig
from sparsedecode.engine.batch import BatchDecoder
from sparsedecode.records import stamp, write_record
from sparsedecode.timing.batch_cell import batch_union

NOMINAL_TBPS = {"H200": 4.8, "H100": 3.35}  # HBM3e / HBM3 (SXM) peaks
MEASURED_TBPS = {"H200": 4.15}  # bf16 GEMV ceiling measured on the H200 (ByteCross App. A; records/h200)


def time_step(step, cuda: bool, warmup: int, repeats: int, steps: int) -> list[float]:
    """ms per step of each repeat: CUDA graph replays on a GPU, the eager step on CPU."""
    if cuda:
        from sparsedecode.timing.clock import time_graph

        def block():  # one replay is `steps` steps (time_graph divides by per_replay)
            for _ in range(steps):
                step()

        with torch.inference_mode():
            secs = time_graph(block, replays=repeats, warmup=warmup, per_replay=steps)
        return [s * 1e3 for s in secs]
    from sparsedecode.timing.clock import time_blocks

    with torch.inference_mode():
        return time_blocks(step, warmup, repeats, steps, False)


def select_rows(dec: BatchDecoder, context: int, keep: float, seed: int, text: bool) -> int:
    """Every slot reads a compact region of round(keep x context) entries (the new one at slot
    `budget`): a selection's bytes, not its scored choice. With `text` rows the entries are each
    row's most recent ones (real keys and values, so the step's activations, and the union they
    give, stay those of text); otherwise seeded values. Returns the budget."""
    budget = max(1, int(keep * context + 0.5))
    _, _, offset, sel = dec._rows_state(budget + 1)
    gen = torch.Generator(dec.engine.device).manual_seed(seed)
    for c in dec.caches:
        if text:
            c.rows[0][:, :, :budget] = c.k[:, :, context - budget:context]
            c.rows[1][:, :, :budget] = c.v[:, :, context - budget:context]
        else:
            c.rows[0].normal_(generator=gen)
            c.rows[1].normal_(generator=gen)
    offset.fill_(context - budget)
    sel.fill_(True)
    return budget


def fill_rows(eng, dec: BatchDecoder, context: int, rows: int, seed: int, fill: str) -> list[list[int]] | None:
    """With fill 'prefill', cache row b is a dense prefill of its own WikiText-2 test window
    (windows `context` + 1 tokens apart, as App. F draws a batch's sequences from the stream);
    with 'random', or for a model without a tokenizer, every row holds seeded normal keys and
    values. Returns each row's ids (None: random)."""
    if fill == "random" or eng.tokenizer is None:
        eng.fill_random_(seed)
        return None
    from sparsedecode.corpus import wikitext_ids

    ids = wikitext_ids(eng.tokenizer, "test")
    span = context + 1
    if len(ids) < rows * span:
        ids = ids * (rows * span // len(ids) + 1)
    out = [ids[b * span:(b + 1) * span] for b in range(rows)]
    for b, row in enumerate(out):
        with dec._on_slot(b):
            eng.prefill(row[:context])
    return out


def clear_rows(dec: BatchDecoder) -> None:
    for c in dec.caches:
        c.rows = None


def measure(a, configs, rows: list, state: dict, saved) -> None:
    """Every (context, mode, batch) row not in `rows` yet (a resumed record's), appended to `rows`
    as it is measured, each followed by `saved()` (the record rewritten)."""
    done = {(r["context"], r["mode_spec"], r["batch"]) for r in rows}
    for context in a.contexts:
        if all((context, str(c), B) in done for c in configs for B in a.batches):
            continue
        bmax = max(a.batches)
        eng = sparsedecode.load(a.model, init=a.init, device=a.device, dtype=a.dtype, max_len=context + 1,
                                batch=bmax, compile=False, quiet=True)
        cuda = eng.device.type == "cuda"
        gpu = state["gpu"] = torch.cuda.get_device_name(eng.device) if cuda else "CPU"
        if state.get("resumed_gpu") not in (None, gpu):
            raise SystemExit(f"--resume: that record was measured on {state['resumed_gpu']}, this is {gpu}: "
                             "one record is one device (start a new record with --out)")
        dec = BatchDecoder(eng)
        dims, size = eng.dims, eng.dtype.itemsize
        thresholds = {}
        for cfg in configs:  # calibrated first: its passes write row 0, which the fill then writes
            k = cfg.proj_keep
            if cfg.projection is not None and k not in thresholds:
                from sparsedecode.projection.calibrate import own_teal

                with dec._on_slot(0):
                    thresholds[k] = own_teal(eng, k, tokens=a.calib_tokens, seed=a.seed)
        stream = fill_rows(eng, dec, context, bmax, a.seed, a.fill)
        for cfg in configs:
            proj = cfg.with_(kv=None)
            th = thresholds.get(cfg.proj_keep)
            eng.configure(proj, thresholds=None if th is None else th[0])
            budget = context
            if cfg.kv is not None:
                budget = select_rows(dec, context, cfg.kv_keep, a.seed, stream is not None)
            else:
                clear_rows(dec)
            for B in sorted(a.batches):
                if (context, str(cfg), B) in done:
                    continue
                if stream is not None:  # each row's own next token of its text
                    tok = torch.tensor([[stream[b][context]] for b in range(B)], device=eng.device)
                else:
                    gen = torch.Generator().manual_seed(a.seed + B)
                    tok = torch.randint(0, dims.vocab, (B, 1), generator=gen).to(eng.device)
                pos = torch.full((B,), context, dtype=torch.long, device=eng.device)

                def step(tok=tok, pos=pos, model=eng.model):
                    return model(tok, pos, None)[:, -1].float()

                union, keep = batch_union(eng.model, lambda i: step(), 4) if cfg.projection is not None else (1.0, 1.0)
                ms = time_step(step, cuda, a.warmup, a.repeats, a.steps)
                med = statistics.median(ms)
                weights = (dims.n_layers * dims.proj_params * union + dims.other_params) * size
                kv = B * dims.kv_elems_per_token * dims.kv_tokens(budget + 1) * size
                nbytes = weights + kv
                label = gpu.removeprefix("NVIDIA ").split()[0] if cuda else "CPU"
                row = {
                    "mode": cfg.kind, "mode_spec": str(cfg), "context": context, "batch": B,
                    "step_ms_runs": ms, "step_ms_median": med, "tokens_per_sec": B * 1e3 / med,
                    "realized_union": union, "realized_keep": keep, "kv_entries_read": budget + 1,
                    "bytes_per_step": nbytes, "achieved_gbps": nbytes / (med * 1e-3) / 1e9,
                    "union_source": None if cfg.projection is None else (
                        "random weights: tokens' kept channels nearly independent" if a.init == "random"
                        else "the model's own activations on its stream"),
                }
                if label in NOMINAL_TBPS:
                    row["pct_nominal_peak"] = 100 * row["achieved_gbps"] / (NOMINAL_TBPS[label] * 1e3)
                if label in MEASURED_TBPS:
                    row["pct_measured_ceiling"] = 100 * row["achieved_gbps"] / (MEASURED_TBPS[label] * 1e3)
                rows.append(row)
                saved()
                print(f"{label} n={context} {str(cfg):>12} B={B:>3}: {med:8.3f} ms  {row['tokens_per_sec']:9.1f} tok/s  "
                      f"union {union:.3f}  {row['achieved_gbps']:.0f} GB/s", flush=True)
        del dec, eng
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--init", default="pretrained")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--modes", nargs="+", default=["dense", "proj0.5", "sel0.3", "both0.5/0.3"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--fill", choices=["prefill", "random"], default="prefill",
                    help="cache rows: each its own WikiText-2 window prefilled (a model with a tokenizer), or seeded "
                         "normal values")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True, help="folder for the record")
    ap.add_argument("--resume", type=Path, default=None,
                    help="a record of this script: its rows are kept and only the missing (context, mode, batch) "
                         "rows are measured, into the same file")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    rows, t_start = [], time.perf_counter()
    try:
        configs = [SparsityConfig.parse(m) for m in a.modes]
    except ValueError as e:
        raise SystemExit(f"error: --modes: {e}") from None
    state = {"gpu": None, "error": None, "path": None}
    if a.resume is not None:
        try:
            old = json.loads(a.resume.read_text())
        except (OSError, ValueError) as e:
            print(f"error: --resume {a.resume}: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        if old.get("kind") != "batch_decode" or old.get("model") != a.model or old.get("init") != a.init:
            print(f"error: --resume {a.resume} is not a batch_decode record of {a.model} ({a.init})", file=sys.stderr)
            raise SystemExit(2)
        rows, state["path"], state["resumed_gpu"] = old["rows"], a.resume, old.get("gpu")

    def saved() -> Path:
        rec = record(a, rows, state, t_start)
        if state["path"] is None:
            a.out.mkdir(parents=True, exist_ok=True)
            when = rec["timestamp"].replace(":", "").replace("-", "")[:15]
            state["path"] = a.out / f"batch_decode_{a.model}_{rec['label'].replace(' ', '_')}_{when}.json"
        return write_record(state["path"], rec, overwrite=True)

    def stop(signum, frame):  # a timeout's SIGTERM: keep what was measured
        raise SystemExit(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    try:
        measure(a, configs, rows, state, saved)
    except BaseException as e:  # what was measured is kept: the record says where it stopped
        state["error"] = f"{type(e).__name__}: {e}"
        print("stopped:", state["error"], flush=True)
    print(saved())


def record(a, rows: list, state: dict, t_start: float) -> dict:
    gpu = state["gpu"] or "unknown"
    return stamp({
        "kind": "batch_decode",
        "model": a.model, "init": a.init, "device": "cuda" if gpu != "CPU" else "cpu", "gpu": gpu,
        "label": gpu.removeprefix("NVIDIA ") if gpu != "CPU" else "CPU",
        "threads": torch.get_num_threads(),
        "fill": a.fill if a.init != "random" else "random",
        "protocol": (f"{a.warmup} warm-up, {a.repeats} repeats x {a.steps} steps at position n; "
                     + ("CUDA graph replays" if gpu != "CPU" else "eager, perf_counter")
                     + ("; each cache row its own WikiText-2 test window, prefilled" if a.fill == "prefill"
                        and a.init != "random" else "; cache rows filled with seeded normal values")
                     + "; selected modes read round(keep x n) entries per row, its most recent ones (text rows) or "
                     "seeded values: a selection's bytes, not its scored choice"),
        "ceilings_tbps": {"nominal": NOMINAL_TBPS, "measured": MEASURED_TBPS},
        "rows": rows,
        "error": state["error"],  # None: every row asked for was measured
        "wall_s": time.perf_counter() - t_start,
        "command": "PYTHONPATH=src python benchmarks/batch_decode.py " + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(a).items() if v is not None and k != "resume"),
    })


if __name__ == "__main__":
    main()
