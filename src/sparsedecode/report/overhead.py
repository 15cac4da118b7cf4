"""Where a campaign's device time goes, cell by cell (ByteCross App. E runs every cell in a
fresh process with full-graph compilation, so most of a cell is not its timed steps).

`cell_overhead` averages, over a campaign's cells, the one-time parts each record keeps
(`one_time`: load, calibrate, prefill, select, capture) and where load and capture went
(`phases`: build, cache, warm_kv; first call, warm-up, graph), beside the timed steps
themselves (warm-up + repeats x steps at the measured step time) and the median gap
between consecutive records, which holds a cell's whole cost (process start and imports
included) when the cells run one after another. It is what a plan of device time and a
decision about a faster compile rest on.
"""

from __future__ import annotations

import statistics

from sparsedecode.timing.campaign import cell_seconds
from sparsedecode.timing.cells import CampaignCells


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def cell_overhead(cc: CampaignCells) -> dict | None:
    """{'cells', 'parts': [(name, mean s, cells)], 'timed_s', 'gap_s', 'gaps', 'rest_s'} ('rest_s':
    the gap less the recorded parts and the timed steps, where all are known); None when no
    record keeps its one-time costs (the paper's records do not)."""
    xs = [(c, cc.extra(c)) for c in cc.cells]
    xs = [(c, x) for c, x in xs if x.one_time]
    if not xs:
        return None
    parts: list[tuple[str, float | None, int]] = []
    for key in ("load_s", "calibrate_s", "prefill_s", "select_s", "capture_s"):
        vals = [float(x.one_time[key]) for _, x in xs if isinstance(x.one_time.get(key), int | float)]
        parts.append((key.removesuffix("_s"), _mean(vals), len(vals)))
        phase = {"load_s": "load", "capture_s": "capture"}.get(key)
        if phase is None:
            continue
        names = list(dict.fromkeys(k for _, x in xs for k in ((x.phases or {}).get(phase) or {})))
        for name in names:
            vals = [float(v) for _, x in xs
                    if isinstance(v := ((x.phases or {}).get(phase) or {}).get(name), int | float)]
            parts.append((f"{phase}: {name.removesuffix('_s')}", _mean(vals), len(vals)))
    timed = [x.timed_steps * c.ms_per_token / 1e3 for c, x in xs if x.timed_steps]
    gap, gaps = cell_seconds([x.timestamp for _, x in xs])
    top = [v for name, v, k in parts if ":" not in name and k]  # a part no record keeps counts as none
    rest = None if gap is None or not timed else gap - sum(top) - _mean(timed)
    return {"cells": len(xs), "parts": parts, "timed_s": _mean(timed), "timed_cells": len(timed),
            "gap_s": gap, "gaps": gaps, "rest_s": rest}


def overhead_md(o: dict | None) -> list[str]:
    """The report's section: one row per part, seconds per cell."""
    if not o:
        return []
    f = lambda v: "" if v is None else f"{v:.2f}"  # noqa: E731
    out = ["", f"## Where each cell's device time went (mean seconds over {o['cells']} cells)", "",
           "| part | s per cell | cells |", "|---|---|---|"]
    out += [f"| {name} | {f(v)} | {k} |" for name, v, k in o["parts"] if k]
    out.append(f"| timed steps (warm-up + repeats × steps) | {f(o['timed_s'])} | {o['timed_cells']} |")
    if o["gap_s"] is not None:
        out.append(f"| whole cell: median gap between consecutive records | {f(o['gap_s'])} | {o['gaps']} gaps |")
    if o.get("rest_s") is not None:
        out.append(f"| the rest of the gap (process start, imports, GPU probes, keep tracking) | {f(o['rest_s'])} | |")
    out += ["", "The gap holds a cell's whole cost (process start, imports, GPU probes) when cells run one "
            "after another; with several lanes at once it is shorter than a cell."]
    return out


__all__ = ["cell_overhead", "overhead_md"]
