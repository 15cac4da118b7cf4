"""The gate's choices drawn from a price table (ByteCross §5.4, App. I).

Left: the configuration the calibrated gate picks over a grid of prompt length (log2) and
answer length (log2), one colour per configuration. Right: the gate's and each always-policy's
speedup over always-dense on the mix, by prompt-length bucket (powers of two).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sparsedecode.dispatch.mix import Mix
from sparsedecode.dispatch.policies import GATE, choose, price
from sparsedecode.dispatch.prices import PriceTable
from sparsedecode.report.figures import _plt

_COLOURS = ["#7f7f7f", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]


def gate_plot(table: PriceTable, mix: Mix, admissible: list[str], path: str | Path) -> Path:
    """Write the two panels to `path` (PNG) and return it."""
    plt = _plt()
    path = Path(path)
    prompts = np.unique(np.geomspace(64, 131072, 48).astype(int))
    answers = np.unique(np.geomspace(16, 4096, 32).astype(int))
    specs = table.specs
    grid = np.full((answers.size, prompts.size), np.nan)
    for j, a in enumerate(answers):
        for i, p in enumerate(prompts):
            best, _ = choose(table, int(p), int(a), admissible)
            grid[j, i] = specs.index(best)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    from matplotlib.colors import ListedColormap

    cmap = ListedColormap(_COLOURS[: len(specs)])
    left.pcolormesh(prompts, answers, grid, cmap=cmap, vmin=-0.5, vmax=len(specs) - 0.5, shading="nearest")
    left.set_xscale("log", base=2)
    left.set_yscale("log", base=2)
    left.set_xlabel("prompt tokens")
    left.set_ylabel("answer tokens")
    left.set_title(f"gate choice, {table.gpu}")
    for k, s in enumerate(specs):
        left.plot([], [], "s", color=_COLOURS[k], label=s + ("" if s in admissible else " (not admissible)"))
    left.legend(fontsize=7, loc="upper left")

    edges = 2 ** np.arange(6, 18)
    mids, series = [], {}
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        sel = (mix.prompt >= lo) & (mix.prompt < hi)
        if sel.sum() < 5:
            continue
        part = Mix(mix.name, mix.prompt[sel], mix.answer[sel])
        mids.append(np.sqrt(lo * hi))
        for r in price(table, part, admissible):
            if r.policy == GATE or r.policy.startswith("always ") and r.policy != "always dense":
                series.setdefault(r.policy, []).append(r.speedup)
    for k, (name, ys) in enumerate(series.items()):
        right.plot(mids, ys, "o-" if name == GATE else ".--", label=name, color=_COLOURS[(k + 1) % len(_COLOURS)])
    right.axhline(1.0, color="k", lw=0.6)
    right.set_xscale("log", base=2)
    right.set_xlabel("prompt tokens (bucket)")
    right.set_ylabel("speedup over always-dense")
    right.set_title(f"{mix.name}: {len(mix)} requests")
    right.legend(fontsize=7)
    fig.suptitle(f"{table.model}: dispatch from {table.source} records", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["gate_plot"]
