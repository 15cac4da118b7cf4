"""Predictions before measurements (ByteCross App. D, App. E): from a finished sweep, the
cost-aware crossing of a projection and a selection cell, written as a record, and the crossing
campaign that will measure it, its contexts spaced around the prediction.

    sparsedecode campaign plan-crossing benchmarks/records/h200/campaigns/h200_sweep --group sweep \\
        --prediction P.json --spec examples/campaigns/h200_crossing_8b_p50_s30.toml

A pair whose keep the sweep lacks takes that keep's kernel cost from the keep-ratio campaign
(App. D: "its cost at 32K from the keep-ratio campaign and the context dependence of the swept
cell of the same branch"):

    sparsedecode campaign plan-crossing SWEEP --proj proj0.7 --sel sel0.3 --keep-campaign KEEP ...

The prediction is committed before the campaign runs, so the commit order shows it was made
first; `report` on the crossing campaign then sets it beside the measured crossing (Table 2).
"""

from __future__ import annotations

import json
from pathlib import Path

from sparsedecode.errors import InputError, option

KIND = "crossing_prediction"


METHOD = "App. D: t_b = t_D B_b / B_D + c_b, t_D interpolated log-log, c_b linear, over the group's contexts"
SHIFTED = ("App. D, a keep the sweep lacks: its cost at {n} tokens from the keep-ratio campaign, its context "
           "dependence from the swept cell of the same branch, c_b'(n) = c_b'({n}) + c_b(n) - c_b({n}) "
           "(an additive shift, so a cost near zero stays near zero); B_b' from the byte account at the "
           "keep campaign's realized keep")


def predict_crossing(folder, group: str, *, proj: str | None = None, sel: str | None = None,
                     keep_folder=None) -> dict:
    """The 'crossing_prediction' record of `group` in the campaign `folder` (its proj and sel
    cells, the dense cells of the same blocks); InputError when the group cannot predict one.

    `proj`/`sel` (mode specs such as 'proj0.7', 'sel0.5') ask for a pair the sweep may lack: a
    keep it did not sweep takes its kernel cost from the keep-ratio campaign `keep_folder`
    (ByteCross App. D), see `_shifted`."""
    from sparsedecode.timing.analysis import build_report
    from sparsedecode.timing.cells import load_cells

    if keep_folder is not None and not Path(keep_folder).is_dir():
        raise InputError(f"{_keep_opt(keep_folder)}: no such folder (a keep-ratio campaign's folder)")
    rep = build_report(load_cells(folder))
    g = _group_of(rep, group, folder)
    cross = g["crossing"]
    if cross is None or cross["proj"] is None or cross["sel"] is None:
        raise InputError(f"{folder}: group '{group}' needs one proj and one sel cell to predict a crossing"
                         + (f" ({cross['note']})" if cross else ""))
    spec = {r["cell"]: r["mode_spec"] for r in g["rows"]}
    swept = {"proj": spec[cross["proj"]], "sel": spec[cross["sel"]]}
    want = {"proj": _branch_spec(proj, "proj") or swept["proj"], "sel": _branch_spec(sel, "sel") or swept["sel"]}
    if want == swept:
        pred = cross["predicted"]
        if pred.get("tokens") is None:
            raise InputError(f"{folder}: group '{group}': {pred['note']}")
        byte = cross["byte_crossover"]
        return _record(folder, group, rep, want, pred, None if byte is None else byte["tokens"], METHOD, {})
    if keep_folder is None:
        lacking = " and ".join(want[b] for b in ("proj", "sel") if want[b] != swept[b])
        raise InputError(f"{folder}: the sweep's pair is {swept['proj']}/{swept['sel']}; {lacking} needs its "
                         f"kernel cost from a keep-ratio campaign: pass {_keep_opt('DIR')} (App. D)")
    return _shifted(folder, group, rep, g, cross, swept, want, keep_folder)


def _keep_opt(folder) -> str:
    """How the caller names the keep-ratio campaign: '--keep-campaign DIR' or 'keep_folder=DIR'."""
    return option("keep_folder", folder, placeholder=True, flag="--keep-campaign")


