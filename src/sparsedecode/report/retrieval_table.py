"""Markdown table of retrieval records (kind 'retrieval_eval'), rebuilt from records alone
(ByteCross App. A 'Retrieval tests', §5.2: a perplexity budget does not detect lost distant
information, a retrieval test does)."""

from __future__ import annotations

from pathlib import Path

from sparsedecode.errors import InputError
from sparsedecode.records import read_record


def load_retrieval_records(folder: str | Path) -> list[dict]:
    """The 'retrieval_eval' records of a folder, by test, then dense first, then by mode."""
    recs = [read_record(p) for p in sorted(Path(folder).glob("*.json"))]
    recs = [r for r in recs if isinstance(r, dict) and r.get("kind") == "retrieval_eval"]
    if not recs:
        raise InputError(f"{folder}: no retrieval_eval records (write them with sparsedecode eval passkey|multikey)")
    return sorted(recs, key=lambda r: (r["test"], r["config"]["mode"] != "dense", label(r)))


def label(rec: dict) -> str:
    """'dense', 'snapkv 0.2', 'teal 0.5 + snapkv 0.2', ... of a record's configuration."""
    cfg = rec["config"]
    parts = []
    if cfg.get("projection"):
        parts.append(f"{cfg['projection']['method']} {cfg['projection']['keep']:g}")
    if cfg.get("kv"):
        kv = cfg["kv"]
        extra = _non_default(kv["method"], kv.get("params") or {})
        parts.append(f"{kv['method']} {kv['keep']:g}" + (f" ({extra})" if extra else ""))
    if cfg.get("variant"):
        parts.append(f"({cfg['variant']})")
    return " + ".join(parts) or "dense"


def _non_default(method: str, params: dict) -> str:
    """'pool_kind max, window 32': the selector fields a record sets away from their defaults."""
    from dataclasses import fields

    from sparsedecode.kv.select import SELECTORS

    try:
        defaults = {f.name: f.default for f in fields(SELECTORS[method])}
    except (KeyError, InputError):
        defaults = {}
    return ", ".join(f"{k} {v}" for k, v in sorted(params.items()) if defaults.get(k, object()) != v)


def _cells(placements: list[dict], depths: list[float], side: str) -> list[str]:
    out = []
    for d in depths:
        at = [p for p in placements if p["depth"] == d]
        out.append(f"{sum(p[side]['verdict'] == 'correct' for p in at)}/{len(at)}")
    return out


def _kept(placements: list[dict]) -> str:
    """'0.97 (wrong: 0.71, 0.85)': mean needle tokens kept, and at the wrong answers."""
    kept = [p["configured"].get("needle_kept") for p in placements]
    if any(k is None for k in kept):
        return ""
    wrong = [k["tokens"] for p, k in zip(placements, kept, strict=True) if p["configured"]["verdict"] != "correct"]
    mean = sum(k["tokens"] for k in kept) / len(kept)
    return f"{mean:.2f}" + (f" (wrong: {', '.join(f'{w:.2f}' for w in wrong)})" if wrong else "")


def retrieval_table(records: list[dict]) -> str:
    """One row per test and configuration, plus one dense row per test (the dense half of its
    records, which every record of a test shares): correct answers per depth, distractor and
    miss counts, whether the configuration answers every placement dense answers, for a
    window how many placements have a needle token inside it, and for a scored selection
    the mean fraction of needle tokens it kept over layers and KV heads (`needle_kept`), with
    that fraction at each placement it answered wrong."""
    if not records:
        raise InputError("no retrieval records to tabulate")
    depths = sorted({d for r in records for d in r["depths"]})
    head = ("| test | configuration | " + " | ".join(f"depth {d:g}" for d in depths)
            + " | correct | distractor | miss | matches dense | needle in window | needle tokens kept |")
    rows = [head, "|---|---|" + "---|" * (len(depths) + 6)]
    for test in sorted({r["test"] for r in records}):
        recs = [r for r in records if r["test"] == test]
        first = recs[0]
        d = first["dense"]
        rows.append(f"| {test} | dense | " + " | ".join(_cells(first["placements"], depths, "dense"))
                    + f" | {d['correct']}/{d['total']} | {d.get('distractor', '')} | {d.get('miss', '')} | | | |")
        for r in recs:
            if r["config"]["mode"] == "dense":
                continue
            if [p["dense"]["output"] for p in r["placements"]] != [p["dense"]["output"] for p in first["placements"]]:
                raise InputError(f"the {test} records disagree on dense answers: different placements, "
                                 "model or seed; tabulate one run's records")
            c = r["configured"]
            inside = [p["configured"]["in_window"] for p in r["placements"]]
            win = "" if all(x is None for x in inside) else f"{sum(bool(x) for x in inside)}/{len(inside)}"
            rows.append(f"| {test} | {label(r)} | " + " | ".join(_cells(r["placements"], depths, "configured"))
                        + f" | {c['correct']}/{c['total']} | {c['distractor']} | {c['miss']} "
                        f"| {'yes' if r['matches_dense'] else 'no'} | {win} | {_kept(r['placements'])} |")
    return "\n".join(rows)
