"""Markdown table of chunked-perplexity records (kind 'ppl_chunked'), rebuilt from records alone."""

from __future__ import annotations

import json
from pathlib import Path

from sparsedecode.quality.perplexity import pooled_ppl
from sparsedecode.records import read_record


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
