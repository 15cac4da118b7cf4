"""The CATS / SATS / routed-SATS comparison table, rebuilt from 'mlp_sparsity_eval' records
(SATS paper §3.1, §3.2, §4: CATS and SATS at matched realized sparsity, static SATS against
SATS with token routing at 25/50/75% targets).

A record holds one setting's per-chunk NLLs on the chunked WikiText-2 protocol, its realized
MLP keep on held-out text, its routed fraction and its byte bound; the intervals are paired
bootstrap intervals over chunks (`quality.bootstrap`), against dense and, for SATS, against
CATS at the same target keep. Nothing here is measured.
"""

from __future__ import annotations

from pathlib import Path

from sparsedecode.errors import InputError
from sparsedecode.quality.bootstrap import RESAMPLES, paired_bootstrap, ppl_interval
from sparsedecode.report import finetune_table
from sparsedecode.report.finetune_table import KIND, fmt_interval


def load_records(folder: str | Path) -> list[dict]:
    """The comparison records of a folder ('dense' first, then CATS, SATS, routed)."""
    return finetune_table.load(folder, run="benchmarks/sats_vs_cats.py")


def _fmt(iv, digits: int = 3, sign: bool = False) -> str:
    return fmt_interval(iv, sign=sign, digits=digits)


def comparison_table(records: list[dict], resamples: int = RESAMPLES, seed: int = 0) -> str:
    """Markdown: one row per setting. PPL with its interval; ΔPPL against dense, and for
    SATS (static or routed) against CATS at the same target keep, each a paired bootstrap
    over chunks; realized keep of the SiLU(gate) channels and routed fraction on held-out
    text; the byte bound of the decode step at the record's context."""
    by = {r["name"]: r for r in records}
    dense = by.get("dense")
    if dense is None:
        raise InputError("no dense record: the table prices every setting against dense")
    targets = dense["targets_per_chunk"]
    ident = ("model", "chunks", "text")
    rows = ["| setting | target keep | realized keep | routed (held-out) | PPL [95%] | ΔPPL vs dense [95%] "
            "| Δ vs CATS [95%] | bound |", "|---|---|---|---|---|---|---|---|"]
    for r in records:
        for f in ident:
            if r.get(f) != dense.get(f):
                raise InputError(f"record {r['name']} differs from dense in {f!r}: "
                                 "tabulate one run's records")
        ppl = ppl_interval(r["nll"], targets, resamples, seed)
        delta = "" if r is dense else _fmt(paired_bootstrap(dense["nll"], r["nll"], targets, resamples,
                                                           seed).delta, sign=True)
        vs = ""
        cats = by.get(f"cats{r['target_keep']:g}") if r["method"] == "sats" else None
        if cats is not None:
            vs = _fmt(paired_bootstrap(cats["nll"], r["nll"], targets, resamples, seed).delta, sign=True)
        keep = "" if r["method"] == "dense" else f"{r['target_keep']:g}"
        real = "" if r.get("realized_keep") is None else f"{r['realized_keep']:.3f}"
        routed = "" if r.get("routed") is None else f"{r['routed']:.3f} (target {r['routing_target']:g})"
        rows.append(f"| {r['label']} | {keep} | {real} | {routed} | {_fmt(ppl)} | {delta} | {vs} "
                    f"| {r['bound']:.3f}× |")
    return "\n".join(rows)


__all__ = ["KIND", "comparison_table", "load_records"]
