"""The timing report of one campaign folder, rebuilt from its records alone (ByteCross §4.2-4.4, App. D, E).

For every group of cells, one row per (context, cell):

* the paired speedup to the dense cell of the same block and context, mean over
  blocks with the 95% interval over all B**B block resamples (App. A "Timing",
  Figure 3), from ``stats.speedup``;
* the byte bound of the mode and the fraction of it reached (§3.3, §4.2);
* mean ms per token (1000 / mean repeat throughput, the paper's convention);
* the kernel cost c_b = t_b - t_D B_b / B_D, paired per block and averaged
  (App. D, Table 10), with B_b / B_D from the records' ``bytes_per_step`` or,
  for the paper's records, from the byte account of the model's known dims at
  the nominal keeps (App. D counts the head and norms, as ``step_bytes`` does);
* achieved GB/s, and for dense cells the fraction of the GPU's peak bandwidth
  (App. D, Table 11).

Where a group holds one projection cell and one selection cell at several
contexts: the paired difference t_proj - t_sel per context, the measured
crossing with its interval (§4.3, App. E), the byte crossover n* (Eq. 5) and the
cost-aware predicted crossing (App. D) with the predicted difference curve.
The prediction takes t_D and the costs from a group that holds dense cells:
the group itself, or else a group of the same folder with the same keeps (the
paper predicts its crossing campaigns from its sweeps the same way). Failed
cells and sparse cells without a dense partner are listed, never dropped.

All statistics come from ``timing.stats``; this module selects cells, averages
over blocks and formats.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

import numpy as np

from sparsedecode.account import bounds, crossover, step_bytes
from sparsedecode.errors import InputError
from sparsedecode.report.run_conditions import cell_overhead, gpu_neighbors
from sparsedecode.report.timing_markdown import fmt_ctx, render_markdown  # noqa: F401 (re-exported)
from sparsedecode.timing import stats
from sparsedecode.timing.cells import CampaignCells
from sparsedecode.timing.paper import PaperCell
from sparsedecode.timing.profile import KINDS as STEP_KINDS

# Nominal peak memory bandwidth in GB/s; every substring must occur in the
# normalized GPU name, first match wins (vendor data sheets).
PEAK_GBPS: tuple[tuple[tuple[str, ...], float, str], ...] = (
    (("h200",), 4800.0, "H200"),
    (("h100", "hbm3"), 3350.0, "H100 SXM"),
    (("h100", "sxm"), 3350.0, "H100 SXM"),
    (("a100", "80gb", "pcie"), 1935.0, "A100 80GB PCIe"),
    (("a100", "80gb"), 2039.0, "A100 80GB SXM"),
    (("a100", "40gb"), 1555.0, "A100 40GB"),
    (("a6000",), 768.0, "RTX A6000"),
)
_BOUND_OF_MODE = {"proj": "projection", "sel": "kv", "window": "kv", "both": "both"}


_STREAMING = {kind for kind, streams, _ in STEP_KINDS if streams}


def nominal_peak(gpu: str) -> tuple[float | None, str]:
    """(peak GB/s, which entry matched) for a GPU name; (None, reason) when unknown."""
    name = gpu.lower().replace("-", " ").replace("_", " ")
    for keys, gbps, label in PEAK_GBPS:
        if all(k in name for k in keys):
            return gbps, f"nominal peak of the {label}"
    return None, (f"no nominal peak for GPU '{gpu}': fraction of peak left blank "
                  "(pass --peak-gbps)")


def _est(e: stats.Estimate | None) -> dict | None:
    return None if e is None else asdict(e)


def _mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else None


# ---- bytes per step --------------------------------------------------------------------------


def _share(gbps: float | None, of: float | None) -> float | None:
    """gbps as a share of a bandwidth (the peak, the measured ceiling); None where either is."""
    return None if gbps is None or of is None else gbps / of


def _account_bytes(cc: CampaignCells, c: PaperCell) -> tuple[float | None, float | None]:
    """(bytes per step, byte bound) from the byte account at the nominal keeps, or Nones."""
    if cc.dims is None:
        return None, None
    if c.mode == "dense":
        return step_bytes(cc.dims, c.context).total, 1.0
    if c.mode not in _BOUND_OF_MODE:
        return None, None
    b = getattr(bounds(cc.dims, c.context, c.projection_keep, c.kv_keep), _BOUND_OF_MODE[c.mode])
    return step_bytes(cc.dims, c.context).total / b, b


def cell_bytes(cc: CampaignCells, c: PaperCell) -> tuple[float | None, float | None, str]:
    """(bytes per step, byte bound, source) of one cell: the record's own, else the account's."""
    x = cc.extra(c)
    if x.bytes_per_step is not None:
        bound = x.byte_bound if x.byte_bound is not None else (1.0 if c.mode == "dense" else None)
        return x.bytes_per_step, bound, "records"
    by, bound = _account_bytes(cc, c)
    if x.byte_bound is not None:
        bound = x.byte_bound
    return by, bound, "account" if by is not None else "none"


def _bytes_note(cc: CampaignCells, sources: set[str]) -> str:
    if sources == {"records"}:
        return "B_b / B_D from the records' bytes_per_step (realized keeps)."
    if "none" in sources:
        return (f"kernel cost left blank where bytes are unknown: records lack bytes_per_step "
                f"and {cc.dims_note or 'the model has no dims'}.")
    return (f"B_b / B_D from the byte account ({cc.dims_note}, 16-bit weights and cache, "
            "nominal keeps; head and norms included, App. D).")


# ---- one group -------------------------------------------------------------------------------


def _row(cc: CampaignCells, group: str, cell: str, context: int, peak: float | None,
         ceiling: float | None = None) -> dict:
    mine = [c for c in cc.cells if c.group == group and c.cell == cell and c.context == context]
    paired = [c for c in cc.paired() if c.group == group and c.context == context]
    dense = {c.block: c for c in paired if c.mode == "dense"}
    first, xs = mine[0], [cc.extra(c) for c in mine]
    info = [cell_bytes(cc, c) for c in mine]
    ms = float(np.mean([c.ms_per_token for c in mine]))
    gbps = _mean(x.achieved_gbps for x in xs)
    if gbps is None and all(b is not None for b, _, _ in info):
        gbps = float(np.mean([b / c.ms_per_token / 1e6 for c, (b, _, _) in zip(mine, info, strict=True)]))
    row = {
        "context": context,
        "cell": cell,
        "mode": first.mode,
        "mode_spec": xs[0].mode_spec,
        "projection_keep": first.projection_keep,
        "kv_keep": first.kv_keep,
        "realized_projection_keep": _mean(x.realized_projection_keep for x in xs),
        "kv_read_fraction": _mean(x.kv_read_fraction for x in xs),
        "blocks": sorted(c.block for c in mine),
        "ms_per_token": ms,
        "speedup": None,
        "byte_bound": _mean(b for _, b, _ in info),
        "fraction_of_bound": None,
        "kernel_cost_ms": None,
        "bytes_per_step": _mean(b for b, _, _ in info),
        "bytes_source": sorted({s for _, _, s in info}),
        "achieved_gbps": gbps,
        "fraction_of_peak": _share(gbps, peak),
        "fraction_of_ceiling": _share(gbps, ceiling),
        "peak_memory_bytes": max((x.peak_memory_bytes for x in xs if x.peak_memory_bytes), default=None),
        "one_time_s": {k: _mean(x.one_time.get(k) for x in xs)
                       for k in sorted({k for x in xs for k in x.one_time})},
        "note": "",
    }
    if first.mode == "dense":
        return row
    ok = [c for c in mine if c.block in dense]
    if len(ok) < len(mine):
        row["note"] = f"{len(mine) - len(ok)} block(s) without a dense partner left out"
    if not ok:
        return row
    try:
        est = stats.speedup(paired, cell, context)
    except InputError as err:
        row["note"] = str(err)
        return row
    row["speedup"] = _est(est)
    if row["byte_bound"]:
        row["fraction_of_bound"] = est.value / row["byte_bound"]
    pairs = [(c, dense[c.block]) for c in ok]
    b_cell = [cell_bytes(cc, c)[0] for c, _ in pairs]
    b_dense = [cell_bytes(cc, d)[0] for _, d in pairs]
    if all(b is not None for b in b_cell + b_dense):
        costs = stats.kernel_cost([c.ms_per_token for c, _ in pairs],
                                  [d.ms_per_token for _, d in pairs],
                                  np.array(b_cell) / np.array(b_dense))
        row["kernel_cost_ms"] = _est(stats.resampled_mean(costs))
    return row


def _one_cell(cells: list[PaperCell], mode: str) -> tuple[str | None, str]:
    names = sorted({c.cell for c in cells if c.mode == mode})
    if len(names) == 1:
        return names[0], ""
    return None, f"needs one cell of mode '{mode}', found {names or 'none'}"


def _realized(rows: list[dict], cell: str, key: str, nominal_key: str) -> tuple[float, bool]:
    mine = [r for r in rows if r["cell"] == cell]
    realized = _mean(r[key] for r in mine)
    return (realized, True) if realized is not None else (mine[0][nominal_key], False)


def _byte_crossover(cc: CampaignCells, rows: list[dict], proj: str, sel: str) -> dict | None:
    """n* of Eq. 5 at the keeps the cells realized (nominal where the records do not say)."""
    if cc.dims is None:
        return None
    rp, rp_real = _realized(rows, proj, "realized_projection_keep", "projection_keep")
    rkv, rkv_real = _realized(rows, sel, "kv_read_fraction", "kv_keep")
    try:
        n = crossover(cc.dims, min(rp, 1.0), min(rkv, 1.0))
    except InputError:
        return None
    return {"tokens": None if math.isinf(n) else n, "rp": rp, "rkv": rkv,
            "keeps": "realized" if (rp_real or rkv_real) else "nominal"}


def _crossing(cc: CampaignCells, group: str, rows: list[dict]) -> dict | None:
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
                    "difference_ms": _est(stats.resampled_mean(curve.diffs[i])),
                    "sel_faster_blocks": int((curve.diffs[i] > 0).sum()),
                    "blocks": int(curve.diffs.shape[1]),
                })
            out["measured"] = _est(measured)
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
    candidates = [group] + sorted({c.group for c in cc.cells} - {group})
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


def _group(cc: CampaignCells, group: str, peak: float | None, ceiling: float | None = None) -> dict:
    cells = [c for c in cc.cells if c.group == group]
    keys = sorted({(c.context, c.mode != "dense", c.cell) for c in cells})
    rows = [_row(cc, group, cell, n, peak, ceiling) for n, _, cell in keys]
    attention = sorted({a for c in cells if (a := cc.extra(c).attention)})
    runtime = sorted({r for c in cells if (r := cc.extra(c).runtime)})
    sources = {s for r in rows for s in r["bytes_source"]}
    return {
        "name": group,
        "attention": attention[0] if len(attention) == 1 else (attention or None),
        "runtime": runtime,
        "has_dense": any(c.mode == "dense" for c in cells),
        "rows": rows,
        "bytes_note": _bytes_note(cc, sources),
        "crossing": _crossing(cc, group, rows),
    }


def _attention_clusters(cc: CampaignCells, groups: list[dict]) -> list[dict]:
    """Groups with the same cells and contexts whose attention paths differ (§4.4, Figure 5).

    Each cluster also prices the sparse cells of the split-K group (the path that reads
    only what a policy keeps) against the dense cell of every path, paired by block and
    context: the paper's point that a masked or fused dense baseline inflates the gain of
    the same KV policy (1.29x to 6.92x at 128K on A100, App. D Table 11).
    """
    by_sig: dict[tuple, list[dict]] = {}
    for g in groups:
        if not isinstance(g["attention"], str) or not g["has_dense"]:
            continue
        sig = tuple(sorted({(r["cell"], r["context"]) for r in g["rows"]}))
        by_sig.setdefault(sig, []).append(g)
    out = []
    for sig, gs in by_sig.items():
        if len({g["attention"] for g in gs}) > 1:
            out.append({"cells": sorted({c for c, _ in sig}),
                        "groups": [{"group": g["name"], "attention": g["attention"],
                                    "runtime": g["runtime"]} for g in gs],
                        "against_dense": _against_dense(cc, gs)})
    return out


def _against_dense(cc: CampaignCells, gs: list[dict]) -> list[dict]:
    """Speedup of each sparse cell of the split-K group over the dense cell of every path."""
    ref = next((g for g in gs if g["attention"] == "split_k"), None)
    if ref is None:
        return []
    times = {}  # (group, cell, context) -> {block: ms}
    for c in cc.cells:
        if c.group in {g["name"] for g in gs}:
            times.setdefault((c.group, c.cell, c.context), {})[c.block] = c.ms_per_token
    rows = []
    for r in ref["rows"]:
        if r["mode"] == "dense":
            continue
        sparse = times[(ref["name"], r["cell"], r["context"])]
        for g in gs:
            dense = times.get((g["name"], "dense", r["context"]), {})
            blocks = sorted(set(sparse) & set(dense))
            if not blocks:
                continue
            d = next(x for x in g["rows"] if x["mode"] == "dense" and x["context"] == r["context"])
            est = stats.resampled_mean([dense[b] / sparse[b] for b in blocks])
            rows.append({"cell": r["cell"], "context": r["context"], "dense_attention": g["attention"],
                         "dense_ms": d["ms_per_token"], "dense_fraction_of_peak": d["fraction_of_peak"],
                         "sparse_ms": r["ms_per_token"], "blocks": blocks,
                         "speedup": {"value": est.value, "low": est.low, "high": est.high}})
    return rows


def _dense_steps(cc: CampaignCells, peak: float | None, ceiling: float | None) -> list[dict]:
    """Every dense step timed at a context (our groups and kernel variants, the peers), each
    against the fastest of ours there, paired by block: which dense step the campaign's speedups
    divide, and what it is worth beside the others (App. A 'Timing'). Contexts with one dense
    step are left out."""
    by: dict[int, dict[tuple[str, str], dict[int, PaperCell]]] = {}
    for c in cc.cells:
        if c.mode == "dense":
            by.setdefault(c.context, {}).setdefault((c.group, c.cell), {})[c.block] = c
    rows = []
    for n, steps in sorted(by.items()):
        ms = {k: float(np.mean([c.ms_per_token for c in v.values()])) for k, v in steps.items()}
        impl = {k: cc.extra(next(iter(v.values()))).impl or "ours" for k, v in steps.items()}
        ours = [k for k in steps if impl[k] == "ours"]
        if len(steps) < 2 or not ours:
            continue
        best = min(ours, key=ms.__getitem__)
        for k in sorted(steps, key=ms.__getitem__):
            xs = [cc.extra(c) for c in steps[k].values()]
            gbps = _mean(x.achieved_gbps for x in xs)
            blocks = sorted(set(steps[k]) & set(steps[best]))
            est = None
            if k != best and blocks:
                est = _est(stats.resampled_mean([steps[k][b].ms_per_token / steps[best][b].ms_per_token
                                                 for b in blocks]))
            rows.append({"context": n, "group": k[0], "cell": k[1], "impl": impl[k],
                         "dense_step": xs[0].dense_step, "runtime": xs[0].runtime, "ms_per_token": ms[k],
                         "blocks": sorted(steps[k]), "fastest_ours": k == best,
                         "fraction_of_peak": _share(gbps, peak), "fraction_of_ceiling": _share(gbps, ceiling),
                         "fastest_ours_speedup": est})
    return rows


def _step_profiles(cc: CampaignCells, ceiling: float | None) -> list[dict]:
    """Where each profiled cell's step goes (`timing.profile`, issue 26 item 2), mean over the
    blocks that profiled it: the profiled step, its bytes at the measured ceiling, and the time
    above that split into gaps (no kernel running), fixed kernels (no weight or KV bytes; the
    two largest kinds named) and the streaming kernels' time past the byte time, with those
    kernels' (kind, µs) largest first."""
    by: dict[tuple, list] = {}
    for c in cc.cells:
        x = cc.extra(c)
        if x.profile:
            by.setdefault((c.context, c.group, c.cell), []).append(x)
    rows = []
    for (n, group, cell), xs in sorted(by.items()):
        ps = [x.profile for x in xs]
        mean = lambda k, ps=ps: float(np.mean([p[k] for p in ps]))  # noqa: E731
        kinds: dict[str, float] = {}
        for p in ps:
            for k, us in p["kinds_us"].items():
                kinds[k] = kinds.get(k, 0.0) + us / len(ps)
        byte_us = (float(np.mean([x.bytes_per_step for x in xs])) / (ceiling * 1e9) * 1e6
                   if ceiling and all(x.bytes_per_step for x in xs) else None)
        step, streaming = mean("step_us"), mean("streaming_us")
        ranked = sorted(kinds.items(), key=lambda kv: -kv[1])
        fixed = [(k, us) for k, us in ranked if k not in _STREAMING]
        rows.append({"context": n, "group": group, "cell": cell, "blocks": len(ps), "clock": ps[0].get("clock"),
                     "step_us": step, "byte_us": byte_us, "above_us": None if byte_us is None else step - byte_us,
                     "gap_us": mean("gap_us"), "fixed_us": mean("fixed_us"), "largest_fixed": fixed[:2],
                     "streaming_kinds": [(k, us) for k, us in ranked if k in _STREAMING],
                     "streaming_us": streaming,
                     "streaming_past_us": None if byte_us is None else streaming - byte_us,
                     "launches": mean("launches"), "kinds_us": kinds})
    return rows


