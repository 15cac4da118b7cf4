"""Figures 3, 4 and 5 of the ByteCross paper redrawn from a timing report (§4.2-4.4).

Each function takes the dict of ``timing.analysis.build_report`` (records alone,
nothing re-measured), writes one PNG with one panel per group (or per set of
attention-path groups) and returns ``{"path": ...}``, or ``{"skipped": reason}``
when the campaign holds no data for that figure.

* fig3_speedup.png (Figure 3): paired speedup of each sparse cell against
  context on a log2 axis, 95% block-resampling intervals as error bars, the
  cell's byte bound dashed in the same colour, the byte crossover n* dotted.
* fig4_advantage.png (Figure 4): selection advantage t_proj - t_sel with its
  interval, the cost-aware predicted difference (App. D) as a line, the
  measured crossing, and n* dotted.
* fig5_attention.png (Figure 5): dense step time and the sparse cells' speedups
  under each attention path, for groups that differ only by attention path.
"""

from __future__ import annotations

import math
from pathlib import Path

_MODE_ORDER = {"proj": 0, "sel": 1, "window": 2, "both": 3}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ctx_axis(ax, log2: bool = True) -> None:
    import matplotlib.ticker

    if log2:
        ax.set_xscale("log", base=2)
    else:  # ticks on whole multiples of 1K, 2K, 4K, ... so labels stay short
        lo, hi = ax.get_xlim()
        step = 1024
        while (hi - lo) / step > 8:
            step *= 2
        ax.xaxis.set_major_locator(matplotlib.ticker.MultipleLocator(step))
    ax.xaxis.set_major_formatter(
        matplotlib.ticker.FuncFormatter(lambda x, _: f"{x / 1024:g}K" if x >= 1024 else f"{x:g}"))
    ax.set_xlabel("context (tokens, K = 1,024)")
    ax.grid(True, which="both", alpha=0.3)


def _title(rep: dict, what: str) -> str:
    cpu = " [CPU]" if rep["label"] == "CPU" else ""
    return f"{rep['model']} on {rep['gpu']}{cpu}: {what}"


def _panels(n: int, width: float = 6.4, height: float = 4.2):
    plt = _plt()
    fig, axes = plt.subplots(n, 1, figsize=(width, height * n), squeeze=False)
    return plt, fig, [a[0] for a in axes]


def _save(plt, fig, out: Path) -> dict:
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return {"path": str(out)}


def _yerr(ests: list[dict]) -> list[list[float]]:
    return [[e["value"] - e["low"] for e in ests], [e["high"] - e["value"] for e in ests]]


def _n_star(g: dict) -> float | None:
    x = g.get("crossing") or {}
    nb = x.get("byte_crossover") or {}
    return nb.get("tokens")


def fig3_speedup(rep: dict, out: str | Path) -> dict:
    """Figure 3: speedup of each mode against context with byte bounds and n*."""
    groups = [g for g in rep["groups"] if any(r["speedup"] for r in g["rows"])]
    if not groups:
        return {"skipped": "no sparse cell has a dense partner, so there are no speedups"}
    plt, fig, axes = _panels(len(groups))
    for ax, g in zip(axes, groups, strict=True):
        cells = sorted({(r["mode"], r["cell"]) for r in g["rows"] if r["speedup"]},
                       key=lambda mc: (_MODE_ORDER.get(mc[0], 9), mc[1]))
        for i, (mode, cell) in enumerate(cells):
            rows = [r for r in g["rows"] if r["cell"] == cell and r["speedup"]]
            n = [r["context"] for r in rows]
            est = [r["speedup"] for r in rows]
            color = f"C{i}"
            ax.errorbar(n, [e["value"] for e in est], yerr=_yerr(est), fmt="o-", color=color,
                        capsize=3, label=f"{cell} ({mode})")
            bound = [(r["context"], r["byte_bound"]) for r in rows if r["byte_bound"]]
            if bound:
                ax.plot(*zip(*bound, strict=True), "--", color=color, alpha=0.8,
                        label=f"{cell} byte bound")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ns = _n_star(g)
        lo, hi = min(r["context"] for r in g["rows"]), max(r["context"] for r in g["rows"])
        if ns and lo / 2 <= ns <= 2 * hi:
            ax.axvline(ns, color="gray", linestyle=":", label=f"byte crossover n* = {ns / 1024:.1f}K")
        _ctx_axis(ax)
        ax.set_ylabel("speedup over dense (paired)")
        att = f", attention {g['attention']}" if g["attention"] else ""
        ax.set_title(_title(rep, f"group {g['name']}{att}"), fontsize=9)
        ax.legend(fontsize=7)
    return _save(plt, fig, Path(out))


