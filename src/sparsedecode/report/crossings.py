"""The paper's Table 2 and Figure 6 (left) on our records: crossings beside their committed
predictions, and kernel costs against keep beside the paper's A100 values. The numbers come from
`timing/paper_tables.py`; this module renders them.

`crossings_table`: Table 2, one row per crossing campaign (`crossing_row`). `keep_costs_table`:
kernel cost against keep on our GPU beside the paper's A100 (`keep_costs`).
"""

from __future__ import annotations

from sparsedecode.timing.paper_tables import crossing_row, keep_costs


def _fmt_k(x: float | None) -> str:
    return "" if x is None else f"{x / 1024:.1f}K"


def crossings_table(folders) -> str:
    """Table 2 (ours): every crossing campaign folder, one row each."""
    lines = ["| model | pair | byte crossover | prediction (committed first) | measured crossing [95%] | "
             "blocks | prediction − measured | cells run |", "|---|---|---|---|---|---|---|---|"]
    notes = []
    for f in folders:
        r = crossing_row(f)
        m = r["measured"]
        meas = "" if m is None or m["value"] != m["value"] else (
            f"{_fmt_k(m['value'])} [{_fmt_k(m['low'])}, {_fmt_k(m['high'])}]")
        miss = "" if r["miss"] is None else f"{r['miss'] / 1024:+.1f}K"
        ran = f"{r['cells']}" + ("" if r["planned"] is None else f" of {r['planned']}")
        if r["cells"] == 0:
            notes.append(f"{r['proj']} / {r['sel']}: not run yet (its prediction is committed)")
        lines.append(f"| {r['model']} | {r['proj']} / {r['sel']} | {_fmt_k(r['byte_crossover'])} | "
                     f"{_fmt_k(r['predicted'])} | {meas} | {r['blocks']} | {miss} | {ran} |")
        if r["planned"] is not None and r["cells"] < r["planned"]:
            notes.append(f"{r['proj']} / {r['sel']}: partial ({r['cells']} of {r['planned']} cells), so its "
                         "measured crossing is not final" + (f"; {r['note']}" if r["note"] else ""))
    if notes:
        lines += ["", "Not final: " + "; ".join(notes) + "."]
    return "\n".join(lines)


def keep_costs_table(ours, paper=None) -> str:
    """c_b against keep on our GPU beside the paper's (Figure 6 left, its keep_a100 records)."""
    mine = keep_costs(ours)
    theirs = keep_costs(paper) if paper else {}
    est = lambda e: "" if e is None else f"{e.value:.3f} [{e.low:.3f}, {e.high:.3f}]"  # noqa: E731
    lines = ["| branch | keep | ours: c_b ms [95%], realized bytes | ours: c_b ms, nominal-keep bytes | "
             "realized proj keep | paper A100: c_b ms, nominal-keep bytes |", "|---|---|---|---|---|---|"]
    keys = sorted(set(mine) | {k for k in theirs if k[0] in ("proj", "sel")},
                  key=lambda k: (("proj", "sel", "both").index(k[0]), -k[1], -k[2]))
    for k in keys:
        mode, p, kv = k
        keep = {"proj": f"{p:g}", "sel": f"{kv:g}", "both": f"{p:g} / {kv:g}"}[mode]
        a, b = mine.get(k), theirs.get(k)
        rk = "" if a is None or a["realized_keep"] is None or mode == "sel" else f"{a['realized_keep']:.3f}"
        lines.append(f"| {mode} | {keep} | {est(a and a['records'])} | {est(a and a['nominal'])} | {rk} | "
                     f"{est(b and b['nominal'])} |")
    return "\n".join(lines)


__all__ = ["crossings_table", "keep_costs_table"]
