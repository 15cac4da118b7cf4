"""The fine-tuned setting against the training-free one (SATS paper §4 'Fine-tuned model
performance', Tables 3, 4 and 7), rebuilt from 'mlp_sparsity_eval' records of one run
(`benchmarks/finetune_sparse.py`): dense, CATS and SATS training-free, the same thresholds with a
LoRA adapter fine-tuned under them, the fine-tuned SATS routed, and the dense model with an
adapter trained the same way (the control: what the text alone gives).

Every record holds its per-chunk NLLs on the same chunks, so each comparison is a paired
bootstrap over chunks (`quality.bootstrap`): ΔPPL against dense, and for a fine-tuned setting
against its training-free namesake (the record's `adapter.training_free`). 'gap closed' is the
share of the training-free setting's ΔPPL against dense that the fine-tuned one removes,
(PPL_free - PPL_tuned) / (PPL_free - PPL_dense), point estimates, for the static settings (a routed
row's Δ mixes routing and fine-tuning). 'Δ vs dense + LoRA' sets each tuned setting beside the dense
model tuned the same way (record `dense_ft`): what sparsity still costs once both saw the text.
Nothing here is measured.
"""

from __future__ import annotations

from pathlib import Path

from sparsedecode.errors import InputError
from sparsedecode.quality.bootstrap import RESAMPLES, Interval, paired_bootstrap, ppl_interval
from sparsedecode.records import read_record

KIND = "mlp_sparsity_eval"
IDENTITY = ("model", "chunks", "text", "targets_per_chunk")


def load(folder: str | Path, run: str = "benchmarks/finetune_sparse.py") -> list[dict]:
    """The evaluation records of a folder, in table order: dense, then each method training-free
    before its fine-tuned forms, routed last (also the order of `benchmarks/mlp_table.py`, whose
    records carry no adapter). `run`: the command that writes them, for the error."""
    recs = [read_record(p) for p in sorted(Path(folder).glob("*.json"))]
    recs = [r for r in recs if isinstance(r, dict) and r.get("kind") == KIND]
    if not recs:
        raise InputError(f"{folder}: no {KIND} records (run {run} --out {folder})")
    order = {"dense": 0, "cats": 1, "sats": 2}
    return sorted(recs, key=lambda r: (order.get(r.get("method"), 3), -(r.get("target_keep") or 1.0),
                                       r.get("adapter") is not None, r.get("routing_target") or 0.0))


def fmt_interval(iv: Interval, sign: bool = False, digits: int = 2) -> str:
    """'point [low, high]' of a bootstrap interval."""
    f = f"{{:{'+' if sign else ''}.{digits}f}}"
    return f"{f.format(iv.point)} [{f.format(iv.low)}, {f.format(iv.high)}]"


def rows(records: list[dict], resamples: int = RESAMPLES, seed: int = 0) -> list[dict]:
    """One dict per record: label, PPL interval, Δ against dense, Δ against its training-free
    setting (fine-tuned ones), the gap closed, realized keep, routed fraction, bound."""
    by = {r["name"]: r for r in records}
    dense = by.get("dense")
    if dense is None:
        raise InputError("no dense record: every setting is priced against dense")
    targets = dense["targets_per_chunk"]
    out = []
    for r in records:
        for f in IDENTITY:
            if r.get(f) != dense.get(f):
                raise InputError(f"record {r['name']} differs from dense in {f!r}: tabulate one run's records")
        ppl = ppl_interval(r["nll"], targets, resamples, seed)
        row = {"name": r["name"], "label": r["label"], "ppl": ppl, "vs_dense": None, "vs_free": None,
               "gap_closed": None, "free": None, "realized_keep": r.get("realized_keep"),
               "routed": r.get("routed"), "routing_target": r.get("routing_target"), "bound": r.get("bound"),
               "final_loss": (r.get("adapter") or {}).get("final_loss")}
        if r is not dense:
            row["vs_dense"] = paired_bootstrap(dense["nll"], r["nll"], targets, resamples, seed).delta
        control = by.get("dense_ft")  # the dense model with an adapter trained the same way
        row["vs_control"] = None
        if control is not None and r.get("adapter") is not None and r is not control:
            row["vs_control"] = paired_bootstrap(control["nll"], r["nll"], targets, resamples, seed).delta
        free = by.get((r.get("adapter") or {}).get("training_free"))
        if free is not None and free is not r:
            row["free"] = free["label"]
            row["vs_free"] = paired_bootstrap(free["nll"], r["nll"], targets, resamples, seed).delta
            p_free = ppl_interval(free["nll"], targets, resamples, seed).point
            p_dense = ppl_interval(dense["nll"], targets, resamples, seed).point
            if free is not dense and r.get("routing_target") is None and p_free > p_dense:
                row["gap_closed"] = (p_free - ppl.point) / (p_free - p_dense)
        out.append(row)
    return out


def markdown(records: list[dict], resamples: int = RESAMPLES, seed: int = 0) -> str:
    lines = ["| setting | realized keep | routed (target) | PPL [95%] | ΔPPL vs dense [95%] "
             "| Δ vs training-free [95%] | gap closed | Δ vs dense + LoRA [95%] | final train loss | bound |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for w in rows(records, resamples, seed):
        keep = "" if w["realized_keep"] is None else f"{w['realized_keep']:.3f}"
        routed = "" if w["routed"] is None else f"{w['routed']:.3f} ({w['routing_target']:g})"
        vd = "" if w["vs_dense"] is None else fmt_interval(w["vs_dense"], sign=True)
        vf = "" if w["vs_free"] is None else f"{fmt_interval(w['vs_free'], sign=True)} vs {w['free']}"
        gap = "" if w["gap_closed"] is None else f"{w['gap_closed']:.0%}"
        loss = "" if w["final_loss"] is None else f"{w['final_loss']:.3f}"
        bound = "" if w["bound"] is None else f"{w['bound']:.3f}×"
        vc = "" if w["vs_control"] is None else fmt_interval(w["vs_control"], sign=True)
        lines.append(f"| {w['label']} | {keep} | {routed} | {fmt_interval(w['ppl'])} | {vd} | {vf} | {gap} | {vc} | {loss} "
                     f"| {bound} |")
    return "\n".join(lines)


__all__ = ["fmt_interval", "KIND", "load", "markdown", "rows"]
