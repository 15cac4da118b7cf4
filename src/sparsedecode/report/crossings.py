"""The paper's Table 2 and Figure 6 (left) on our records: crossings beside their committed
predictions, and kernel costs against keep beside the paper's A100 values.

`crossings_table`: one row per crossing campaign (ByteCross App. E): the byte crossover at the
realized keeps (Eq. 5), the cost-aware prediction committed before the campaign ran
(`prediction.json`, App. D), the measured crossing with its interval over block resamples, how
far the prediction landed from it, and how many of the campaign's cells have run.

`keep_costs`: c_b = t_b - t_D B_b / B_D at each keep of a keep-ratio campaign (App. D, Table 10),
with B_b / B_D from the records' bytes (realized keeps) and from the byte account at the nominal
keep; the paper's records carry no bytes, so their costs are on nominal keeps only, and a
like-for-like comparison reads the nominal columns.
"""

from __future__ import annotations

from pathlib import Path

from sparsedecode.errors import InputError
from sparsedecode.timing import stats


def _fmt_k(x: float | None) -> str:
    return "" if x is None else f"{x / 1024:.1f}K"


def crossing_row(folder) -> dict:
    """One Table 2 row of a crossing campaign folder (ours): its group holding one proj and one sel cell."""
    from sparsedecode.report.timing_report import build_report
    from sparsedecode.timing.campaign import plan
    from sparsedecode.timing.cells import load_cells
    from sparsedecode.timing.spec import load_spec

    spec_file = Path(folder) / "spec.toml"
    if not (Path(folder) / "cells").is_dir():
        return _not_run(Path(folder))
    cc = load_cells(folder)
    rep = build_report(cc)
    found = [g for g in rep["groups"] if g["crossing"] and g["crossing"]["proj"] and g["crossing"]["sel"]]
    if len(found) != 1:
        raise InputError(f"{folder}: needs one group with one proj and one sel cell, found {len(found)}")
    g = found[0]
    x = g["crossing"]
    spec = {r["cell"]: r["mode_spec"] for r in g["rows"]}
    committed = x.get("committed")
    if committed is None:
        raise InputError(f"{folder}: no prediction.json for {spec[x['proj']]}/{spec[x['sel']]}; a crossing "
                         "campaign's prediction is committed before it runs (`campaign plan-crossing`)")
    planned = len(plan(load_spec(spec_file))) if spec_file.is_file() else None
    m = x["measured"]
    blocks = max((r["blocks"] for r in x["rows"]), default=0)
    miss = None if m is None or m["value"] != m["value"] else committed["tokens"] - m["value"]
    return {"folder": str(folder), "model": rep["model"], "gpu": rep["gpu"], "proj": spec[x["proj"]],
            "sel": spec[x["sel"]], "byte_crossover": (x["byte_crossover"] or {}).get("tokens"),
            "predicted": committed["tokens"], "measured": m, "blocks": blocks, "miss": miss,
            "cells": len(cc.cells), "planned": planned, "note": x["note"]}


def _not_run(folder: Path) -> dict:
    """The row of a crossing campaign whose cells have not run: its committed prediction alone."""
    from sparsedecode.records import read_record

    pred_file = folder / "prediction.json"
    if not pred_file.is_file():
        raise InputError(f"{folder}: neither cells/ nor prediction.json (a crossing campaign folder of ours)")
    pred = read_record(pred_file)
    return {"folder": str(folder), "model": pred.get("model"), "gpu": pred.get("gpu"), "proj": pred["proj"],
            "sel": pred["sel"], "byte_crossover": pred.get("byte_crossover_tokens"),
            "predicted": pred["predicted_tokens"], "measured": None, "blocks": 0, "miss": None, "cells": 0,
            "planned": None, "note": "not run yet"}


def crossings_table(folders) -> str:
    """Table 2 (ours): every crossing campaign folder, one row each."""
    lines = ["| model | pair | byte crossover | prediction (committed first) | measured crossing [95%] | "
             "blocks | prediction − measured | cells run |", "|---|---|---|---|---|---|---|---|"]
    notes = []
    for f in folders:
        r = crossing_row(f)
        m = r["measured"]
        meas = "" if m is None or m["value"] != m["value"] else (
            f"{_fmt_k(m['value'])} [{_fmt_k(m['low'])}, {_fmt_k(m['high'])}]")
        miss = "" if r["miss"] is None else f"{r['miss'] / 1024:+.1f}K"
        ran = f"{r['cells']}" + ("" if r["planned"] is None else f" of {r['planned']}")
        if r["cells"] == 0:
            notes.append(f"{r['proj']} / {r['sel']}: not run yet (its prediction is committed)")
        lines.append(f"| {r['model']} | {r['proj']} / {r['sel']} | {_fmt_k(r['byte_crossover'])} | "
                     f"{_fmt_k(r['predicted'])} | {meas} | {r['blocks']} | {miss} | {ran} |")
        if r["planned"] is not None and r["cells"] < r["planned"]:
            notes.append(f"{r['proj']} / {r['sel']}: partial ({r['cells']} of {r['planned']} cells), so its "
                         "measured crossing is not final" + (f"; {r['note']}" if r["note"] else ""))
    if notes:
        lines += ["", "Not final: " + "; ".join(notes) + "."]
    return "\n".join(lines)


