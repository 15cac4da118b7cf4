"""Predictions before measurements (ByteCross App. D, App. E): from a finished sweep, the
cost-aware crossing of a projection and a selection cell, written as a record, and the crossing
campaign that will measure it, its contexts spaced around the prediction.

    sparsedecode campaign plan-crossing benchmarks/records/h200/campaigns/h200_sweep --group sweep \\
        --prediction P.json --spec examples/campaigns/h200_crossing_8b_p50_s30.toml

The prediction is committed before the campaign runs, so the commit order shows it was made
first; `report` on the crossing campaign then sets it beside the measured crossing (Table 2).
"""

from __future__ import annotations

from pathlib import Path

from sparsedecode.errors import InputError

KIND = "crossing_prediction"


def predict_crossing(folder, group: str) -> dict:
    """The 'crossing_prediction' record of `group` in the campaign `folder` (its proj and sel
    cells, the dense cells of the same blocks); InputError when the group cannot predict one."""
    from sparsedecode.records import stamp
    from sparsedecode.report.timing_report import build_report
    from sparsedecode.timing.cells import load_cells

    cc = load_cells(folder)
    rep = build_report(cc)
    groups = {g["name"]: g for g in rep["groups"]}
    if group not in groups:
        raise InputError(f"{folder}: no group '{group}' (groups: {', '.join(groups)})")
    cross = groups[group]["crossing"]
    if cross is None or cross["proj"] is None or cross["sel"] is None:
        raise InputError(f"{folder}: group '{group}' needs one proj and one sel cell to predict a crossing"
                         + (f" ({cross['note']})" if cross else ""))
    pred = cross["predicted"]
    if pred.get("tokens") is None:
        raise InputError(f"{folder}: group '{group}': {pred['note']}")
    spec = {r["cell"]: r["mode_spec"] for r in groups[group]["rows"]}
    byte = cross["byte_crossover"]
    return stamp({
        "kind": KIND,
        "source": str(folder),
        "group": group,
        "model": rep["model"],
        "gpu": rep["gpu"],
        "proj": spec[cross["proj"]],
        "sel": spec[cross["sel"]],
        "predicted_tokens": pred["tokens"],
        "byte_crossover_tokens": None if byte is None else byte["tokens"],
        "contexts": pred["contexts"],
        "dense_ms": pred["dense_ms"],
        "cost_proj_ms": pred["cost_proj_ms"],
        "cost_sel_ms": pred["cost_sel_ms"],
        "method": "App. D: t_b = t_D B_b / B_D + c_b, t_D interpolated log-log, c_b linear, over the group's contexts",
    })


def crossing_contexts(predicted: float, spacing: int, half_width: int, window: int | None) -> list[int]:
    """Contexts every `spacing` tokens (multiples of it) covering predicted ± half_width, inside
    the model window."""
    if spacing < 1 or half_width < spacing:
        raise InputError(f"--spacing must be >= 1 and --half-width >= --spacing (got {spacing}, {half_width})")
    lo = max(spacing, int((predicted - half_width) // spacing) * spacing)
    hi = int(-(-(predicted + half_width) // spacing)) * spacing
    out = list(range(lo, hi + 1, spacing))
    if window is not None:
        out = [n for n in out if n <= window]
    if len(out) < 2 or not out[0] <= predicted <= out[-1]:
        raise InputError(f"the prediction {predicted:.0f} leaves fewer than two contexts around it inside "
                         f"the model window ({window}); lower --half-width")
    return out


def crossing_spec(pred: dict, name: str, contexts: list[int], blocks: int, cell: dict) -> str:
    """The campaign TOML that measures the predicted crossing: proj and sel at `contexts` (no
    dense cell: the crossing pairs the two within each block, as the paper's crossing campaigns),
    with the sweep's model, init, dtype, device and fill (`cell`: one of its records)."""
    if blocks < 3:
        raise InputError(f"--blocks {blocks}: a crossing interval over block resamples wants at least 3")
    head = (f"# The crossing of {pred['proj']} and {pred['sel']} on {pred['model']} dims, measured around its\n"
            f"# cost-aware prediction of {pred['predicted_tokens']:.0f} tokens (App. D), which\n"
            f"# `sparsedecode campaign plan-crossing {pred['source']} --group {pred['group']}` wrote and\n"
            "# committed before this campaign ran (ByteCross App. E: contexts at most 8K apart).\n#\n"
            f"#   sparsedecode campaign run <this file> --out DIR\n\n")
    ctx = ", ".join(str(n) for n in contexts)
    return head + "\n".join([
        f'name = "{name}"', f'model = "{pred["model"]}"', f'init = "{cell.get("model", {}).get("init", "random")}"',
        f'dtype = "{cell["dtype"]}"', f'device = "{cell["device"]}"', f"blocks = {blocks}", "repeats = 5",
        "steps = 50", "warmup = 5", f'fill = "{cell.get("fill", "random")}"', "seed = 0", "",
        "[[grid]]", 'group = "crossing"', f"contexts = [{ctx}]",
        f'modes = ["{pred["proj"]}", "{pred["sel"]}"]', 'pairs = "crossing"',
        f'attention = "{cell.get("attention", "split_k")}"', "",
    ])


def one_cell_record(folder) -> dict:
    """A timing-cell record of the campaign `folder` (for the settings a new campaign copies)."""
    from sparsedecode.textfile import read_json

    files = sorted(Path(folder, "cells").rglob("*.json"))
    for f in files:
        rec = read_json(f, "timing record")
        if rec.get("kind") == "timing_cell" and rec.get("status") == "ok":
            return rec
    raise InputError(f"{folder}: no ok timing_cell record under cells/ (a campaign folder of ours)")


__all__ = ["KIND", "crossing_contexts", "crossing_spec", "one_cell_record", "predict_crossing"]