def _group_of(rep: dict, group: str, folder) -> dict:
    groups = {g["name"]: g for g in rep["groups"]}
    if group not in groups:
        raise InputError(f"{folder}: no group '{group}' (groups: {', '.join(groups)})")
    return groups[group]


def _branch_spec(text: str | None, kind: str) -> str | None:
    from sparsedecode.config import SparsityConfig

    if text is None:
        return None
    mode = SparsityConfig.parse(text)
    if mode.kind != kind:
        raise InputError(f"{option(kind, text, placeholder=True)}: give a {kind} mode such as {'proj0.7' if kind == 'proj' else 'sel0.5'}")
    return str(mode)


def _record(folder, group, rep, want, pred, byte_tokens, method, extra) -> dict:
    from sparsedecode.records import stamp

    return stamp({
        "kind": KIND,
        "source": str(folder),
        "group": group,
        "model": rep["model"],
        "gpu": rep["gpu"],
        "proj": want["proj"],
        "sel": want["sel"],
        "predicted_tokens": pred["tokens"],
        "byte_crossover_tokens": byte_tokens,
        "contexts": pred["contexts"],
        "dense_ms": pred["dense_ms"],
        "cost_proj_ms": pred["cost_proj_ms"],
        "cost_sel_ms": pred["cost_sel_ms"],
        "method": method,
        **extra,
    })


def _shifted(folder, group, rep, g, cross, swept, want, keep_folder) -> dict:
    """The prediction of a pair with a keep the sweep lacks (App. D): for that branch, c_b'(n) =
    c_b'(n0) + c_b(n) - c_b(n0), c_b'(n0) the keep campaign's cost at its context n0 and c_b the
    swept cell of the same branch; its bytes B_b'(n) from the byte account at the realized keep
    of the keep campaign's cell (the KV read fraction round(keep n) / n, as the budget keeps)."""
    import numpy as np

    from sparsedecode.account import crossover
    from sparsedecode.config import SparsityConfig
    from sparsedecode.timing import stats
    from sparsedecode.timing.analysis import build_report
    from sparsedecode.timing.cell_fields import timed_step_bytes
    from sparsedecode.timing.cells import load_cells

    cc = load_cells(folder)
    if cc.dims is None:
        raise InputError(f"{folder}: {cc.dims_note}; a keep the sweep lacks takes its bytes from the account")
    kcc = load_cells(keep_folder)
    krep = build_report(kcc)
    if (krep["model"], krep["gpu"]) != (rep["model"], rep["gpu"]):
        raise InputError(f"{_keep_opt(keep_folder)}: {krep['model']} on {krep['gpu']}, the sweep is "
                         f"{rep['model']} on {rep['gpu']}; each GPU takes its costs from its own campaigns (App. D)")
    rows = g["rows"]
    dense = {r["context"]: r for r in rows if r["mode"] == "dense"}
    by = {b: {r["context"]: r for r in rows if r["cell"] == cross[b] and r["kernel_cost_ms"] is not None}
          for b in ("proj", "sel")}
    ctx = sorted(n for n in dense if n in by["proj"] and n in by["sel"])
    if len(ctx) < 2:
        raise InputError(f"{folder}: group '{group}': dense, proj and sel cells with kernel costs share "
                         "fewer than two contexts")
    n = np.array(ctx, dtype=float)
    t_d = np.array([dense[c]["ms_per_token"] for c in ctx])
    b_d = np.array([dense[c]["bytes_per_step"] for c in ctx])
    cost = {b: np.array([by[b][c]["kernel_cost_ms"]["value"] for c in ctx]) for b in by}
    byt = {b: np.array([by[b][c]["bytes_per_step"] for c in ctx]) for b in by}
    subst, keeps = {}, {}
    for b in ("proj", "sel"):
        if want[b] == swept[b]:
            keeps[b] = None
            continue
        k = _keep_row(krep, want[b], keep_folder)
        n0 = k["context"]
        if not n[0] <= n0 <= n[-1]:
            raise InputError(f"{_keep_opt(keep_folder)}: {want[b]} ran at {n0} tokens, outside the sweep's "
                             f"{ctx[0]}..{ctx[-1]}")
        swept_at = float(np.interp(n0, n, cost[b]))
        cost[b] = k["kernel_cost_ms"]["value"] + cost[b] - swept_at
        mode, size = SparsityConfig.parse(want[b]), _itemsize(kcc)
        rp = (k["realized_projection_keep"] or mode.proj_keep) if b == "proj" else 1.0
        kv = [1.0 if b == "proj" else min(np.floor(mode.kv_keep * c + 0.5) / c, 1.0) for c in ctx]
        byt[b] = np.array([timed_step_bytes(cc.dims, c, rp, f, size, size) for c, f in zip(ctx, kv, strict=True)])
        keeps[b] = rp if b == "proj" else mode.kv_keep
        subst[b] = {"mode_spec": want[b], "swept": swept[b], "context": n0,
                    "cost_keep_campaign_ms": k["kernel_cost_ms"]["value"], "cost_swept_ms": swept_at,
                    "realized_keep": rp if b == "proj" else None}

    def ratio(b):
        return lambda x: np.interp(x, n, byt[b]) / np.interp(x, n, b_d)

    tokens = stats.predicted_crossing(n, t_d, cost["proj"], cost["sel"], ratio("proj"), ratio("sel"))
    if np.isnan(tokens):
        raise InputError(f"{folder}: {want['proj']}/{want['sel']}: no cost-aware crossing: the predicted "
                         f"difference does not change sign inside the sweep ({ctx[0]}..{ctx[-1]})")
    rp = keeps["proj"] if keeps["proj"] is not None else _mean_of(rows, cross["proj"], "realized_projection_keep")
    rkv = keeps["sel"] if keeps["sel"] is not None else _mean_of(rows, cross["sel"], "kv_read_fraction")
    try:
        byte = crossover(cc.dims, min(rp, 1.0), min(rkv, 1.0))
    except InputError:
        byte = float("inf")
    pred = {"tokens": float(tokens), "contexts": ctx, "dense_ms": t_d.tolist(),
            "cost_proj_ms": cost["proj"].tolist(), "cost_sel_ms": cost["sel"].tolist()}
    n0 = next(s["context"] for s in subst.values())
    return _record(folder, group, rep, want, pred, None if np.isinf(byte) else float(byte),
                   SHIFTED.format(n=n0), {"keep_campaign": str(keep_folder), "substituted": subst})