def keep_costs(folder) -> dict[tuple[str, float, float], dict]:
    """(mode, proj keep, KV keep) -> kernel costs at the campaign's one context: 'records'
    (the records' bytes, None where they have none) and 'nominal' (the account at the nominal
    keeps), each a stats.Estimate over the campaign's blocks; 'realized_keep' where recorded."""
    from sparsedecode.account import bounds
    from sparsedecode.report.timing_report import _BOUND_OF_MODE, cell_bytes
    from sparsedecode.timing.cells import load_cells

    cc = load_cells(folder)
    if cc.dims is None:
        raise InputError(f"{folder}: {cc.dims_note}; kernel costs need the byte account")
    cells = cc.paired()
    contexts = {c.context for c in cells}
    if len(contexts) != 1:
        raise InputError(f"{folder}: a keep-ratio campaign runs at one context, found {sorted(contexts)}")
    dense = {(c.group, c.block): c for c in cells if c.mode == "dense"}
    per: dict[tuple[str, float, float], dict[str, list]] = {}
    for c in cells:
        d = dense.get((c.group, c.block))
        if c.mode not in _BOUND_OF_MODE or d is None:
            continue
        b, bd = cell_bytes(cc, c)[0], cell_bytes(cc, d)[0]
        x = cc.extra(c)
        nominal = getattr(bounds(cc.dims, c.context, c.projection_keep, c.kv_keep), _BOUND_OF_MODE[c.mode])
        e = per.setdefault((c.mode, c.projection_keep, c.kv_keep), {"records": [], "nominal": [], "keep": []})
        e["nominal"].append(float(stats.kernel_cost(c.ms_per_token, d.ms_per_token, 1 / nominal)))
        if x.bytes_per_step is not None and cc.extra(d).bytes_per_step is not None:
            e["records"].append(float(stats.kernel_cost(c.ms_per_token, d.ms_per_token, b / bd)))
        if x.realized_projection_keep is not None:
            e["keep"].append(x.realized_projection_keep)
    (n,) = contexts
    return {k: {"records": stats.resampled_mean(v["records"]) if len(v["records"]) == len(v["nominal"]) else None,
                "nominal": stats.resampled_mean(v["nominal"]), "blocks": len(v["nominal"]),
                "realized_keep": sum(v["keep"]) / len(v["keep"]) if v["keep"] else None, "context": n}
            for k, v in sorted(per.items())}


def keep_costs_table(ours, paper=None) -> str:
    """c_b against keep on our GPU beside the paper's (Figure 6 left, its keep_a100 records)."""
    mine = keep_costs(ours)
    theirs = keep_costs(paper) if paper else {}
    est = lambda e: "" if e is None else f"{e.value:.3f} [{e.low:.3f}, {e.high:.3f}]"  # noqa: E731
    lines = ["| branch | keep | ours: c_b ms [95%], realized bytes | ours: c_b ms, nominal-keep bytes | "
             "realized proj keep | paper A100: c_b ms, nominal-keep bytes |", "|---|---|---|---|---|---|"]
    keys = sorted(set(mine) | {k for k in theirs if k[0] in ("proj", "sel")},
                  key=lambda k: (("proj", "sel", "both").index(k[0]), -k[1], -k[2]))
    for k in keys:
        mode, p, kv = k
        keep = {"proj": f"{p:g}", "sel": f"{kv:g}", "both": f"{p:g} / {kv:g}"}[mode]
        a, b = mine.get(k), theirs.get(k)
        rk = "" if a is None or a["realized_keep"] is None or mode == "sel" else f"{a['realized_keep']:.3f}"
        lines.append(f"| {mode} | {keep} | {est(a and a['records'])} | {est(a and a['nominal'])} | {rk} | "
                     f"{est(b and b['nominal'])} |")
    return "\n".join(lines)


__all__ = ["crossing_row", "crossings_table", "keep_costs", "keep_costs_table"]
