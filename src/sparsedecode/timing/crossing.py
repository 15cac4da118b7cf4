"""Crossings of a projection and a selection cell (ByteCross §4.3, App. D, App. E, Table 2).

`group_crossing`: for a group holding one proj and one sel cell at several contexts, the paired
difference t_proj - t_sel per context, the measured crossing with its interval over block
resamples (App. E), the byte crossover n* at the realized keeps (Eq. 5), the cost-aware predicted
crossing with its difference curve (App. D) and the prediction committed before the campaign ran
(`prediction.json`). The prediction takes t_D and the costs from a group that holds dense cells:
the group itself, or else a group of the same folder with the same keeps (the paper predicts its
crossing campaigns from its sweeps the same way).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from sparsedecode.account import crossover, crossover_batched
from sparsedecode.errors import InputError
from sparsedecode.timing import stats
from sparsedecode.timing.cells import CampaignCells
from sparsedecode.timing.costs import cell_bytes
from sparsedecode.timing.paper import PaperCell


def _one_cell(cells: list[PaperCell], mode: str) -> tuple[str | None, str]:
    names = sorted({c.cell for c in cells if c.mode == mode})
    if len(names) == 1:
        return names[0], ""
    return None, f"needs one cell of mode '{mode}', found {names or 'none'}"


def _realized(rows: list[dict], cell: str, key: str, nominal_key: str) -> tuple[float, bool]:
    mine = [r for r in rows if r["cell"] == cell]
    realized = stats.mean_of(r[key] for r in mine)
    return (realized, True) if realized is not None else (mine[0][nominal_key], False)


def _byte_crossover(cc: CampaignCells, rows: list[dict], proj: str, sel: str) -> dict | None:
    """n* of Eq. 5 at the keeps the cells realized (nominal where the records do not say)."""
    if cc.dims is None:
        return None
    batch = rows[0].get("batch", 1) if rows else 1
    key = "realized_union" if batch > 1 else "realized_projection_keep"  # a batch reads the union (§3.3)
    rp, rp_real = _realized(rows, proj, key, "projection_keep")
    rkv, rkv_real = _realized(rows, sel, "kv_read_fraction", "kv_keep")
    try:
        n = (crossover_batched(cc.dims, min(rp, 1.0), min(rkv, 1.0), batch) if batch > 1
             else crossover(cc.dims, min(rp, 1.0), min(rkv, 1.0)))
    except InputError:
        return None
    return {"tokens": None if math.isinf(n) else n, "rp": rp, "rkv": rkv, "batch": batch,
            "keeps": "realized" if (rp_real or rkv_real) else "nominal"}


def group_crossing(cc: CampaignCells, group: str, rows: list[dict]) -> dict | None:
    """Measured crossing (App. E) and cost-aware prediction (App. D) of a proj/sel group."""
    cells = [c for c in cc.cells if c.group == group]
    proj, why_p = _one_cell(cells, "proj")
    sel, why_s = _one_cell(cells, "sel")
    if not any(c.mode == "proj" for c in cells) or not any(c.mode == "sel" for c in cells):
        return None
    if len({c.cell for c in cells if c.mode == "proj"}) > 1 or len({c.cell for c in cells if c.mode == "sel"}) > 1:
        return None  # several keeps of a branch (a keep-ratio campaign): no one pair crosses
    out: dict = {"proj": proj, "sel": sel, "rows": [], "measured": None, "note": "",
                 "byte_crossover": None, "predicted": None}
    if proj is None or sel is None:
        out["note"] = f"no crossing: {why_p or why_s}"
        return out
    out["byte_crossover"] = _byte_crossover(cc, rows, proj, sel)
    have: dict[tuple[str, int], set[int]] = {}
    for c in cells:
        if c.cell in (proj, sel):
            have.setdefault((c.cell, c.context), set()).add(c.block)
    contexts = sorted({n for (name, n) in have if (proj, n) in have and (sel, n) in have})
    common = set.intersection(*(have[(name, n)] for n in contexts for name in (proj, sel))) if contexts else set()
    dropped = set().union(*have.values()) - common
    if len(contexts) < 2 or not common:
        out["note"] = (f"no measured crossing: '{proj}' and '{sel}' share {len(contexts)} context(s) "
                       f"and {len(common)} complete block(s); a crossing needs two contexts")
    else:
        if dropped:
            out["note"] = (f"blocks {sorted(dropped)} lack a cell at some context and are left out "
                           "of the crossing")
        subset = [c for c in cells if c.cell in (proj, sel) and c.context in contexts and c.block in common]
        try:
            curve = stats.difference_curve(subset, group)
            measured = stats.measured_crossing(curve)
        except InputError as err:
            out["note"] = f"no measured crossing: {err}"
        else:
            for i, n in enumerate(curve.contexts):
                at = lambda name, n=n: float(np.mean([c.ms_per_token for c in subset  # noqa: E731
                                                      if c.cell == name and c.context == n]))
                out["rows"].append({
                    "context": int(n), "proj_ms": at(proj), "sel_ms": at(sel),
                    "difference_ms": stats.as_dict(stats.resampled_mean(curve.diffs[i])),
                    "sel_faster_blocks": int((curve.diffs[i] > 0).sum()),
                    "blocks": int(curve.diffs.shape[1]),
                })
            out["measured"] = stats.as_dict(measured)
            if math.isnan(measured.value):
                d = curve.diffs.mean(axis=1)
                out["note"] = ("no crossing inside the contexts: " +
                               ("the projection branch leads at every context" if (d < 0).all() else
                                "the selection leads at every context" if (d >= 0).all() else
                                "the projection branch leads at the last context"))
    out["predicted"] = _prediction(cc, group, cells, proj, sel)
    out["committed"] = _committed(cc, rows, proj, sel)
    return out


def _committed(cc: CampaignCells, rows: list[dict], proj: str, sel: str) -> dict | None:
    """The prediction a crossing campaign was planned from (`campaign plan-crossing`, copied into
    the folder as prediction.json before it ran), where its proj and sel are this group's."""
    from sparsedecode.records import read_record

    path = Path(cc.folder) / "prediction.json"
    if not path.is_file():
        return None
    rec = read_record(path)
    spec = {r["cell"]: r["mode_spec"] for r in rows}
    if rec.get("kind") != "crossing_prediction" or (rec.get("proj"), rec.get("sel")) != (spec.get(proj), spec.get(sel)):
        return None
    return {"tokens": rec["predicted_tokens"], "source": rec.get("source"), "timestamp": rec.get("timestamp")}