def _keep_row(krep: dict, mode_spec: str, folder) -> dict:
    rows = [r for g in krep["groups"] for r in g["rows"] if r["mode_spec"] == mode_spec]
    costed = [r for r in rows if r["kernel_cost_ms"] is not None]
    if not costed:
        have = sorted({r["mode_spec"] for g in krep["groups"] for r in g["rows"] if r["kernel_cost_ms"]})
        raise InputError(f"{_keep_opt(folder)}: no kernel cost of {mode_spec} (costed modes: "
                         f"{', '.join(have) or 'none'})")
    if len({r["context"] for r in costed}) > 1:
        raise InputError(f"{_keep_opt(folder)}: {mode_spec} ran at several contexts "
                         f"({sorted({r['context'] for r in costed})}); a keep-ratio campaign holds one")
    return costed[0]


def _mean_of(rows: list[dict], cell: str, key: str) -> float:
    vals = [r[key] for r in rows if r["cell"] == cell and r[key] is not None]
    return sum(vals) / len(vals) if vals else 1.0


def _itemsize(cc) -> int:
    """Bytes per weight and cache element of the campaign's cells (one dtype, or InputError)."""
    sizes = {"float32": 4, "bfloat16": 2, "float16": 2}
    dtypes = {cc.extra(c).dtype or "bfloat16" for c in cc.cells}
    if len(dtypes) != 1 or not dtypes <= set(sizes):
        raise InputError(f"{cc.folder}: cells of dtypes {sorted(dtypes)}; one of {', '.join(sizes)} is needed")
    return sizes[dtypes.pop()]