def _ceiling(cc: CampaignCells, ceiling) -> tuple[float | None, str]:
    """The measured ceiling in GB/s and where it came from: a 'bandwidth_ceiling' record
    (`sparsedecode bench ceiling`), the given one or the campaign folder's ceiling.json."""
    from sparsedecode.timing.ceiling import read_ceiling

    path = Path(ceiling) if ceiling is not None else Path(cc.folder) / "ceiling.json"
    if ceiling is None and not path.is_file():
        return None, ("no measured ceiling (a CUDA `campaign run` writes DIR/ceiling.json; else run "
                      "`sparsedecode bench ceiling --out DIR/ceiling.json` in the same call as the cells): "
                      "% of ceiling left blank")
    rec = read_ceiling(path)
    if cc.source == "sparsedecode" and rec.get("gpu") != cc.gpu:
        raise InputError(f"{path}: the ceiling was measured on {rec.get('gpu')}, the cells on {cc.gpu}")
    return float(rec["gbps"]), f"measured ceiling ({path.name}: {rec['method']})"


def build_report(cc: CampaignCells, peak_gbps: float | None = None, ceiling=None) -> dict:
    """Everything the report shows, as one JSON-ready dict (no figures drawn here). `ceiling` is
    a bandwidth-ceiling record file; by default the campaign folder's ceiling.json, if any."""
    if peak_gbps is not None:
        peak, peak_note = float(peak_gbps), "peak from --peak-gbps"
    elif cc.cpu:
        peak, peak_note = None, "CPU cells: no peak bandwidth, fraction of peak left blank"
    else:
        peak, peak_note = nominal_peak(cc.gpu)
    ceiling_gbps, ceiling_note = _ceiling(cc, ceiling)
    groups = [_group(cc, g, peak, ceiling_gbps) for g in sorted({c.group for c in cc.cells})]
    no_dense = sorted({m.group for m in cc.missing} - {g["name"] for g in groups if g["has_dense"]})
    return {
        "kind": "timing_report",
        "campaign": cc.campaign,
        "folder": str(cc.folder),
        "source": cc.source,
        "model": cc.model,
        "gpu": cc.gpu,
        "device": cc.device,
        "label": "CPU" if cc.cpu else None,
        "dims_note": cc.dims_note,
        "n_ok": len(cc.cells),
        "n_failed": len(cc.failed),
        "peak_gbps": peak,
        "peak_note": peak_note,
        "ceiling_gbps": ceiling_gbps,
        "ceiling_note": ceiling_note,
        "groups": groups,
        "attention_paths": _attention_clusters(cc, groups),
        "dense_steps": _dense_steps(cc, peak, ceiling_gbps),
        "step_profiles": _step_profiles(cc, ceiling_gbps),
        "failed": [{"path": str(f.path), "group": f.group, "cell": f.cell, "context": f.context,
                    "block": f.block, "error": f.error} for f in cc.failed],
        "missing": [{"path": str(m.path), "group": m.group, "cell": m.cell, "context": m.context,
                     "block": m.block} for m in cc.missing],
        "groups_without_dense": no_dense,
        "retired": cc.retired,
        "gpu_neighbors": gpu_neighbors(cc),
        "overhead": cell_overhead(cc),
    }


def write_report(
    folder: str | Path,
    out_dir: str | Path | None = None,
    peak_gbps: float | None = None,
    figures: bool = True,
    ceiling=None,
) -> tuple[dict, str]:
    """Load a campaign folder, draw the figures, write report.md; returns (report, markdown).

    ``out_dir`` defaults to DIR/report. The report is derived data and is
    rewritten on every run; the records are only read.
    """
    from sparsedecode.timing.cells import load_cells

    cc = load_cells(folder)
    rep = build_report(cc, peak_gbps, ceiling)
    out = Path(out_dir) if out_dir is not None else Path(folder) / "report"
    out.mkdir(parents=True, exist_ok=True)
    if figures:
        from sparsedecode.report.figures import draw_figures

        rep["figures"] = draw_figures(rep, out)
    md = render_markdown(rep)
    (out / "report.md").write_text(md, encoding="utf-8")
    rep["report_md"] = str(out / "report.md")
    return rep, md


__all__ = ["PEAK_GBPS", "build_report", "cell_bytes", "fmt_ctx", "nominal_peak", "render_markdown",
           "write_report"]