def fig4_advantage(rep: dict, out: str | Path) -> dict:
    """Figure 4: t_proj - t_sel against context, the cost-aware prediction, crossings."""
    groups = [g for g in rep["groups"] if g["crossing"] and len(g["crossing"]["rows"]) >= 2]
    if not groups:
        return {"skipped": "no group holds one proj and one sel cell at two or more contexts"}
    plt, fig, axes = _panels(len(groups))
    for ax, g in zip(axes, groups, strict=True):
        x = g["crossing"]
        rows = x["rows"]
        n = [r["context"] for r in rows]
        est = [r["difference_ms"] for r in rows]
        ax.errorbar(n, [e["value"] for e in est], yerr=_yerr(est), fmt="o", color="C0", capsize=3,
                    label="measured t_proj − t_sel (95%)")
        p = x["predicted"] or {}
        if p.get("curve"):
            cx, cy = zip(*p["curve"], strict=True)
            ax.plot(cx, cy, "-", color="C1", label=f"cost-aware prediction (group {p['source_group']})")
        if p.get("tokens"):
            ax.plot([p["tokens"]], [0.0], "D", color="C1",
                    label=f"predicted crossing {p['tokens'] / 1024:.1f}K")
        c = x.get("committed")
        if c and c.get("tokens"):
            ax.axvline(c["tokens"], color="C1", linestyle="--", linewidth=1,
                       label=f"prediction committed before the run {c['tokens'] / 1024:.1f}K")
        m = x["measured"]
        if m and not math.isnan(m["value"]):
            ax.axvline(m["value"], color="C0", linewidth=1,
                       label=f"measured crossing {m['value'] / 1024:.1f}K")
            if not (math.isnan(m["low"]) or math.isnan(m["high"])):
                ax.axvspan(m["low"], m["high"], color="C0", alpha=0.12)
        ax.axhline(0.0, color="black", linewidth=0.8)
        ns = _n_star(g)
        if ns and min(n) / 2 <= ns <= 2 * max(n):
            ax.axvline(ns, color="gray", linestyle=":", label=f"byte crossover n* = {ns / 1024:.1f}K")
        _ctx_axis(ax, log2=max(n) / min(n) > 8)
        ax.set_ylabel("selection advantage t_proj − t_sel (ms)")
        ax.set_title(_title(rep, f"group {g['name']}: {x['proj']} − {x['sel']}"), fontsize=9)
        ax.legend(fontsize=7)
    labels = [t for ax in axes for t in ax.get_legend_handles_labels()[1]]
    return {**_save(plt, fig, Path(out)), "labels": labels}


def fig5_attention(rep: dict, out: str | Path) -> dict:
    """Figure 5: dense step time and sparse speedups under each attention path (§4.4)."""
    clusters = rep["attention_paths"]
    if not clusters:
        return {"skipped": "no groups that differ only by attention path (records need an "
                           "'attention' field and the same cells in each group)"}
    groups = {g["name"]: g for g in rep["groups"]}
    plt = _plt()
    fig, axes = plt.subplots(len(clusters), 2, figsize=(11, 4.2 * len(clusters)), squeeze=False)
    for (left, right), cl in zip(axes, clusters, strict=True):
        bound_drawn: set[str] = set()
        for i, member in enumerate(cl["groups"]):
            g, color = groups[member["group"]], f"C{i}"
            dense = [r for r in g["rows"] if r["mode"] == "dense"]
            left.plot([r["context"] for r in dense], [r["ms_per_token"] for r in dense], "o-",
                      color=color, label=f"dense, {member['attention']}")
            for j, cell in enumerate(sorted({r["cell"] for r in g["rows"] if r["speedup"]})):
                rows = [r for r in g["rows"] if r["cell"] == cell and r["speedup"]]
                est = [r["speedup"] for r in rows]
                right.errorbar([r["context"] for r in rows], [e["value"] for e in est],
                               yerr=_yerr(est), fmt="os^v"[j % 4] + "-", color=color, capsize=3,
                               label=f"{cell}, {member['attention']}")
                bound = [(r["context"], r["byte_bound"]) for r in rows if r["byte_bound"]]
                if bound and cell not in bound_drawn:
                    right.plot(*zip(*bound, strict=True), "--", color="black", alpha=0.7,
                               label=f"{cell} byte bound")
                    bound_drawn.add(cell)
        for ax in (left, right):
            _ctx_axis(ax)
            ax.legend(fontsize=7)
        right.axhline(1.0, color="black", linewidth=0.8)
        left.set_ylabel("dense step time (ms/token)")
        right.set_ylabel("speedup over dense of the same path")
        left.set_title(_title(rep, "dense decoding per attention path"), fontsize=9)
        right.set_title("sparse speedup per attention path", fontsize=9)
    return _save(plt, fig, Path(out))


FIGURES = {
    "fig3_speedup.png": fig3_speedup,
    "fig4_advantage.png": fig4_advantage,
    "fig5_attention.png": fig5_attention,
}


def draw_figures(rep: dict, out_dir: str | Path) -> dict[str, dict]:
    """Every figure into ``out_dir``: name -> {"path"} or {"skipped": reason}."""
    return {name: fn(rep, Path(out_dir) / name) for name, fn in FIGURES.items()}


__all__ = ["FIGURES", "draw_figures", "fig3_speedup", "fig4_advantage", "fig5_attention"]