def crossing_contexts(predicted: float, spacing: int, half_width: int, window: int | None) -> list[int]:
    """Contexts every `spacing` tokens (multiples of it) covering predicted ± half_width, inside
    the model window."""
    if spacing < 1 or half_width < spacing:
        raise InputError(f"{option('spacing')} must be >= 1 and {option('half_width')} >= {option('spacing')} (got {spacing}, {half_width})")
    lo = max(spacing, int((predicted - half_width) // spacing) * spacing)
    hi = int(-(-(predicted + half_width) // spacing)) * spacing
    out = list(range(lo, hi + 1, spacing))
    if window is not None:
        out = [n for n in out if n <= window]
    if len(out) < 2 or not out[0] <= predicted <= out[-1]:
        raise InputError(f"the prediction {predicted:.0f} leaves fewer than two contexts around it inside "
                         f"the model window ({window}); lower {option('half_width')}")
    return out


def crossing_spec(pred: dict, name: str, contexts: list[int], blocks: int, cell: dict) -> str:
    """The campaign TOML that measures the predicted crossing: proj and sel at `contexts` (no
    dense cell: the crossing pairs the two within each block, as the paper's crossing campaigns),
    with the sweep's model, init, dtype, device and fill (`cell`: one of its records). The names
    it writes (model, modes, settings) come from records, so the text is checked as a campaign
    spec before it is returned: a bad name is refused before anything is written."""
    from sparsedecode.timing.spec import parse_spec

    if blocks < 3:
        raise InputError(f"{option('blocks', blocks, placeholder=True)}: a crossing interval over block resamples wants at least 3")
    model = pred.get("model")
    if not isinstance(model, str) or not model.strip() or not model.isprintable() or '"' in model \
            or "\\" in model or len(model) > 300:
        raise InputError(f"the sweep's records name the model {str(model)[:80]!r}, which a campaign spec cannot "
                         "hold: expected a known model name, a hub id or a config path")
    q = json.dumps  # a TOML basic string: quotes and backslashes escaped
    head = (f"# The crossing of {pred['proj']} and {pred['sel']} on {model} dims, measured around its\n"
            f"# cost-aware prediction of {pred['predicted_tokens']:.0f} tokens (App. D), which\n"
            f"# `sparsedecode campaign plan-crossing {pred['source']} --group {pred['group']}{_pair_flags(pred)}`\n"
            "# wrote and "
            "committed before this campaign ran (ByteCross App. E: contexts at most 8K apart).\n#\n"
            f"#   sparsedecode campaign run <this file> --out DIR\n\n")
    if any("\n" in str(v) or "\r" in str(v) for v in (pred["proj"], pred["sel"], pred["source"], pred["group"])):
        raise InputError("the prediction's modes, source and group must be single-line names")
    ctx = ", ".join(str(n) for n in contexts)
    text = head + "\n".join([
        f"name = {q(name)}", f"model = {q(model)}", f'init = {q(cell.get("model", {}).get("init", "random"))}',
        f'dtype = {q(cell.get("dtype"))}', f'device = {q(cell.get("device"))}', f"blocks = {blocks}", "repeats = 5",
        "steps = 50", "warmup = 5", f'fill = {q(cell.get("fill", "random"))}', "seed = 0", "",
        "[[grid]]", 'group = "crossing"', f"contexts = [{ctx}]",
        f"modes = [{q(pred['proj'])}, {q(pred['sel'])}]", 'pairs = "crossing"',
        f'attention = {q(cell.get("attention", "split_k"))}', "",
    ])
    try:
        parse_spec(text, where="the crossing campaign")
    except InputError as e:
        raise InputError(f"{e} (from the sweep's records; nothing was written)") from None
    return text


def _pair_flags(pred: dict) -> str:
    """The plan-crossing flags that name a pair the sweep lacks (empty for the swept pair)."""
    if not pred.get("substituted"):
        return ""
    return f" --proj {pred['proj']} --sel {pred['sel']} --keep-campaign {pred['keep_campaign']}"


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
