"""The analysis of one campaign folder, from its records alone (ByteCross §4.2-4.4, App. D, E).

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

All statistics come from ``timing.stats``; this module selects cells and averages over
blocks, into one JSON-ready dict (`build_report`) that `report/timing_report.py` renders. The
crossings are in ``timing.crossing``, bytes and peaks in ``timing.costs``, the dense steps in
``timing.dense_steps``, step profiles in ``timing.profile`` and the run's conditions in
``timing.run_conditions``.
"""

from __future__ import annotations

import numpy as np

from sparsedecode.errors import InputError
from sparsedecode.timing import stats
from sparsedecode.timing.batch_report import batch_summary
from sparsedecode.timing.ceiling import campaign_ceiling
from sparsedecode.timing.cells import CampaignCells
from sparsedecode.timing.costs import bytes_note, cell_bytes, nominal_peak, share
from sparsedecode.timing.crossing import group_crossing
from sparsedecode.timing.dense_steps import attention_clusters, dense_steps
from sparsedecode.timing.profile import step_profiles
from sparsedecode.timing.run_conditions import cell_overhead, gpu_neighbors


def _row(cc: CampaignCells, group: str, cell: str, context: int, peak: float | None,
         ceiling: float | None = None) -> dict:
    mine = [c for c in cc.cells if c.group == group and c.cell == cell and c.context == context]
    paired = [c for c in cc.paired() if c.group == group and c.context == context]
    dense = {c.block: c for c in paired if c.mode == "dense"}
    first, xs = mine[0], [cc.extra(c) for c in mine]
    info = [cell_bytes(cc, c) for c in mine]
    ms = float(np.mean([c.ms_per_token for c in mine]))
    gbps = stats.mean_of(x.achieved_gbps for x in xs)
    if gbps is None and all(b is not None for b, _, _ in info):
        gbps = float(np.mean([b / c.ms_per_token / 1e6 for c, (b, _, _) in zip(mine, info, strict=True)]))
    row = {
        "context": context,
        "cell": cell,
        "mode": first.mode,
        "mode_spec": xs[0].mode_spec,
        "projection_keep": first.projection_keep,
        "kv_keep": first.kv_keep,
        "realized_projection_keep": stats.mean_of(x.realized_projection_keep for x in xs),
        "batch": xs[0].batch,
        "realized_union": stats.mean_of(x.realized_union for x in xs),
        "step_ms": ms * xs[0].batch,  # one step decodes batch tokens
        "kv_read_fraction": stats.mean_of(x.kv_read_fraction for x in xs),
        "blocks": sorted(c.block for c in mine),
        "ms_per_token": ms,
        "speedup": None,
        "byte_bound": stats.mean_of(b for _, b, _ in info),
        "fraction_of_bound": None,
        "kernel_cost_ms": None,
        "bytes_per_step": stats.mean_of(b for b, _, _ in info),
        "bytes_source": sorted({s for _, _, s in info}),
        "achieved_gbps": gbps,
        "fraction_of_peak": share(gbps, peak),
        "fraction_of_ceiling": share(gbps, ceiling),
        "peak_memory_bytes": max((x.peak_memory_bytes for x in xs if x.peak_memory_bytes), default=None),
        "one_time_s": {k: stats.mean_of(x.one_time.get(k) for x in xs)
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
    row["speedup"] = stats.as_dict(est)
    if row["byte_bound"]:
        row["fraction_of_bound"] = est.value / row["byte_bound"]
    pairs = [(c, dense[c.block]) for c in ok]
    b_cell = [cell_bytes(cc, c)[0] for c, _ in pairs]
    b_dense = [cell_bytes(cc, d)[0] for _, d in pairs]
    if all(b is not None for b in b_cell + b_dense):
        costs = stats.kernel_cost([c.ms_per_token for c, _ in pairs],
                                  [d.ms_per_token for _, d in pairs],
                                  np.array(b_cell) / np.array(b_dense))
        row["kernel_cost_ms"] = stats.as_dict(stats.resampled_mean(costs))
    return row


def _group(cc: CampaignCells, group: str, peak: float | None, ceiling: float | None = None) -> dict:
    cells = [c for c in cc.cells if c.group == group]
    keys = sorted({(c.context, c.mode != "dense", c.cell) for c in cells})
    rows = [_row(cc, group, cell, n, peak, ceiling) for n, _, cell in keys]
    attention = sorted({a for c in cells if (a := cc.extra(c).attention)})
    runtime = sorted({r for c in cells if (r := cc.extra(c).runtime)})
    sources = {s for r in rows for s in r["bytes_source"]}
    batches = sorted({cc.batch(c) for c in cells})
    if len(batches) > 1:
        raise InputError(f"{cc.folder}: group '{group}' holds cells of batch sizes {batches}; each batch size "
                         "is a group of its own (a grid's batch key)")
    return {
        "name": group,
        "batch": batches[0],
        "attention": attention[0] if len(attention) == 1 else (attention or None),
        "runtime": runtime,
        "has_dense": any(c.mode == "dense" for c in cells),
        "rows": rows,
        "bytes_note": bytes_note(cc, sources),
        "crossing": group_crossing(cc, group, rows),
    }


def build_report(cc: CampaignCells, peak_gbps: float | None = None, ceiling=None) -> dict:
    """Everything the report shows, as one JSON-ready dict (no figures drawn here). `ceiling` is
    a bandwidth-ceiling record file; by default the campaign folder's ceiling.json, if any."""
    if peak_gbps is not None:
        peak, peak_note = float(peak_gbps), "peak from --peak-gbps"
    elif cc.cpu:
        peak, peak_note = None, "CPU cells: no peak bandwidth, fraction of peak left blank"
    else:
        peak, peak_note = nominal_peak(cc.gpu)
    ceiling_gbps, ceiling_note = campaign_ceiling(cc, ceiling)
    groups = [_group(cc, g, peak, ceiling_gbps) for g in sorted({c.group for c in cc.cells})]
    single = [g for g in groups if g["batch"] == 1]  # the dense steps and paths of one sequence
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
        "attention_paths": attention_clusters(cc, single),
        "dense_steps": dense_steps(cc, peak, ceiling_gbps),
        "step_profiles": step_profiles(cc, ceiling_gbps),
        "failed": [{"path": str(f.path), "group": f.group, "cell": f.cell, "context": f.context,
                    "block": f.block, "error": f.error} for f in cc.failed],
        "missing": [{"path": str(m.path), "group": m.group, "cell": m.cell, "context": m.context,
                     "block": m.block} for m in cc.missing],
        "groups_without_dense": no_dense,
        "retired": cc.retired,
        "gpu_neighbors": gpu_neighbors(cc),
        "overhead": cell_overhead(cc),
        "batches": batch_summary(cc, groups, ceiling_gbps),
        "batched_left_out": cc.batched,
    }


__all__ = ["build_report"]
