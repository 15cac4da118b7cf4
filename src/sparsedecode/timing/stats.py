"""Paired timing statistics of the ByteCross paper (arXiv 2609.33889).

* Speedups are paired: each sparse cell is divided into the dense cell of the
  same block and context (App. A "Timing"; Figure 3 of §4.2, Table 17 of App. H).
* Intervals enumerate every resample with replacement of the B blocks, B**B of
  them (3,125 for five blocks, 256 for four, 27 for three; App. E, App. H), and
  take the 95% percentile interval of the statistic over them.
* A measured crossing interpolates the mean difference t_proj - t_sel linearly
  between the last context where the projection branch leads and the next one,
  where the selection leads; its interval applies the same block resamples to
  the whole curve and locates the crossing in each (§4.3, App. E, Table 12/13).
* Kernel cost c_b = t_b - t_D * B_b / B_D, and the cost-aware prediction solves
  t_P(n) = t_KV(n) with t_b(n) = t_D(n) B_b(n) / B_D(n) + c_b(n), t_D interpolated
  log-log in context and c_b linearly (App. D, Table 10, Table 2).

Times are step latencies in ms; contexts are in tokens (the paper's K is 1,024).
Percentiles use numpy's default "linear" rule (Hyndman-Fan type 7) at 2.5 and
97.5.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import numpy as np

from sparsedecode.errors import InputError
from sparsedecode.timing.paper import PaperCell

LEVEL = 0.95


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its block-resampling percentile interval.

    ``n_undefined`` counts resamples where the statistic does not exist (a
    resampled curve that never crosses); they are left out of the percentiles.
    """

    value: float
    low: float
    high: float
    n_resamples: int
    n_undefined: int = 0


def as_dict(e: Estimate | None) -> dict | None:
    """An estimate as a JSON-ready dict, as reports keep it; None stays None."""
    return None if e is None else asdict(e)


def mean_of(values) -> float | None:
    """The mean of the values that are not None (what records left out does not count); None
    when there are none."""
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else None


def block_resamples(n_blocks: int) -> np.ndarray:
    """Every resample with replacement of ``n_blocks`` blocks: int array (B**B, B)."""
    if n_blocks < 1:
        raise InputError(f"need at least one block, got {n_blocks}")
    if n_blocks > 7:
        raise InputError(
            f"{n_blocks} blocks give {n_blocks**n_blocks} resamples; enumeration is meant for B <= 7"
        )
    return np.array(list(itertools.product(range(n_blocks), repeat=n_blocks)), dtype=np.intp)


def percentile_interval(samples: np.ndarray, level: float = LEVEL) -> tuple[float, float, int]:
    """(low, high, n_undefined): percentile interval of the finite samples (numpy 'linear')."""
    samples = np.asarray(samples, dtype=float)
    finite = samples[np.isfinite(samples)]
    if finite.size == 0:
        return float("nan"), float("nan"), samples.size
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(finite, [tail, 100 - tail])
    return float(low), float(high), int(samples.size - finite.size)


def resampled_mean(per_block: Iterable[float], level: float = LEVEL) -> Estimate:
    """Mean over blocks of a paired statistic with its all-resamples interval; per_block (B,)."""
    x = np.asarray(list(per_block), dtype=float)
    if x.ndim != 1 or x.size == 0:
        raise InputError(f"per-block values must be a non-empty 1-D sequence, got shape {x.shape}")
    idx = block_resamples(x.size)  # (R, B)
    means = x[idx].mean(axis=1)  # (R,)
    low, high, bad = percentile_interval(means, level)
    return Estimate(float(x.mean()), low, high, len(idx), bad)


# ---- pairing cells -------------------------------------------------------------------------


def _times(
    cells: Iterable[PaperCell], cell: str, group: str | None
) -> dict[tuple[str, str, int, int], float]:
    """(campaign, group, context, block) -> ms of every cell named ``cell``."""
    out = {}
    for c in cells:
        if c.cell == cell and (group is None or c.group == group):
            key = (c.campaign, c.group, c.context, c.block)
            if key in out:
                raise InputError(
                    f"{c.path}: duplicate cell '{cell}' for campaign/group/context/block {key}"
                )
            out[key] = c.ms_per_token
    return out


