"""What an adapter costs the decode step (issue 45 item 3; SATS paper §4.2 'Fine-tuning Methods'),
from one timing campaign whose grids time the same modes without an adapter, with it merged
(kernels lora.merge=true, the default) and with it apart (lora.merge=false): e.g.
`examples/campaigns/h200_lora_8b.toml`.

Per mode, context and apart variant (the cell's --kernels, e.g. `lora.merge=false` against
`lora.merge=false,gemv.lora_prefetch=false`: one row each): the step without an adapter, merged
and apart (median over blocks of each cell's ms/token), the apart step's extra time over the
step without one, and the adapter's own bytes per step beside it: per adapted site the kept
rows of A^T (the site's realized keep times its input width; every row in a dense step) plus all
of B^T, times the rank and the dtype's size, over every layer. 'extra / bytes' divides the extra
time by those bytes at the measured ceiling (the campaign's ceiling.json); the issue's target is
at most 1.3. Nothing here is measured.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from sparsedecode.errors import InputError
from sparsedecode.projection.thresholds import act_keep_of_mlp
from sparsedecode.records import read_record

TARGET = 1.3  # issue 45: the adapter's extra time within 1.3x of its bytes at the measured ceiling
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def adapter_bytes(dims, adapter: dict, keep: float, dtype: str, act_keep: float | None = None) -> float:
    """Bytes an adapter's factors take from memory in one decode step: per site r * (keep * in +
    out) elements (A^T in kept rows only, B^T whole), every adapted projection of every layer.
    `adapter`: a record's adapter block (rank, targets). Under CATS/SATS thresholds (`act_keep`: the
    kept fraction of SiLU(gate) channels) the attention sites and gate read A^T whole, up reads
    A^T whole (u = A x: its input is not sparse) and B^T in kept rows only, down reads A^T in kept
    rows only (SATS §4.2; docs/kernels/lora_gemv.md)."""
    from sparsedecode.projection.lora import TARGETS, projection_shape

    r, mods = int(adapter["rank"]), TARGETS[adapter["targets"]]

    def elems(m):
        out, inp = projection_shape(dims, m)
        if act_keep is None:
            return r * (keep * inp + out)
        return r * (inp + act_keep * out if m == "up_proj" else act_keep * inp + out if m == "down_proj" else inp + out)

    return sum(elems(m) for m in mods) * dims.n_layers * DTYPE_BYTES[dtype]


def load(folder: str | Path) -> dict:
    """The campaign's ok cells (validated by `timing.cells.load_cells`) by (form, mode, context):
    {'cells': {...: [record, ...]}, 'dims', 'gpu', 'dtype', 'ceiling_gbps', 'ceiling_note'}."""
    from sparsedecode.timing.ceiling import campaign_ceiling
    from sparsedecode.timing.cells import load_cells

    cc = load_cells(folder)
    if cc.dims is None:
        raise InputError(f"{folder}: the records name no model dims ({cc.dims_note})")
    by: dict[tuple, list[dict]] = {}
    dtypes, groups = set(), {}
    for cell in cc.cells:
        rec = read_record(cell.path)
        ad = rec.get("adapter")
        merge = ((rec.get("kernels") or {}).get("lora") or {}).get("merge", True)
        form = "none" if ad is None else "merged" if merge else "apart"
        variant = ((rec.get("spec") or {}).get("kernels") or "") if form == "apart" else ""
        by.setdefault((form, variant, rec["cell"], cell.context), []).append(rec)
        groups.setdefault((form, variant), set()).add(rec.get("group"))
        dtypes.add(rec.get("dtype"))
    several = {"/".join(filter(None, f)): sorted(g) for f, g in groups.items() if len(g) > 1}
    if several:
        raise InputError(f"{folder}: several groups time one form {several} with the same kernels: this table "
                         "sets one of each form side by side; compare them with `sparsedecode report`")
    if not any(k[0] == "apart" for k in by) or not any(k[0] == "none" for k in by):
        raise InputError(f"{folder}: no cells with an adapter apart (lora.merge=false) and without one; "
                         "time both in one campaign (examples/campaigns/h200_lora_8b.toml)")
    if len(dtypes) != 1:
        raise InputError(f"{folder}: cells of several dtypes {sorted(map(str, dtypes))}: tabulate one campaign")
    gbps, note = campaign_ceiling(cc, None)
    return {"cells": by, "dims": cc.dims, "gpu": cc.gpu, "dtype": dtypes.pop(), "ceiling_gbps": gbps,
            "ceiling_note": note, "cpu": cc.cpu}


def rows(data: dict) -> list[dict]:
    """One row per (mode, context, apart variant) that has a cell without an adapter and one apart;
    the variants in the order of their kernels string (the shortest, the launcher's own, first)."""
    cells, out = data["cells"], []

    def med(key):
        return statistics.median(r["ms_per_token"] for r in cells[key])

    variants = sorted({k[1] for k in cells if k[0] == "apart"}, key=lambda v: (len(v), v))
    for cell, n in sorted({(k[2], k[3]) for k in cells}, key=lambda k: (k[1], k[0] != "dense", k[0])):
        for v in variants:
            if ("none", "", cell, n) not in cells or ("apart", v, cell, n) not in cells:
                continue
            ms = {"none": med(("none", "", cell, n)), "apart": med(("apart", v, cell, n))}
            if ("merged", "", cell, n) in cells:
                ms["merged"] = med(("merged", "", cell, n))
            apart = cells[("apart", v, cell, n)]
            keep = statistics.median((r.get("realized_projection_keep") or 1.0) for r in apart)
            mlp = [r["realized_mlp_keep"] for r in apart if r.get("realized_mlp_keep") is not None]
            act = None if not mlp else act_keep_of_mlp(data["dims"], statistics.median(mlp))  # CATS/SATS
            mb = adapter_bytes(data["dims"], apart[0]["adapter"], keep, data["dtype"], act) / 1e6
            extra_us = (ms["apart"] - ms["none"]) * 1e3
            at_ceiling = None if data["ceiling_gbps"] is None else mb * 1e6 / (data["ceiling_gbps"] * 1e9) * 1e6
            out.append({"cell": cell, "context": n, "variant": v, "keep": keep, "ms": ms, "extra_us": extra_us,
                        "merged_extra_us": None if "merged" not in ms else (ms["merged"] - ms["none"]) * 1e3,
                        "adapter_mb": mb, "bytes_us": at_ceiling,
                        "ratio": None if not at_ceiling else extra_us / at_ceiling,
                        "blocks": len(apart)})
    if not out:
        raise InputError("no mode has both a cell without an adapter and one with it apart")
    return out


def markdown(data: dict) -> str:
    """The table: one row per mode, context and apart variant."""
    def ms(v):
        return "" if v is None else f"{v:.3f}"

    head = ("| mode | context | apart kernels | realized keep | no adapter (ms) | merged (ms) | apart (ms) "
            "| apart extra (µs) | merged extra (µs) | adapter MB/step | its bytes at the ceiling (µs) | extra / bytes (target <= 1.3) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows(data):
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.1f}x" + (" (met)" if r["ratio"] <= TARGET else " (missed)")
        lines.append(f"| {r['cell']} | {r['context']} | `{r['variant']}` | {r['keep']:.3f} | {ms(r['ms'].get('none'))} | "
                     f"{ms(r['ms'].get('merged'))} | {ms(r['ms'].get('apart'))} | {r['extra_us']:+.1f} | "
                     f"{'' if r['merged_extra_us'] is None else format(r['merged_extra_us'], '+.1f')} | "
                     f"{r['adapter_mb']:.2f} | {'' if r['bytes_us'] is None else format(r['bytes_us'], '.1f')} | {ratio} |")
    return "\n".join(lines) + "\n"


__all__ = ["TARGET", "adapter_bytes", "load", "markdown", "rows"]
