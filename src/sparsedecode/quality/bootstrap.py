"""Bootstrap intervals for aggregate perplexity, paired over windows (ByteCross App. H).

'Quality intervals resample the eight paired window losses 20,000 times and
recompute aggregate perplexity differences ... 95% percentile intervals, and
configuration selection uses the point estimates.' The resampling unit is the
window (or chunk) of a perplexity protocol: each resample draws k window indices
with replacement, the same draw for dense and the configuration (the windows
are paired: same text, same targets), and recomputes the aggregate perplexity
exp(sum NLL / sum targets) of each and their difference. Point estimates are
the aggregates of the windows as observed; intervals are percentiles of the
resamples. A seed fixes the draws. numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from sparsedecode.errors import InputError

RESAMPLES = 20_000
_BLOCK = 1 << 22  # index draws held at once (resamples x windows), bounds memory


@dataclass(frozen=True)
class Interval:
    """A point estimate and its percentile interval [low, high]."""

    point: float
    low: float
    high: float

    def __contains__(self, x: float) -> bool:
        return self.low <= x <= self.high


@dataclass(frozen=True)
class PairedPPL:
    """Aggregate PPL of dense and of a configuration on the same windows, and ΔPPL =
    config - dense, each with its interval from the same paired resamples."""

    dense: Interval
    config: Interval
    delta: Interval
    windows: int
    resamples: int
    seed: int
    level: float

    def to_dict(self) -> dict:
        return asdict(self)


def _arrays(nll: Sequence[float], targets, what: str) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(nll, dtype=np.float64).reshape(-1)  # (k,)
    if x.size == 0:
        raise InputError(f"{what}: no windows to resample")
    if not np.isfinite(x).all():
        raise InputError(f"{what}: the per-window NLLs hold a non-finite value")
    t = np.asarray(targets, dtype=np.float64)
    t = np.full(x.shape, float(t)) if t.ndim == 0 else t.reshape(-1)  # (k,)
    if t.shape != x.shape:
        raise InputError(f"{what}: {x.size} window NLLs but {t.size} target counts")
    if not (t > 0).all():
        raise InputError(f"{what}: every window needs at least one scored target")
    return x, t


def _check(resamples: int, level: float) -> None:
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise InputError(f"resamples must be an integer >= 1, got {resamples!r}")
    if not 0.0 < level < 1.0:
        raise InputError(f"the interval level must lie in (0, 1), got {level}")


def _resampled(nlls: list[np.ndarray], targets: np.ndarray, resamples: int,
               seed: int) -> list[np.ndarray]:
    """Aggregate PPL (resamples,) of each NLL array under the same window draws."""
    k = targets.size
    rng = np.random.default_rng(seed)
    block = max(1, _BLOCK // k)
    out = [np.empty(resamples) for _ in nlls]
    for lo in range(0, resamples, block):
        idx = rng.integers(0, k, size=(min(block, resamples - lo), k))  # (b, k) window indices
        t = targets[idx].sum(1)  # (b,)
        for o, x in zip(out, nlls, strict=True):
            o[lo : lo + idx.shape[0]] = np.exp(x[idx].sum(1) / t)
    return out


def _interval(point: float, samples: np.ndarray, level: float) -> Interval:
    lo, hi = np.quantile(samples, [(1.0 - level) / 2, (1.0 + level) / 2])
    return Interval(float(point), float(lo), float(hi))


def aggregate_ppl(nll: Sequence[float], targets) -> float:
    """exp(sum NLL / sum targets) over windows; targets per window (or one count for all)."""
    x, t = _arrays(nll, targets, "aggregate perplexity")
    return float(np.exp(x.sum() / t.sum()))


def ppl_interval(nll: Sequence[float], targets, resamples: int = RESAMPLES, seed: int = 0,
                 level: float = 0.95) -> Interval:
    """Aggregate PPL of one configuration's windows with its percentile bootstrap interval."""
    _check(resamples, level)
    x, t = _arrays(nll, targets, "perplexity interval")
    (s,) = _resampled([x], t, resamples, seed)
    return _interval(np.exp(x.sum() / t.sum()), s, level)


def paired_bootstrap(dense_nll: Sequence[float], config_nll: Sequence[float], targets,
                     resamples: int = RESAMPLES, seed: int = 0, level: float = 0.95) -> PairedPPL:
    """Dense and configuration aggregate PPL and ΔPPL over the same windows (summed NLL in
    nats per window; `targets` per window, or one count for all), each with a `level`
    percentile interval from `resamples` paired window resamples drawn with `seed`."""
    _check(resamples, level)
    d, t = _arrays(dense_nll, targets, "paired bootstrap (dense)")
    if len(config_nll) != d.size:
        raise InputError(f"paired bootstrap: {d.size} dense windows but {len(config_nll)} configuration "
                         "windows; run both on the same windows")
    c, _ = _arrays(config_nll, t, "paired bootstrap (configuration)")
    sd, sc = _resampled([d, c], t, resamples, seed)
    pd, pc = np.exp(d.sum() / t.sum()), np.exp(c.sum() / t.sum())
    return PairedPPL(dense=_interval(pd, sd, level), config=_interval(pc, sc, level),
                     delta=_interval(pc - pd, sc - sd, level), windows=int(t.size),
                     resamples=resamples, seed=seed, level=level)


__all__ = ["RESAMPLES", "Interval", "PairedPPL", "aggregate_ppl", "paired_bootstrap", "ppl_interval"]
