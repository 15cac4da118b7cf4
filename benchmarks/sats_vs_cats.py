"""CATS against SATS at matched realized sparsity, and static SATS against SATS with token
routing at 25/50/75% targets, on WikiText-2 chunked perplexity (SATS paper §3.1, §3.2, §4;
issue 5). CPU, masked reference: quality only, the byte bound stands for speed.

    PYTHONPATH=src python benchmarks/sats_vs_cats.py --model smollm2-135m --out benchmarks/records/cpu/sats/smollm2-135m
    PYTHONPATH=src python benchmarks/sats_vs_cats.py --model qwen2.5-coder-0.5b --out benchmarks/records/cpu/sats/qwen2.5-coder-0.5b

Text (WikiText-2 raw, tokenized whole): validation [0, cal) calibrates the thresholds,
[cal, cal + route) scores the routing table, [cal + route, cal + route + held) picks each
routing tau; test [0, chunks x 2048 + 1) is the chunked protocol (first 1,024 positions of a
chunk dense, the last 1,024 scored under the setting), and the test tokens after it measure
the realized keep (`measure_keep`, masked). Settings: dense; CATS and SATS at target keeps
0.7 and 0.5 (30% and 50% sparsity, §4); SATS 0.5 routed at 25/50/75% of tokens (§4 picks
SATS matched to CATS 50% for routing). A routed position applies the thresholds only where
its token id routes sparse (`quality.perplexity.chunked_nll_many`).

Everything lands in --out and a rerun resumes: thresholds and routing tables are files,
the perplexity pass saves every chunk's NLLs to a progress file as it goes, and one
'mlp_sparsity_eval' record per setting is written at the end. The table is printed, rebuilt
from the records alone (`mlp_table.py` beside this script).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from mlp_table import KIND, comparison_table, load_records  # beside this script

import sparsedecode
from sparsedecode.account import bounds
from sparsedecode.corpus import text_ids, wikitext_path
from sparsedecode.errors import InputError
from sparsedecode.projection.calibrate import get_calibrator, measure_keep
from sparsedecode.projection.routing import RoutingTable, build_routing_table, calibrate_routing
from sparsedecode.projection.thresholds import Thresholds, cats_projection_keep
from sparsedecode.quality.perplexity import CHUNK, DENSE, resumable_chunked_nll
from sparsedecode.records import stamp, write_record

KEEPS = (0.7, 0.5)
ROUTED_KEEP = 0.5
ROUTING_TARGETS = (0.25, 0.5, 0.75)
BOUND_CONTEXT = 2048
PROGRESS = ".ppl_progress.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--chunks", type=int, default=16, help="chunked-protocol chunks of WikiText-2 test")
    ap.add_argument("--cal-tokens", type=int, default=8192, help="validation tokens calibrating thresholds")
    ap.add_argument("--route-tokens", type=int, default=32768, help="validation tokens scoring the routing table")
    ap.add_argument("--held-out-tokens", type=int, default=16384, help="validation tokens choosing tau")
    ap.add_argument("--eval-tokens", type=int, default=8192, help="test tokens measuring the realized keep")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if not (a.out / "dense.json").exists() or _pending(a):
        run(a)
    print(comparison_table(load_records(a.out)))


def _settings() -> list[tuple[str, str, float | None, float | None]]:
    """(name, method, target keep, routing target) of every setting."""
    out = [("dense", "dense", None, None)]
    out += [(f"{m}{k:g}", m, k, None) for m in ("cats", "sats") for k in KEEPS]
    out += [(f"sats{ROUTED_KEEP:g}_route{r:g}", "sats", ROUTED_KEEP, r) for r in ROUTING_TARGETS]
    return out


def _pending(a) -> list:
    return [s for s in _settings() if not (a.out / f"{s[0]}.json").exists()]


def _label(method: str, keep, route) -> str:
    if method == "dense":
        return "dense"
    return f"{method.upper()} {keep:g}" + ("" if route is None else f" + routing {route:.0%}")


def run(a) -> None:
    t0 = time.perf_counter()
    eng = sparsedecode.load(a.model, device=a.device, dtype=a.dtype, max_len=CHUNK + 8, compile=False)
    val = text_ids(eng.tokenizer, wikitext_path("valid"))
    test = text_ids(eng.tokenizer, wikitext_path("test"))
    c, r, h = a.cal_tokens, a.route_tokens, a.held_out_tokens
    if len(val) < c + r + h:
        raise InputError(f"WikiText-2 validation has {len(val):,} tokens, fewer than --cal-tokens + "
                         f"--route-tokens + --held-out-tokens = {c + r + h:,}")
    ppl_end = a.chunks * CHUNK + 1
    if len(test) < ppl_end + a.eval_tokens:
        raise InputError(f"WikiText-2 test has {len(test):,} tokens, fewer than {a.chunks} chunks and "
                         f"--eval-tokens {a.eval_tokens:,} need ({ppl_end + a.eval_tokens:,})")
    eval_ids = test[ppl_end : ppl_end + a.eval_tokens]
    text = {"ppl": f"wiki.test.raw[:{ppl_end}]", "keep": f"wiki.test.raw[{ppl_end}:{ppl_end + a.eval_tokens}]",
            "calibration": f"wiki.valid.raw[:{c}]", "routing": f"wiki.valid.raw[{c}:{c + r}]",
            "tau": f"wiki.valid.raw[{c + r}:{c + r + h}]"}
    th_dir = a.out / "thresholds"
    th_dir.mkdir(exist_ok=True)

    thresholds, realized = {}, {}
    for method in ("cats", "sats"):
        for keep in KEEPS:
            name = f"{method}{keep:g}"
            path = th_dir / f"{name}.safetensors"
            if path.exists():
                th = Thresholds.load(path)
            else:
                print(f"calibrating {name} on {text['calibration']}", flush=True)
                th = get_calibrator(method, keep=keep).calibrate(eng, val[:c], text=text["calibration"],
                                                                 progress=True)
                th.save(path)
            thresholds[name] = th
            realized[name] = measure_keep(eng, th, eval_ids)["act_keep"]
            print(f"  {name}: realized keep {realized[name]:.4f} on {text['keep']}", flush=True)

    routed_name = f"sats{ROUTED_KEEP:g}"
    tables = {}
    base = th_dir / f"route_{routed_name}.safetensors"
    if base.exists():
        table = RoutingTable.load(base)
    else:
        print(f"scoring the routing table of {routed_name} on {text['routing']}", flush=True)
        table = build_routing_table(eng, thresholds[routed_name], val[c : c + r], progress=True,
                                    thresholds_file=str(th_dir / f"{routed_name}.safetensors"),
                                    text=text["routing"])
        table.save(base)
    for target in ROUTING_TARGETS:
        tables[target] = calibrate_routing(table, eng, val[c + r : c + r + h], target, text=text["tau"])
        tables[target].save(th_dir / f"route_{routed_name}_r{target:g}.safetensors")

    pending = _pending(a)
    settings = []
    for _name, method, keep, route in pending:
        values = None if method == "dense" else thresholds[f"{method}{keep:g}"].values
        settings.append((values, None if route is None else tables[route].sparse_of()))
    nll = resumable_chunked_nll(eng, test[:ppl_end], a.chunks, [s[0] for s in pending], settings, a.out / PROGRESS)

    dims = eng.dims
    for name, method, keep, route in pending:
        th = None if method == "dense" else thresholds[f"{method}{keep:g}"]
        real = None if th is None else realized[f"{method}{keep:g}"]
        routed = routed_cal = None
        eff = 1.0 if real is None else real
        if route is not None:
            scored = [tok for k in range(a.chunks) for tok in test[k * CHUNK + DENSE : (k + 1) * CHUNK]]
            routed = tables[route].routed_fraction(scored)
            routed_cal = tables[route].routed
            eff = routed * real + (1.0 - routed)  # SATS §3.2: r x keep_sparse + (1 - r)
        rp = cats_projection_keep(dims, eff)
        rec = stamp({
            "kind": KIND, "name": name, "label": _label(method, keep, route), "method": method,
            "target_keep": keep, "routing_target": route, "model": eng.name, "device": str(eng.device),
            "dtype": a.dtype, "runtime": "masked reference (CPU)" if eng.device.type == "cpu" else "masked reference",
            "chunks": a.chunks, "text": text, "targets_per_chunk": CHUNK - DENSE, "nll": nll[name],
            "realized_keep": real, "realized_keep_text": text["keep"], "routed": routed,
            "routed_text": "the scored positions of the perplexity chunks", "routed_calibration": routed_cal,
            "tau": None if route is None else tables[route].tau,
            "thresholds": None if th is None else {"method": th.method, "keep": th.keep,
                                                   "extras": th.extras, "calibration": th.calibration},
            "effective_act_keep": None if real is None else eff, "proj_keep": rp,
            "bound": bounds(dims, BOUND_CONTEXT, rp, 1.0).projection, "bound_context": BOUND_CONTEXT,
            "seconds": round(time.perf_counter() - t0, 1),
        })
        write_record(a.out / f"{name}.json", rec)
    (a.out / PROGRESS).unlink(missing_ok=True)


if __name__ == "__main__":
    main()
