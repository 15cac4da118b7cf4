"""What a campaign's run was like, beside what it measured: who else held the GPU around each
cell's timed steps (timing.neighbors; ByteCross App. A gives each cell its GPU alone) and where
the device time went, cell by cell (App. E runs every cell in a fresh process with full-graph
compilation, so most of a cell is not its timed steps).

`gpu_neighbors` gathers what each record's probe saw.

`cell_overhead` averages, over a campaign's cells, the one-time parts each record keeps
(`one_time`: process start, CUDA init, load, calibrate, prefill, select, keep, capture,
after) and where load and capture went (`phases`: build, cache, warm_kv; first call,
warm-up, graph), beside the timed steps
themselves (warm-up + repeats x steps at the measured step time) and the median gap
between consecutive records, which holds a cell's whole cost (process start and imports
included) when the cells run one after another. It is what a plan of device time and a
decision about a faster compile rest on. `report/timing_markdown.py` renders both.
"""

from __future__ import annotations

import statistics

from sparsedecode.timing.campaign import cell_seconds
from sparsedecode.timing.cells import CampaignCells

# one_time's keys in the order a cell runs them (timing.cell.run_cell); older records lack some
ORDER = ("start_s", "cuda_init_s", "load_s", "calibrate_s", "prefill_s", "select_s", "select_warm_s",
         "keep_s", "capture_s", "after_s")


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def gpu_neighbors(cc: CampaignCells) -> dict | None:
    """Who else held the GPU around each cell's timed steps (timing.neighbors): the cells that
    saw another process, how many were probed, how many probes could not tell, and how many
    records carry no probe (timed before it existed). None when no record carries one."""
    seen = [(c, cc.extra(c).gpu_neighbors) for c in cc.cells]
    probed = [(c, n) for c, n in seen if n is not None]
    if not probed:
        return None
    shared = [{"path": str(c.path), "group": c.group, "cell": c.cell, "context": c.context, "block": c.block,
               "processes": sorted({f"{p['pid']} {p['name']}" for side in ("before", "after")
                                    for p in (n.get(side) or [])})}
              for c, n in probed if n.get("before") or n.get("after")]
    unknown = sum(n.get("before") is None or n.get("after") is None for _, n in probed)
    return {"probed": len(probed), "shared": shared, "unknown": unknown, "no_probe": len(seen) - len(probed)}


def cell_overhead(cc: CampaignCells) -> dict | None:
    """{'cells', 'parts': [(name, mean s, cells)], 'timed_s', 'gap_s', 'gaps', 'rest_s'} ('rest_s':
    the gap less the recorded parts and the timed steps, where all are known); None when no
    record keeps its one-time costs (the paper's records do not)."""
    xs = [(c, cc.extra(c)) for c in cc.cells]
    xs = [(c, x) for c, x in xs if x.one_time]
    if not xs:
        return None
    parts: list[tuple[str, float | None, int]] = []
    keys = list(dict.fromkeys([*ORDER, *(k for _, x in xs for k in x.one_time)]))
    for key in keys:
        vals = [float(x.one_time[key]) for _, x in xs if isinstance(x.one_time.get(key), int | float)]
        if vals:
            parts.append((key.removesuffix("_s"), _mean(vals), len(vals)))
        phase = {"load_s": "load", "capture_s": "capture"}.get(key)
        if phase is None:
            continue
        names = list(dict.fromkeys(k for _, x in xs for k in ((x.phases or {}).get(phase) or {})))
        for name in names:
            vals = [float(v) for _, x in xs
                    if isinstance(v := ((x.phases or {}).get(phase) or {}).get(name), int | float)]
            if vals:
                parts.append((f"{phase}: {name.removesuffix('_s')}", _mean(vals), len(vals)))
    timed = [x.timed_steps * c.ms_per_token / 1e3 for c, x in xs if x.timed_steps]
    gap, gaps = cell_seconds([x.timestamp for _, x in xs])
    top = [v for name, v, _ in parts if ":" not in name]  # a part no record keeps counts as none
    rest = None if gap is None or not timed else gap - sum(top) - _mean(timed)
    return {"cells": len(xs), "parts": parts, "timed_s": _mean(timed), "timed_cells": len(timed),
            "gap_s": gap, "gaps": gaps, "rest_s": rest}


__all__ = ["ORDER", "cell_overhead", "gpu_neighbors"]
