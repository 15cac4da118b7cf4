"""Chunked WikiText-2 perplexity of the projection branch on CPU (issue 4 acceptance).

For one model (smollm2-135m by default): dense, TEAL uniform at 0.7 and 0.5,
TEAL greedy at 0.5 and CATS at 0.5, each calibrated on WikiText-2 validation,
its realized keep measured (masked) on the first tokens of WikiText-2 test, and
its chunked perplexity (quality/perplexity.py; 16 chunks of 2,048 tokens here)
scored under the masked reference. One record per configuration; the table is
rebuilt from the records.

    PYTHONPATH=src python benchmarks/ppl_projection.py --out benchmarks/records/cpu/ppl
    PYTHONPATH=src python benchmarks/ppl_projection.py --out benchmarks/records/cpu/ppl --table-only
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from sparsedecode.quality.perplexity import pooled_ppl
from sparsedecode.records import read_record

CONFIGS = [  # label, method, params
    ("dense", "dense", {}),
    ("teal 0.7 uniform", "teal", {"keep": 0.7}),
    ("teal 0.5 uniform", "teal", {"keep": 0.5}),
    ("teal 0.5 greedy", "teal", {"keep": 0.5, "greedy": True}),
    ("cats 0.5", "cats", {"keep": 0.5}),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--keep-tokens", type=int, default=4096, help="test tokens for the realized keep")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--table-only", action="store_true")
    a = ap.parse_args()

    if not a.table_only:
        run(a)
    print(ppl_table(load_ppl_records(a.out)))


def load_ppl_records(folder: str | Path) -> list[dict]:
    """The 'ppl_chunked' records of a folder, dense first, then by label."""
    recs = [read_record(p) for p in sorted(Path(folder).glob("*.json"))]
    recs = [r for r in recs if r["kind"] == "ppl_chunked"]
    return sorted(recs, key=lambda r: (r["config"]["method"] != "dense", r["label"]))


def ppl_table(records: list[dict]) -> str:
    """Label, realized keep, pooled PPL and its difference to the dense record of the same text."""
    dense = {json.dumps(r["text"], sort_keys=True): r for r in records if r["config"]["method"] == "dense"}
    rows = [
        "| configuration | realized keep | chunked PPL | ΔPPL vs dense | runtime |",
        "|---|---|---|---|---|",
    ]
    for r in records:
        ppl = pooled_ppl(r["nll_per_chunk"], r["targets_per_chunk"])
        d = dense.get(json.dumps(r["text"], sort_keys=True))
        delta = "" if d is None or d is r else f"{ppl - pooled_ppl(d['nll_per_chunk'], d['targets_per_chunk']):+.3f}"
        keep = r.get("realized_keep")
        rows.append(
            f"| {r['label']} | {'' if keep is None else f'{keep:.3f}'} | {ppl:.3f} | {delta} "
            f"| {r['runtime']} |"
        )
    return "\n".join(rows)


def run(a) -> None:
    import sparsedecode
    from sparsedecode.corpus import wikitext_ids
    from sparsedecode.projection.calibrate import get_calibrator, measure_keep
    from sparsedecode.quality.perplexity import CHUNK, DENSE, chunked_nll
    from sparsedecode.records import stamp, write_record

    torch.set_num_threads(a.threads)
    eng = sparsedecode.load(a.model, device="cpu", dtype="float32", max_len=CHUNK)
    valid = wikitext_ids(eng.tokenizer, "valid")
    test = wikitext_ids(eng.tokenizer, "test")
    run_id = time.strftime("%Y%m%dT%H%M%S")
    for label, method, params in CONFIGS:
        path = a.out / f"ppl_{a.model}_{label.replace(' ', '_')}_{a.chunks}chunks.json"
        if path.exists():  # resumable: a finished configuration is never redone
            print(f"{label}: record exists, skipped")
            continue
        t0 = time.perf_counter()
        table, keep, header = None, None, None
        if method != "dense":
            th = get_calibrator(method, **params).calibrate(
                eng, valid[: a.calib_tokens], text=f"wiki.valid.raw[:{a.calib_tokens}]")
            m = measure_keep(eng, th, test[: a.keep_tokens])
            table, keep, header = th.values, m["keep"], th.header()
        nll = chunked_nll(eng, test, chunks=a.chunks, table=table, progress=True)
        rec = stamp({
            "kind": "ppl_chunked", "label": label, "device": "CPU",
            "runtime": "dense" if method == "dense" else "masked reference (CPU)",
            "model": {"name": eng.name, "source": str(eng.source_path), "dims": eng.dims.to_dict()},
            "dtype": "float32", "config": {"method": method, **params},
            "thresholds": header, "realized_keep": keep,
            "realized_keep_text": f"wiki.test.raw[:{a.keep_tokens}]" if keep is not None else None,
            "text": {"file": "wiki.test.raw", "chunks": a.chunks, "chunk": CHUNK, "dense_prefix": DENSE},
            "targets_per_chunk": CHUNK - DENSE, "nll_per_chunk": nll,
            "seconds": time.perf_counter() - t0, "run_id": run_id,
        })
        write_record(path, rec)
        print(f"{label}: done in {rec['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