def _by_block(pairs: dict[tuple[str, str, int, int], float]) -> dict[tuple[str, int], np.ndarray]:
    """(campaign, context) -> per-block values (B,) in block order.

    Block labels need not be 0..B-1 (the RTX A6000 crossing campaign has blocks
    0, 2, 3, 4), but every context of one campaign must hold the same blocks.
    """
    grouped: dict[tuple[str, int], dict[int, float]] = {}
    for (campaign, _group, context, block), value in pairs.items():
        grouped.setdefault((campaign, context), {})[block] = value
    labels: dict[str, list[int]] = {}
    out = {}
    for (campaign, context), blocks in grouped.items():
        seen = labels.setdefault(campaign, sorted(blocks))
        if sorted(blocks) != seen:
            raise InputError(
                f"campaign {campaign} context {context}: blocks {sorted(blocks)} differ from {seen}"
            )
        out[(campaign, context)] = np.array([blocks[b] for b in seen])
    return out


def paired_speedups(
    cells: Iterable[PaperCell], cell: str, dense: str = "dense"
) -> dict[int, np.ndarray]:
    """context -> per-block speedups t_dense / t_cell (B,), paired on campaign, group, context, block.

    Raises InputError where a sparse cell has no dense partner. Window cells, whose
    dense partners sit in another campaign folder, are not paired here.
    """
    cells = list(cells)
    sparse, base = _times(cells, cell, None), _times(cells, dense, None)
    if not sparse:
        raise InputError(f"no cells named '{cell}'")
    missing = sorted(set(sparse) - set(base))
    if missing:
        raise InputError(
            f"cell '{cell}' lacks a dense '{dense}' partner at (campaign, group, context, block) {missing[0]}"
        )
    ratios = {k: base[k] / v for k, v in sparse.items()}
    by_block = _by_block(ratios)
    contexts = [ctx for _, ctx in by_block]
    if len(set(contexts)) != len(contexts):
        raise InputError(
            f"cell '{cell}' appears at one context in several campaigns; pass one campaign's cells"
        )
    return {ctx: v for (_, ctx), v in sorted(by_block.items(), key=lambda kv: kv[0][1])}


def speedup(cells: Iterable[PaperCell], cell: str, context: int, dense: str = "dense") -> Estimate:
    """Mean paired speedup of ``cell`` over dense at ``context``, with its block-resampling interval."""
    table = paired_speedups(cells, cell, dense)
    if context not in table:
        raise InputError(
            f"cell '{cell}' was not timed at context {context}; contexts are {sorted(table)}"
        )
    return resampled_mean(table[context])


# ---- measured crossing -----------------------------------------------------------------------


@dataclass(frozen=True)
class DifferenceCurve:
    """Paired differences t_first - t_second in ms at each context; positive favors ``second``.

    ``diffs`` is (n_contexts, B): one launch's blocks stay paired within that
    launch, and launches share block indices when resampled (App. E).
    """

    contexts: np.ndarray  # (n,) tokens, increasing
    diffs: np.ndarray  # (n, B) ms
    campaigns: tuple[str, ...]  # (n,) launch of each context


def difference_curve(
    cells: Iterable[PaperCell], group: str, first: str = "proj", second: str = "sel"
) -> DifferenceCurve:
    """Paired differences between the two modes of ``group`` (default projection minus selection)."""
    cells = [c for c in cells if c.group == group]
    names = {}
    for mode in (first, second):
        found = {c.cell for c in cells if c.mode == mode}
        if len(found) != 1:
            raise InputError(
                f"group '{group}': expected one cell of mode '{mode}', found {sorted(found)}"
            )
        names[mode] = found.pop()
    a, b = _times(cells, names[first], group), _times(cells, names[second], group)
    if set(a) != set(b):
        raise InputError(
            f"group '{group}': cells '{names[first]}' and '{names[second]}' cover different blocks/contexts"
        )
    by_block = _by_block({k: a[k] - b[k] for k in a})
    keys = sorted(by_block, key=lambda k: k[1])
    contexts = [ctx for _, ctx in keys]
    if len(set(contexts)) != len(contexts):
        raise InputError(f"group '{group}': a context was timed in more than one launch")
    widths = {len(by_block[k]) for k in keys}
    if len(widths) != 1:
        raise InputError(f"group '{group}': launches have different block counts {sorted(widths)}")
    return DifferenceCurve(
        np.array(contexts, dtype=float),
        np.stack([by_block[k] for k in keys]),
        tuple(k[0] for k in keys),
    )


