"""Dense steps beside each other (ByteCross App. A 'Timing', §4.4, App. D Table 11): which dense
step a campaign's speedups divide, and what the same sparse cell is worth against each.

`dense_steps`: every dense step timed at a context (our groups and kernel variants, the peers),
each against the fastest of ours there, paired by block. `attention_clusters`: groups with the
same cells and contexts whose attention paths differ, each sparse cell of the split-K group
priced against the dense cell of every path.
"""

from __future__ import annotations

import numpy as np

from sparsedecode.timing import stats
from sparsedecode.timing.cells import CampaignCells
from sparsedecode.timing.costs import share
from sparsedecode.timing.paper import PaperCell


def attention_clusters(cc: CampaignCells, groups: list[dict]) -> list[dict]:
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


def dense_steps(cc: CampaignCells, peak: float | None, ceiling: float | None) -> list[dict]:
    """Every dense step timed at a context (our groups and kernel variants, the peers), each
    against the fastest of ours there, paired by block: which dense step the campaign's speedups
    divide, and what it is worth beside the others (App. A 'Timing'). Contexts with one dense
    step are left out."""
    by: dict[int, dict[tuple[str, str], dict[int, PaperCell]]] = {}
    for c in cc.cells:
        if c.mode == "dense" and cc.batch(c) == 1:  # a batch's step is no single-sequence dense step
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
            gbps = stats.mean_of(x.achieved_gbps for x in xs)
            blocks = sorted(set(steps[k]) & set(steps[best]))
            est = None
            if k != best and blocks:
                ratios = [steps[k][b].ms_per_token / steps[best][b].ms_per_token for b in blocks]
                est = stats.as_dict(stats.resampled_mean(ratios))
            rows.append({"context": n, "group": k[0], "cell": k[1], "impl": impl[k],
                         "dense_step": xs[0].dense_step, "runtime": xs[0].runtime, "ms_per_token": ms[k],
                         "blocks": sorted(steps[k]), "fastest_ours": k == best,
                         "fraction_of_peak": share(gbps, peak), "fraction_of_ceiling": share(gbps, ceiling),
                         "fastest_ours_speedup": est})
    return rows


__all__ = ["attention_clusters", "dense_steps"]
