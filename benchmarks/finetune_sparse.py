"""The SATS fine-tuned setting on WikiText-2 chunked perplexity (SATS paper §4 'Fine-tuned model
performance', §4.2 'Fine-tuning Methods', Tables 3, 4 and 7; issue 45 item 5). CPU, masked
reference: quality only, the byte bound stands for speed.

    PYTHONPATH=src python benchmarks/finetune_sparse.py --model smollm2-135m --steps 64 --out benchmarks/records/cpu/finetune/smollm2-135m

Settings, one 'mlp_sparsity_eval' record each (the records `benchmarks/sats_vs_cats.py` writes,
plus which adapter ran): dense; CATS 0.5 and SATS 0.5 training-free; the same thresholds with a
LoRA adapter fine-tuned under them (`sparsedecode finetune`'s defaults: rank 16, alpha 32 on the
MLP's three projections, 128 steps of 256 tokens from the first 32,768 tokens of WikiText-2
validation, seed 0); SATS 0.5 fine-tuned and routed at 25/50/75% of tokens, the routing table
scored and calibrated on the fine-tuned sparse model (Table 7); and the control the paper does
not run: the dense model with an adapter trained the same way, unmasked, which says how much of a
fine-tuned setting's gain is the text (WikiText-2 validation is the domain of the test text) and
not the recovery of what sparsity lost.

Text (WikiText-2 raw, tokenized whole), as `sats_vs_cats.py` cuts it: validation [0, 8192)
calibrates the thresholds, [8192, 40960) scores the routing tables, [40960, 57344) picks each
routing tau; test [0, chunks x 2048 + 1) is the chunked protocol (each chunk's first 1,024
positions dense, the last 1,024 scored under the setting) and the 8,192 test tokens after it
measure the realized keep (masked) of each model, training-free or fine-tuned. Every setting of
a model is scored in one pass over the chunks, so every record pairs with every other chunk by
chunk (paired bootstrap intervals: `sparsedecode report results`, kind 'finetune').

Everything lands in --out and a rerun resumes: thresholds and routing tables are files, each
adapter is fine-tuned into --adapters (checkpointed: an interrupted fine-tune resumes), each
model's perplexity pass saves its chunks as it goes, and each record is written when its model's
pass ends. The adapters (about 12 MB each for smollm2-135m) stay out of git: the same command
rebuilds them bit for bit (seeded); their 'finetune' records (loss curves) are copied beside the
evaluation records.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

import sparsedecode
from sparsedecode.account import bounds
from sparsedecode.corpus import text_ids, wikitext_path
from sparsedecode.errors import InputError
from sparsedecode.projection.calibrate import get_calibrator, measure_keep
from sparsedecode.projection.routing import RoutingTable, build_routing_table, calibrate_routing
from sparsedecode.projection.thresholds import Thresholds, cats_projection_keep
from sparsedecode.quality.finetune import RECORD as FT_RECORD
from sparsedecode.quality.finetune import FinetuneOptions, finetune
from sparsedecode.quality.perplexity import CHUNK, DENSE, resumable_chunked_nll
from sparsedecode.records import read_record, stamp, write_record

KIND = "mlp_sparsity_eval"
KEEP = 0.5
METHODS = ("cats", "sats")
ROUTING_TARGETS = (0.25, 0.5, 0.75)
BOUND_CONTEXT = 2048


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", type=Path, required=True, help="records folder (thresholds/ inside it)")
    ap.add_argument("--adapters", type=Path, default=None,
                    help="where the adapters are fine-tuned (default runs/finetune/MODEL, outside git)")
    ap.add_argument("--chunks", type=int, default=16, help="chunked-protocol chunks of WikiText-2 test")
    ap.add_argument("--cal-tokens", type=int, default=8192)
    ap.add_argument("--route-tokens", type=int, default=32768)
    ap.add_argument("--held-out-tokens", type=int, default=16384)
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=FinetuneOptions.steps, help="fine-tuning steps per adapter")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (float32 either way: the masked reference, quality only)")
    a = ap.parse_args()
    a.adapters = a.adapters or Path("runs/finetune") / a.model
    a.out.mkdir(parents=True, exist_ok=True)
    a.adapters.mkdir(parents=True, exist_ok=True)
    try:
        run(a)
    except InputError as err:
        raise SystemExit(f"error: {err}") from None


def run(a) -> None:
    t0 = time.perf_counter()
    eng = sparsedecode.load(a.model, device=a.device, dtype="float32", max_len=CHUNK + 8, compile=False)
    where = "CPU" if eng.device.type == "cpu" else torch.cuda.get_device_name(eng.device)
    val = text_ids(eng.tokenizer, wikitext_path("valid"))
    test = text_ids(eng.tokenizer, wikitext_path("test"))
    c, r, h = a.cal_tokens, a.route_tokens, a.held_out_tokens
    ppl_end = a.chunks * CHUNK + 1
    if len(val) < c + r + h or len(test) < ppl_end + a.eval_tokens:
        raise InputError("WikiText-2 is shorter than the slices this protocol cuts; lower the token options")
    opts = FinetuneOptions(steps=a.steps)
    text = {"ppl": f"wiki.test.raw[:{ppl_end}]", "keep": f"wiki.test.raw[{ppl_end}:{ppl_end + a.eval_tokens}]",
            "calibration": f"wiki.valid.raw[:{c}]", "routing": f"wiki.valid.raw[{c}:{c + r}]",
            "tau": f"wiki.valid.raw[{c + r}:{c + r + h}]", "finetune": f"wiki.valid.raw[:{opts.tokens}]"}
    eval_ids, ppl_ids = test[ppl_end: ppl_end + a.eval_tokens], test[:ppl_end]
    th_dir = a.out / "thresholds"
    th_dir.mkdir(exist_ok=True)

    thresholds = {}
    for method in METHODS:
        name = f"{method}{KEEP:g}"
        path = th_dir / f"{name}.safetensors"
        if not path.exists():
            print(f"calibrating {name} on {text['calibration']}", flush=True)
            get_calibrator(method, keep=KEEP).calibrate(eng, val[:c], text=text["calibration"],
                                                        progress=True).save(path)
        thresholds[name] = Thresholds.load(path)

    def adapter(name: str) -> Path:
        """The adapter fine-tuned under `name`'s thresholds (the dense control: none), trained here first."""
        folder = a.adapters / name
        if not (folder / FT_RECORD).exists():
            print(f"fine-tuning {name} on {text['finetune']}", flush=True)
            finetune(eng, val, thresholds.get(name), opts, folder, text=text["finetune"],
                     thresholds_file=None if name == "dense" else str(th_dir / f"{name}.safetensors"),
                     progress=True)
        shutil.copyfile(folder / FT_RECORD, a.out / f"finetune_{name}.json")
        return folder

    def record(name, label, method, keep, route, nll, real, routed, table, th, adapter, seconds):
        dims = eng.dims
        eff = 1.0 if real is None else real
        if route is not None:
            eff = routed * real + (1.0 - routed)  # SATS §3.2: r x keep_sparse + (1 - r)
        rp = cats_projection_keep(dims, eff)
        ft = None if adapter is None else read_record(adapter / FT_RECORD)
        write_record(a.out / f"{name}.json", stamp({
            "kind": KIND, "name": name, "label": label, "method": method, "target_keep": keep,
            "routing_target": route, "model": eng.name, "device": eng.device.type, "dtype": "float32",
            "runtime": f"masked reference ({where})", "chunks": a.chunks, "text": text,
            "targets_per_chunk": CHUNK - DENSE, "nll": nll, "realized_keep": real,
            "realized_keep_text": text["keep"], "routed": routed,
            "routed_text": "the scored positions of the perplexity chunks",
            "routed_calibration": None if table is None else table.routed,
            "tau": None if table is None else table.tau,
            "thresholds": None if th is None else {"method": th.method, "keep": th.keep, "extras": th.extras,
                                                   "calibration": th.calibration},
            "adapter": None if ft is None else {
                "folder": str(adapter), "training_free": name.split("_ft")[0],
                "options": ft.get("options"), "thresholds": ft.get("thresholds"),
                "final_loss": (ft.get("loss") or [None])[-1], "seconds": ft.get("seconds"),
                "record": f"finetune_{adapter.name}.json"},
            "effective_act_keep": None if real is None else eff, "proj_keep": rp,
            "bound": bounds(dims, BOUND_CONTEXT, rp, 1.0).projection, "bound_context": BOUND_CONTEXT,
            "seconds": round(seconds, 1),
        }))

    # training-free: dense, CATS 0.5, SATS 0.5 on the base model
    names = ["dense", *thresholds]
    if any(not (a.out / f"{n}.json").exists() for n in names):
        real = {n: measure_keep(eng, th, eval_ids)["act_keep"] for n, th in thresholds.items()}
        nll = _ppl_pass(a, eng, ppl_ids, "base", [(None, None)] + [(th.values, None) for th in thresholds.values()])
        for i, n in enumerate(names):
            method = "dense" if n == "dense" else thresholds[n].method
            record(n, "dense" if n == "dense" else f"{method.upper()} {KEEP:g}", method,
                   None if n == "dense" else KEEP, None, nll[i], real.get(n), None, None, thresholds.get(n),
                   None, time.perf_counter() - t0)
        (a.out / ".ppl_base.json").unlink(missing_ok=True)

    # fine-tuned: each adapter merged at load, its settings in one pass (the dense control last)
    adapters = {}
    for base in (*thresholds, "dense"):
        th = thresholds.get(base)
        names = [f"{base}_ft"]
        if base == f"sats{KEEP:g}":
            names += [f"{base}_ft_route{t:g}" for t in ROUTING_TARGETS]
        if all((a.out / f"{n}.json").exists() for n in names):
            continue
        adapters[base] = adapter(base)
        ft = sparsedecode.load(a.model, device=a.device, dtype="float32", max_len=CHUNK + 8, compile=False,
                               adapter=str(adapters[base]))
        real = None if th is None else measure_keep(ft, th, eval_ids)["act_keep"]
        tables = {}
        if len(names) > 1:  # SATS Table 7: the routing table of the fine-tuned sparse model
            path = th_dir / f"route_{base}_ft.safetensors"
            if path.exists():
                table = RoutingTable.load(path)
            else:
                print(f"scoring the routing table of {base} fine-tuned on {text['routing']}", flush=True)
                table = build_routing_table(ft, th, val[c: c + r], progress=True,
                                            thresholds_file=str(th_dir / f"{base}.safetensors"), text=text["routing"])
                table.save(path)
            for t in ROUTING_TARGETS:
                tables[t] = calibrate_routing(table, ft, val[c + r: c + r + h], t, text=text["tau"])
        settings = [(None if th is None else th.values, None)]
        settings += [(th.values, tables[t].sparse_of()) for t in ROUTING_TARGETS if tables]
        nll = _ppl_pass(a, ft, ppl_ids, f"{base}_ft", settings)
        scored = [tok for k in range(a.chunks) for tok in ppl_ids[k * CHUNK + DENSE: (k + 1) * CHUNK]]
        label = "dense" if th is None else f"{th.method.upper()} {KEEP:g}"
        record(names[0], f"{label} + LoRA", "dense" if th is None else th.method, None if th is None else KEEP,
               None, nll[0], real, None, None, th, adapters[base], time.perf_counter() - t0)
        for i, t in enumerate(ROUTING_TARGETS if tables else ()):
            record(names[i + 1], f"{label} + LoRA + routing {t:.0%}", th.method, KEEP, t, nll[i + 1], real,
                   tables[t].routed_fraction(scored), tables[t], th, adapters[base], time.perf_counter() - t0)
        (a.out / f".ppl_{base}_ft.json").unlink(missing_ok=True)
    print(f"records in {a.out}; the table: sparsedecode report results (kind 'finetune')")


def _ppl_pass(a, eng, ids, tag: str, settings) -> list[list[float]]:
    """Per-chunk NLLs of `settings` on one engine, resumable from --out/.ppl_<tag>.json."""
    names = [str(i) for i in range(len(settings))]
    nll = resumable_chunked_nll(eng, ids, a.chunks, names, settings, a.out / f".ppl_{tag}.json", f"chunks ({tag})")
    return [nll[n] for n in names]


if __name__ == "__main__":
    main()