def _prediction(cc: CampaignCells, group: str, cells: list[PaperCell], proj: str, sel: str) -> dict:
    """Cost-aware crossing from a group with dense cells and the same keeps (App. D)."""
    key = lambda name: next((c.projection_keep, c.kv_keep) for c in cells if c.cell == name)  # noqa: E731
    want = (key(proj), key(sel))
    batch = {c.group: cc.batch(c) for c in cc.cells}
    candidates = [group] + sorted({g for g in batch if batch[g] == batch[group]} - {group})
    reasons = []
    for g in candidates:
        gc = [c for c in cc.paired() if c.group == g]
        p, _ = _one_cell(gc, "proj")
        s, _ = _one_cell(gc, "sel")
        if not any(c.mode == "dense" for c in gc) or p is None or s is None:
            continue
        got = (next((c.projection_keep, c.kv_keep) for c in gc if c.cell == p),
               next((c.projection_keep, c.kv_keep) for c in gc if c.cell == s))
        if got != want:
            continue
        result = _predict_from(cc, gc, p, s)
        if isinstance(result, str):
            reasons.append(f"group '{g}': {result}")
            continue
        result["source_group"] = g
        return result
    why = "; ".join(reasons) or (f"no group of this folder holds dense, proj and sel cells at the "
                                 f"keeps of '{proj}' and '{sel}'")
    return {"tokens": None, "note": f"no cost-aware prediction: {why}"}


def _predict_from(cc: CampaignCells, gc: list[PaperCell], proj: str, sel: str) -> dict | str:
    dense = {(c.context, c.block): c for c in gc if c.mode == "dense"}
    per: dict[tuple[str, int], list[tuple[float, float, float, float]]] = {}
    for c in gc:
        d = dense.get((c.context, c.block))
        if c.cell not in (proj, sel) or d is None:
            continue
        b, bd = cell_bytes(cc, c)[0], cell_bytes(cc, d)[0]
        if b is None or bd is None:
            return f"bytes per step unknown ({cc.dims_note})"
        per.setdefault((c.cell, c.context), []).append((c.ms_per_token, d.ms_per_token, b, bd))
    ctx = sorted({n for (name, n) in per if (proj, n) in per and (sel, n) in per})
    if len(ctx) < 2:
        return "dense, proj and sel cells share fewer than two contexts"
    arr = {k: np.array(v) for k, v in per.items()}  # (blocks, 4): t_b, t_D, B_b, B_D
    t_d = np.array([np.mean(np.r_[arr[(proj, n)][:, 1], arr[(sel, n)][:, 1]]) for n in ctx])
    cost = {name: np.array([stats.kernel_cost(arr[(name, n)][:, 0], arr[(name, n)][:, 1],
                                              arr[(name, n)][:, 2] / arr[(name, n)][:, 3]).mean()
                            for n in ctx]) for name in (proj, sel)}
    byt = {name: np.array([arr[(name, n)][:, 2].mean() for n in ctx]) for name in (proj, sel)}
    b_d = np.array([np.mean(np.r_[arr[(proj, n)][:, 3], arr[(sel, n)][:, 3]]) for n in ctx])
    n = np.array(ctx, dtype=float)

    # Bytes are linear in n, so interpolating B_b and B_D separately keeps their ratio exact.
    def ratio(name):
        return lambda x: np.interp(x, n, byt[name]) / np.interp(x, n, b_d)

    tokens = stats.predicted_crossing(n, t_d, cost[proj], cost[sel], ratio(proj), ratio(sel))
    grid = np.geomspace(n[0], n[-1], 96)
    # App. D's model t_b = t_D B_b / B_D + c_b, t_D log-log and c_b linear, as stats uses it.
    t_grid = np.exp(np.interp(np.log(grid), np.log(n), np.log(t_d)))
    diff = (t_grid * (ratio(proj)(grid) - ratio(sel)(grid))
            + np.interp(grid, n, cost[proj]) - np.interp(grid, n, cost[sel]))
    return {
        "tokens": None if math.isnan(tokens) else tokens,
        "note": "" if not math.isnan(tokens) else "no cost-aware crossing: the predicted "
                                                  "difference does not change sign inside the sweep",
        "contexts": ctx,
        "dense_ms": t_d.tolist(),
        "cost_proj_ms": cost[proj].tolist(),
        "cost_sel_ms": cost[sel].tolist(),
        "curve": [[float(a), float(b)] for a, b in zip(grid, diff, strict=True)],
    }


__all__ = ["group_crossing"]
