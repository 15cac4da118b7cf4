"""Figure of the byte bounds of the three modes against context (ByteCross §3.3, Fig. 3 dashed lines)."""

from __future__ import annotations

import math
from pathlib import Path

from sparsedecode.account import ModelDims, bounds, crossover
from sparsedecode.errors import InputError


def plot_bounds(
    dims: ModelDims,
    rp: float,
    rkv: float,
    out: str | Path,
    ff_only: bool = False,
    weight_bytes: float = 2,
    kv_bytes: float = 2,
    n_max: int | None = None,
) -> Path:
    """Write the bound curves (projection, KV, both) with n* dotted; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    out = Path(out)
    if out.suffix.lower() not in {".png", ".pdf", ".svg"}:
        raise InputError(f"--out {out}: give a .png, .pdf or .svg file name")
    n_star = crossover(dims, rp, rkv, ff_only, weight_bytes, kv_bytes)
    hi = n_max or (int(4 * n_star) if math.isfinite(n_star) else 128 * 1024)
    lo = 512
    if hi <= lo:
        raise InputError(f"--max-context must exceed {lo} tokens")
    steps = 200
    ns = [round(lo * (hi / lo) ** (i / (steps - 1))) for i in range(steps)]
    bs = [bounds(dims, n, rp, rkv, ff_only, weight_bytes, kv_bytes) for n in ns]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    sites = "FF-only" if ff_only else "7 projections"
    ax.plot(ns, [b.projection for b in bs], "--", label=f"projection ({sites}), r_P={rp:g}")
    ax.plot(ns, [b.kv for b in bs], "--", label=f"KV, r_KV={rkv:g}")
    ax.plot(ns, [b.both for b in bs], "--", label="both")
    if math.isfinite(n_star) and lo <= n_star <= hi:
        ax.axvline(n_star, color="gray", linestyle=":", label=f"n* = {n_star / 1024:.1f}K")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(
        matplotlib.ticker.FuncFormatter(lambda x, _: f"{x / 1024:g}K" if x >= 1024 else f"{x:g}")
    )
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ideal speedup (byte bound)")
    ax.set_title(f"{dims.name}: byte bounds of a decode step")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
