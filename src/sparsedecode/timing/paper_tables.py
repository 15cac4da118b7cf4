"""The numbers behind the paper's Table 2 and Figure 6 (left) on our records; `report/crossings.py`
renders them.

`crossing_row`: one row per crossing campaign (ByteCross App. E): the byte crossover at the
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

from sparsedecode.account import bounds
from sparsedecode.errors import InputError
from sparsedecode.timing import stats
from sparsedecode.timing.analysis import build_report
from sparsedecode.timing.cells import load_cells
from sparsedecode.timing.costs import BOUND_OF_MODE, cell_bytes


def crossing_row(folder) -> dict:
    """One Table 2 row of a crossing campaign folder (ours): its group holding one proj and one sel cell."""
    from sparsedecode.timing.campaign import plan
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


def keep_costs(folder) -> dict[tuple[str, float, float], dict]:
    """(mode, proj keep, KV keep) -> kernel costs at the campaign's one context: 'records'
    (the records' bytes, None where they have none) and 'nominal' (the account at the nominal
    keeps), each a stats.Estimate over the campaign's blocks; 'realized_keep' where recorded."""
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
        if c.mode not in BOUND_OF_MODE or d is None:
            continue
        b, bd = cell_bytes(cc, c)[0], cell_bytes(cc, d)[0]
        x = cc.extra(c)
        nominal = getattr(bounds(cc.dims, c.context, c.projection_keep, c.kv_keep), BOUND_OF_MODE[c.mode])
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


__all__ = ["crossing_row", "keep_costs"]
