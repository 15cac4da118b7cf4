"""The batch section of a timing report (issue 44; ByteCross §3.3, App. F): a campaign whose
grids decode B sequences a step (`timing.batch_cell`, one group per batch size).

Per mode and context, the step against B: ms a step, tokens/s (B tokens a step), the union of kept
projection rows the step read, GB/s and the share of the measured ceiling, the speedup over the
dense step at the same B, and the step over the same mode's step at B = 1 (how much a batch costs
its sequences). Per batch size, the measured crossing of its proj and sel cells beside the byte
crossover n*_B = P (1 - u_B) / (2 B h_kv d_h (1 - r_KV)) at the union those cells realized, with
whose activations gave it (random weights give nearly independent kept channels: no real text's
union).
"""

from __future__ import annotations

from sparsedecode.timing.cells import CampaignCells
from sparsedecode.timing.costs import share


def batch_summary(cc: CampaignCells, groups: list[dict], ceiling: float | None) -> dict | None:
    """The batch section (see the module doc), or None when every group decodes one sequence."""
    if all(g["batch"] == 1 for g in groups):
        return None
    steps: dict[tuple[str, int], list[dict]] = {}
    for g in groups:
        for r in g["rows"]:
            steps.setdefault((r["mode_spec"] or r["cell"], r["context"]), []).append({
                "batch": g["batch"], "group": g["name"], "step_ms": r["step_ms"],
                "tokens_per_sec": 1e3 / r["ms_per_token"],
                "realized_union": r["realized_union"] if r["mode"] in ("proj", "both") else None,
                "achieved_gbps": r["achieved_gbps"], "fraction_of_ceiling": share(r["achieved_gbps"], ceiling),
                "speedup": r["speedup"], "byte_bound": r["byte_bound"]})
    rows = []
    for (mode, n), per in sorted(steps.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        per.sort(key=lambda x: x["batch"])
        one = next((x["step_ms"] for x in per if x["batch"] == 1), None)
        for x in per:
            x["step_over_b1"] = None if one is None else x["step_ms"] / one
        rows.append({"mode_spec": mode, "context": n, "by_batch": per})
    crossings = []
    for g in sorted(groups, key=lambda g: g["batch"]):
        c = g["crossing"]
        if not c:
            continue
        byte = c.get("byte_crossover") or {}
        proj = [cc.extra(x) for x in cc.cells if x.group == g["name"] and x.cell == c["proj"]]
        crossings.append({
            "batch": g["batch"], "group": g["name"], "proj": c["proj"], "sel": c["sel"],
            "measured": c.get("measured"), "note": c.get("note", ""),
            "byte_tokens": byte.get("tokens"), "union": byte.get("rp"), "kv_read": byte.get("rkv"),
            "union_source": next((x.union_source for x in proj if x.union_source), None)})
    return {"steps": rows, "crossings": crossings,
            "batches": sorted({g["batch"] for g in groups}),
            "note": "ms_per_token elsewhere in this report divides a step by its B tokens; "
                    "dense-step comparisons and attention paths use the B = 1 groups only"}


__all__ = ["batch_summary"]