def crossing_points(contexts: np.ndarray, mean_diff: np.ndarray) -> np.ndarray:
    """Crossing of each curve: mean_diff (R, n) at contexts (n,) -> (R,), NaN where none.

    The crossing lies between the last context where the first mode leads
    (difference < 0) and the next context, where the second leads; linear
    interpolation of the difference there. NaN if the first mode leads at the
    last context or never leads at all.
    """
    d = np.atleast_2d(np.asarray(mean_diff, dtype=float))  # (R, n)
    n = np.asarray(contexts, dtype=float)
    neg = d < 0
    has = neg.any(axis=1)
    last = np.where(has, d.shape[1] - 1 - np.argmax(neg[:, ::-1], axis=1), 0)  # (R,)
    ok = has & (last < d.shape[1] - 1)
    j = np.minimum(last, d.shape[1] - 2)
    rows = np.arange(d.shape[0])
    d0, d1 = d[rows, j], d[rows, j + 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        x = n[j] + (0 - d0) / (d1 - d0) * (n[j + 1] - n[j])
    return np.where(ok, x, np.nan)


def measured_crossing(curve: DifferenceCurve, level: float = LEVEL) -> Estimate:
    """Crossing context in tokens with its interval over all B**B block resamples (App. E)."""
    idx = block_resamples(curve.diffs.shape[1])  # (R, B)
    point = crossing_points(curve.contexts, curve.diffs.mean(axis=1)[None])[0]
    means = curve.diffs[:, idx].mean(axis=2).T  # (R, n)
    low, high, bad = percentile_interval(crossing_points(curve.contexts, means), level)
    return Estimate(float(point), low, high, len(idx), bad)


# ---- kernel cost and the cost-aware prediction -------------------------------------------------


def kernel_cost(t_mode, t_dense, byte_ratio):
    """c_b = t_b - t_D * B_b / B_D in ms (App. D, Table 10); works elementwise on arrays."""
    return np.asarray(t_mode, dtype=float) - np.asarray(t_dense, dtype=float) * np.asarray(
        byte_ratio, dtype=float
    )


def predicted_crossing(
    contexts,
    t_dense,
    cost_first,
    cost_second,
    ratio_first: Callable[[np.ndarray], np.ndarray],
    ratio_second: Callable[[np.ndarray], np.ndarray],
    *,
    n_grid: int = 4096,
) -> float:
    """Cost-aware crossing in tokens: solve t_first(n) = t_second(n) over the sweep range (App. D).

    ``contexts`` (k,) are the sweep contexts, ``t_dense`` (k,) the dense step
    times and ``cost_*`` (k,) the kernel costs there, all in ms; ``ratio_*(n)``
    give the byte ratio B_b(n) / B_D(n). t_D is interpolated log-log and each
    cost linearly, both only inside the sweep (no extrapolation). Returns the
    first sign change of t_first - t_second from negative to non-negative,
    refined by bisection, or NaN if there is none.
    """
    n = np.asarray(contexts, dtype=float)
    if n.ndim != 1 or n.size < 2 or np.any(np.diff(n) <= 0):
        raise InputError("sweep contexts must be at least two increasing values")
    log_n, log_t = np.log(n), np.log(np.asarray(t_dense, dtype=float))
    cf, cs = np.asarray(cost_first, dtype=float), np.asarray(cost_second, dtype=float)

    def gap(x):
        td = np.exp(np.interp(np.log(x), log_n, log_t))
        first = td * ratio_first(x) + np.interp(x, n, cf)
        second = td * ratio_second(x) + np.interp(x, n, cs)
        return first - second

    grid = np.linspace(n[0], n[-1], n_grid)
    g = gap(grid)
    sign_change = np.nonzero((g[:-1] < 0) & (g[1:] >= 0))[0]
    if sign_change.size == 0:
        return float("nan")
    lo, hi = grid[sign_change[0]], grid[sign_change[0] + 1]
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if gap(np.array([mid]))[0] < 0 else (lo, mid)
    return float(0.5 * (lo + hi))
