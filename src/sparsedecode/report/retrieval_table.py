"""Markdown table of retrieval records (kind 'retrieval_eval'), rebuilt from records alone
(ByteCross App. A 'Retrieval tests', §5.2: a perplexity budget does not detect lost distant
information, a retrieval test does). One folder's records for docs/quality.md and
benchmarks/retrieval_qwen.py; several contexts and devices in one table (Table 3) for the
results page's `retrieval` kind."""

from __future__ import annotations

from pathlib import Path

from sparsedecode.errors import InputError
from sparsedecode.records import read_record


def load_retrieval_records(folder: str | Path) -> list[dict]:
    """The 'retrieval_eval' records of a folder, by test, then dense first, then by mode."""
    if not Path(folder).is_dir():
        raise InputError(f"{folder}: no such folder of retrieval records (write them with "
                         "sparsedecode eval passkey|multikey|two-turn --out)")
    recs = [read_record(p) for p in sorted(Path(folder).glob("*.json"))]
    recs = [r for r in recs if isinstance(r, dict) and r.get("kind") == "retrieval_eval"]
    if not recs:
        raise InputError(f"{folder}: no retrieval_eval records (write them with sparsedecode eval passkey|multikey|two-turn --out)")
    return sorted(recs, key=lambda r: (r["test"], r["config"]["mode"] != "dense", label(r)))


def label(rec: dict) -> str:
    """'dense', 'snapkv 0.2', 'teal 0.5 + snapkv 0.2', 'snapkv 0.3 (kept)' (a two-turn variant),
    ... of a record's configuration."""
    cfg = rec["config"]
    parts = []
    if cfg.get("projection"):
        parts.append(f"{cfg['projection']['method']} {cfg['projection']['keep']:g}")
    if cfg.get("kv"):
        kv = cfg["kv"]
        extra = _non_default(kv["method"], kv.get("params") or {})
        parts.append(f"{kv['method']} {kv['keep']:g}" + (f" ({extra})" if extra else ""))
    name = " + ".join(parts) or "dense"
    return f"{name} ({cfg['variant']})" if cfg.get("variant") else name


def setting(rec: dict) -> tuple[int, str, str]:
    """(context in tokens, 'CPU' or the GPU's name, dtype) a record was measured at."""
    gpu = (rec.get("env") or {}).get("gpu")
    device = "CPU" if rec["device"].startswith("cpu") else (gpu or rec["device"]).removeprefix("NVIDIA ")
    return rec["context"], device, rec["dtype"]


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
        out.append(f"{sum(p[side]['verdict'] == 'correct' for p in at)}/{len(at)}" if at else "")
    return out


def _kept(placements: list[dict]) -> str:
    """'0.97 (wrong: 0.71, 0.85)': mean needle tokens kept, and at the wrong answers."""
    kept = [p["configured"].get("needle_kept") for p in placements]
    if any(k is None for k in kept):
        return ""
    wrong = [k["tokens"] for p, k in zip(placements, kept, strict=True) if p["configured"]["verdict"] != "correct"]
    mean = sum(k["tokens"] for k in kept) / len(kept)
    return f"{mean:.2f}" + (f" (wrong: {', '.join(f'{w:.2f}' for w in wrong)})" if wrong else "")


def retrieval_table(records: list[dict], settings: bool = False) -> str:
    """One row per test and configuration, plus one dense row per test (the dense half of its
    records, which every record of a test shares): correct answers per depth, distractor and
    miss counts, whether the configuration answers every placement dense answers, for a
    window how many placements have a needle token inside it, and for a scored selection
    the mean fraction of needle tokens it kept over layers and KV heads (`needle_kept`), with
    that fraction at each placement it answered wrong. With `settings`, rows are grouped by
    the context, device and dtype of their records (in the order they first come), which lead
    each row, so runs at several contexts or on several devices share one table."""
    if not records:
        raise InputError("no retrieval records to tabulate")
    depths = sorted({d for r in records for d in r["depths"]})
    lead = "| context | device | dtype " if settings else ""
    head = (lead + "| test | configuration | " + " | ".join(f"depth {d:g}" for d in depths)
            + " | correct | distractor | miss | matches dense | needle in window | needle tokens kept |")
    rows = [head, "|---" * (3 * settings) + "|---|---|" + "---|" * (len(depths) + 6)]
    keys = list(dict.fromkeys(setting(r) if settings else () for r in records))
    for key in keys:
        group = [r for r in records if (setting(r) if settings else ()) == key]
        at = "" if not key else f" at {key[0]:,} tokens on {key[1]}, {key[2]}"
        lead = "" if not key else f"| {key[0]:,} | {key[1]} | {key[2]} "
        for test in sorted({r["test"] for r in group}):
            rows += _test_rows([r for r in group if r["test"] == test], depths, lead, f"the {test} records{at}")
    return "\n".join(rows)


def _placed(rec: dict) -> list[tuple]:
    """What a record's placements put where: depth, trial, expected answer, needle span, key asked."""
    return [(p["depth"], p["trial"], p["expected"], tuple(p.get("needle_span") or ()), p.get("asked"))
            for p in rec["placements"]]


def _dense_row(rec: dict, depths: list[float], lead: str, name: str) -> str:
    d = rec["dense"]
    return (lead + f"| {rec['test']} | {name} | " + " | ".join(_cells(rec["placements"], depths, "dense"))
            + f" | {d['correct']}/{d['total']} | {d.get('distractor', '')} | {d.get('miss', '')} | | | |")


def _test_rows(recs: list[dict], depths: list[float], lead: str, what: str) -> list[str]:
    """The dense row of one test's records (the first record's dense half), then one row per
    configuration. Records of other placements are refused. Records of the same placements
    whose dense answers differ (separate processes, where bf16 numerics can flip a borderline
    answer) each get their own dense row, `dense (beside ...)`, before their configuration's
    row, so its 'matches dense' column is read against the dense it was decoded beside."""
    first = recs[0]
    test = first["test"]
    rows = [_dense_row(first, depths, lead, "dense")]
    for r in recs:
        if r["config"]["mode"] == "dense":
            continue
        if _placed(r) != _placed(first):
            raise InputError(f"{what} disagree on their placements: different model, seed or "
                             "context; tabulate one run's records")
        if [p["dense"]["output"] for p in r["placements"]] != [p["dense"]["output"] for p in first["placements"]]:
            rows.append(_dense_row(r, depths, lead, f"dense (beside {label(r)})"))
        c = r["configured"]
        inside = [p["configured"]["in_window"] for p in r["placements"]]
        win = "" if all(x is None for x in inside) else f"{sum(bool(x) for x in inside)}/{len(inside)}"
        rows.append(lead + f"| {test} | {label(r)} | " + " | ".join(_cells(r["placements"], depths, "configured"))
                    + f" | {c['correct']}/{c['total']} | {c['distractor']} | {c['miss']} "
                    f"| {'yes' if r['matches_dense'] else 'no'} | {win} | {_kept(r['placements'])} |")
    return rows
