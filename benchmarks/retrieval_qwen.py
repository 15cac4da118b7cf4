"""Passkey, multi-key and two-turn retrieval of qwen2.5-coder-0.5b, dense beside snapkv 0.2
and 0.3 and window 0.3 (ByteCross App. A 'Retrieval tests', App. G; Table 3): on CPU at 4K
tokens (docs/quality.md), and on the H200 at 16K and 32K (issue 27; the results page).

    PYTHONPATH=src python benchmarks/retrieval_qwen.py --out benchmarks/records/cpu/retrieval \
        --tests passkey,multikey
    PYTHONPATH=src python benchmarks/retrieval_qwen.py --out runs/retrieval_32k --context 32760 \
        --device cuda --dtype bfloat16 --configs dense,snapkv0.2,snapkv0.3,window0.3
    PYTHONPATH=src python benchmarks/retrieval_qwen.py --out runs/retrieval_32k --context 32760 \
        --device cuda --dtype bfloat16 --tests two-turn --configs snapkv0.2,snapkv0.3 --variant rescored
    PYTHONPATH=src python benchmarks/retrieval_qwen.py --out /tmp/smoke --model smollm2-135m \\
        --context 512 --trials 1

Prints the README's table, rebuilt from the records, at the end (alone when every record
exists). One 'retrieval_eval' record per test x configuration, `{test}_{config}.json` under --out
(`two_turn_{config}_rescored.json` for the rescored two-turn variant of App. G, which scores the
whole cache again for the second question; `kept`, the default, selects once after the first),
the same record `sparsedecode eval passkey|multikey ... --out FILE` writes (the command of
each cell is printed); a record that exists is skipped, and a test stopped midway resumes
after the placements its partial files (`.NAME.partial.jsonl` beside each record) hold, so an
interrupted run loses at most one placement (a test's pending configurations run together: one
dense prefill per placement serves them all). The model loads once.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import sparsedecode
from sparsedecode.config import KVConfig, SparsityConfig
from sparsedecode.corpus import wikitext_path
from sparsedecode.quality.retrieval import DEPTHS, evaluate_retrieval_many, partial_path
from sparsedecode.records import stamp, write_record
from sparsedecode.report.retrieval_table import load_retrieval_records, retrieval_table

TESTS = ("passkey", "multikey", "two_turn")
# name: (method, keep, selector fields beyond the observation window). snapkv0.2max pools the
# scores with a width-7 max instead of ByteCross's average (App. A), a diagnostic of the
# multi-key misses at 20% (is a code's digit run split by the averaging?).
CONFIGS = {"dense": None, "snapkv0.2": ("snapkv", 0.2, {}), "snapkv0.3": ("snapkv", 0.3, {}),
           "snapkv0.2max": ("snapkv", 0.2, {"pool_kind": "max"}), "window0.3": ("window", 0.3, {})}
OBS = 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder of the records")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens")
    ap.add_argument("--trials", type=int, default=2, help="placements per depth")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tests", default=",".join(TESTS), help="which tests run, in this order")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="which configurations run")
    ap.add_argument("--variant", default="kept", choices=("kept", "rescored"),
                    help="two-turn: select once after the first question (kept) or score again for the second")
    a = ap.parse_args()
    a.tests = [t.strip().replace("-", "_") for t in a.tests.split(",") if t.strip()]
    if not a.tests or set(a.tests) - set(TESTS):
        ap.error(f"--tests takes a comma list of {', '.join(TESTS)}; got {a.tests}")
    a.configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    if not a.configs or set(a.configs) - set(CONFIGS):
        ap.error(f"--configs takes a comma list of {', '.join(CONFIGS)}; got {a.configs}")
    cells = [(t, c) for t in a.tests for c in a.configs if not (a.out / f"{record_name(a, t, c)}.json").exists()]
    if cells:
        run(a, cells)
    print(retrieval_table(load_retrieval_records(a.out)))


def record_name(a, test: str, config: str) -> str:
    """`{test}_{config}`, with `_rescored` for a selection under the rescored two-turn variant."""
    rescored = test == "two_turn" and a.variant == "rescored" and CONFIGS[config] is not None
    return f"{test}_{config}" + ("_rescored" if rescored else "")


def run(a, cells) -> None:
    eng = sparsedecode.load(a.model, device=a.device, dtype=a.dtype, max_len=a.context + 8, compile=False)
    for test in a.tests:
        names = [c for t, c in cells if t == test]
        if not names:
            continue
        configs = []
        for name in names:
            kv = CONFIGS[name]
            flags = "" if kv is None else f" --kv {kv[0]} --kv-keep {kv[1]:g}"
            flags += "".join(f" --kv-param {k}={v}" for k, v in ({} if kv is None else kv[2]).items())
            if test == "two_turn" and kv is not None:
                flags += f" --variant {a.variant}"
            print(f"sparsedecode eval {test.replace('_', '-')} -m {a.model} --context {a.context} --trials {a.trials}{flags} "
                  f"--device {a.device} --dtype {a.dtype} --out {a.out / f'{record_name(a, test, name)}.json'}", flush=True)
            configs.append(SparsityConfig(kv=None if kv is None else KVConfig(kv[0], kv[1], {"window": OBS, **kv[2]})))
        t0 = time.perf_counter()
        partials = [partial_path(a.out / f"{record_name(a, test, name)}.json") for name in names]  # an interrupted run resumes
        recs = evaluate_retrieval_many(eng, test, configs, context=a.context, depths=DEPTHS, trials=a.trials,
                                       variant=a.variant if test == "two_turn" else None,
                                       text_path=wikitext_path("test") if test != "passkey" else None,
                                       progress=True, partials=partials)
        seconds = round(time.perf_counter() - t0, 2)
        for name, rec in zip(names, recs, strict=True):
            rec["seconds"] = seconds  # of this run of the test (its configurations share the prefills)
            rec["configurations_together"] = names
            write_record(a.out / f"{record_name(a, test, name)}.json", stamp(rec))
            d, c = rec["dense"], rec["configured"]
            print(f"  {test}: dense {d['correct']}/{d['total']}, {name} {c['correct']}/{c['total']} "
                  f"({c['distractor']} distractor), matches dense: {rec['matches_dense']}", flush=True)
        for p in partials:
            p.unlink(missing_ok=True)
        print(f"  {seconds:.0f} s", flush=True)

if __name__ == "__main__":
    main()
