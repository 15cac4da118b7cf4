"""SATS: CATS thresholds chosen per layer by local MLP distortion under one error budget.

SATS paper (Sensitivity-Aware Thresholding for Sparsity, and token routing, 2026), §3.1. CATS (§2; cats.py)
puts every layer's cutoff on |SiLU(x W_gate)| at the same percentile. SATS keeps
that runtime form (keys `layers.{i}.act`, the CATS runtime runs it unchanged) but
picks each layer's threshold by the damage it does to that layer's MLP output:

- candidates T_l: thresholds at the keep levels of `grid` (quantiles of the
  layer's |SiLU(gate)| sample), plus keep 1 (drop nothing);
- local error, Eq. 1: Err_l(t) = E_x[ ||y_l(x) - y~_l,t(x)||_2 / (||y_l(x)||_2 + eps) ],
  y the dense MLP output, y~ the output with channels |SiLU(gate)| <= t zeroed;
- per budget b: t*_l(b) = max{t in T_l : Err_l(t) <= b}, and the realized mean
  sparsity S(b) = mean_l sp_l(t*_l(b)), sp from the calibration sample;
- b* = argmin_b |S(b) - (1 - keep)|, searched coarse to fine.
- §4, final configuration: the last layer keeps its CATS threshold.

Choices written down here (the paper leaves them open):

- Err is measured on the MLP inputs of the first `error_tokens` calibration
  tokens from one dense pass (forward pre-hooks on every layer's mlp), so each
  layer's error is local: its upstream layers run dense, as in §3.1.
- Fast path: gate, up and h = SiLU(gate)·up are computed once per layer; only
  the dropped part needs down, y - y~_t = (h ⊙ [|SiLU(gate)| <= t]) W_down^T.
  Sorting a token's channels by |SiLU(gate)| puts each candidate's dropped set
  in a prefix, so every (token, channel) entry is projected by down once, in
  the band between the two candidates that first drop it (one sparse CSR
  product), and a running sum over bands gives y - y~ at every candidate:
  the cost of one dense down projection instead of one per candidate.
- t*_l(b) is the largest candidate within budget, read literally: a
  non-monotone curve does not stop the search at its first excess. Keep 1 has
  Err 0, so the set is never empty; such a layer is saved with threshold 0.0
  (only exact zeros dropped, which changes nothing) so the CATS runtime,
  which wants one threshold per layer, runs the file.
- The search: S(b) only changes where b crosses a candidate's error, and is
  nondecreasing in b. A log grid of `coarse` budgets brackets the target; the
  fine pass tries every candidate error inside the bracket, so b* is exact on
  the candidate set. Ties go to the smaller budget.
- Upstream masking shifts every layer's distribution (see `Calibrator`): each
  layer's chosen keep level is re-taken as a quantile of the masked sample by
  the base class's refine passes, as CATS does at its uniform level. The last
  layer's threshold is CATS's own (`Cats(keep, refine, refine_tokens)` on the
  same statistics; one more masked pass when refine > 0).
- The header records b*, S(b*), the target, and per layer the chosen keep level
  and Err at the chosen candidate (dense statistics, before refine).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from sparsedecode.errors import InputError, option
from sparsedecode.projection.calibrate import Activations, Calibrator, run_layers, windows
from sparsedecode.projection.thresholds import ACT_SITE, Thresholds, site_key

MIN_GRID = 8
MIN_ERROR_TOKENS = 32
CHUNK = 256  # tokens per sparse product: bounds the (chunk, K, d) band outputs


def default_grid() -> tuple[float, ...]:
    """50 keep levels: every 0.025 from 0.05 to 0.8, every 0.01 from 0.81 to 0.99.

    Denser near keep 1, where sensitive layers (large Err at small drops) sit;
    the step in S(b) when one layer moves one level is spacing / n_layers.
    """
    coarse = [round(0.05 + 0.025 * i, 4) for i in range(31)]
    fine = [round(0.81 + 0.01 * i, 4) for i in range(19)]
    return tuple(coarse + fine)


# -- the local error of Eq. 1 --------------------------------------------------------
@torch.inference_mode()
def mlp_inputs(engine, ids, tokens: int) -> list[Tensor]:
    """Each layer's MLP input (tokens, d) for ids[:tokens], from one dense pass."""
    model = engine.model
    xs: list[list[Tensor]] = [[] for _ in model.layers]
    handles = [layer.mlp.register_forward_pre_hook(
        lambda mod, args, i=i: xs[i].append(args[0][0].detach().clone()))
        for i, layer in enumerate(model.layers)]
    try:
        for chunk in windows(engine, ids[:tokens]):
            run_layers(model, chunk)
    finally:
        for h in handles:
            h.remove()
        engine.reset()
    return [torch.cat(x) for x in xs]


@torch.inference_mode()
def local_errors(mlp, x: Tensor, thresholds: Tensor, eps: float = 1e-6, chunk: int = CHUNK) -> Tensor:
    """Err(t) of Eq. 1 at K ascending thresholds (K,) on MLP inputs x (T, d) -> (K,) float32.

    A channel is dropped at t when |SiLU(gate)| <= t (the CATS mask). Each entry
    of h goes through down once, in the band of the first candidate that drops
    it; a running sum over the bands is y - y~ at every candidate.
    """
    ts = thresholds.to(device=x.device, dtype=torch.float32).contiguous()  # (K,)
    K = ts.numel()
    w_t = mlp.down_proj.weight.float().t().contiguous()  # (F, d)
    bias = None if mlp.down_proj.bias is None else mlp.down_proj.bias.float()
    total = torch.zeros(K, dtype=torch.float32, device=x.device)
    for s in range(0, x.shape[0], chunk):
        xc = x[s : s + chunk]
        act = F.silu(mlp.gate_proj(xc)).float()  # (n, F)
        h = act * mlp.up_proj(xc).float()  # (n, F)
        y = F.linear(h, w_t.t(), bias)  # (n, d) the dense output
        n = xc.shape[0]
        mag, order = act.abs().sort(dim=1)  # (n, F) ascending per token
        band = torch.searchsorted(ts, mag)  # (n, F): first candidate that drops the entry; K: none
        ks = torch.arange(K, device=x.device).expand(n, K).contiguous()
        cut = torch.searchsorted(band, ks, right=True)  # (n, K): entries dropped at candidate k
        counts = torch.diff(cut, dim=1, prepend=torch.zeros_like(cut[:, :1]))  # (n, K) per band
        dropped = torch.arange(act.shape[1], device=x.device) < cut[:, -1:]  # (n, F) in sorted order
        crow = F.pad(counts.reshape(-1).cumsum(0), (1, 0))  # CSR rows (token, band)
        cols, vals = order[dropped], h.gather(1, order)[dropped]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
            bands = torch.sparse_csr_tensor(crow, cols, vals, size=(n * K, act.shape[1]),
                                            check_invariants=False)
            part = (bands @ w_t).view(n, K, -1)  # (n, K, d) each band's share of y - y~
        inv = 1.0 / (y.norm(dim=-1) + eps)  # (n,)
        diff = torch.zeros_like(y)  # (n, d)
        for k in range(K):
            diff += part[:, k]
            total[k] += (diff.norm(dim=-1) * inv).sum()
    return total / x.shape[0]


def pick(errors: Tensor, budget: float) -> Tensor:
    """Index of the largest candidate with Err <= budget per layer; errors (L, K), candidates
    in ascending threshold order, column 0 the keep-everything candidate (Err 0)."""
    ok = errors <= budget  # (L, K)
    idx = torch.arange(errors.shape[1], device=errors.device).expand_as(errors)
    return torch.where(ok, idx, torch.zeros_like(idx)).max(dim=1).values  # (L,)


# -- the calibrator ---------------------------------------------------------------------
@dataclass
class Search:
    """The chosen operating point: budget b*, S(b*), and per layer the keep level and Err."""

    budget: float
    sparsity: float
    target: float
    keeps: list[float]
    errors: list[float]

    def header(self) -> dict:
        return {"budget": self.budget, "sparsity": self.sparsity, "target_sparsity": self.target,
                "layer_keeps": self.keeps, "layer_errors": self.errors}


@dataclass
class Sats(Calibrator):
    """keep: target fraction of SiLU(gate) channels kept, in (0, 1]; grid: keep levels of the
    candidate thresholds, in (0, 1); error_tokens: calibration tokens whose MLP inputs
    estimate Err; coarse: budgets in the coarse log sweep; eps: Eq. 1's stabilizer;
    last_layer_cats: the last layer keeps its CATS threshold (§4)."""

    grid: tuple[float, ...] = field(default_factory=default_grid)
    error_tokens: int = 512
    coarse: int = 32
    eps: float = 1e-6
    last_layer_cats: bool = True
    name: ClassVar[str] = "sats"

    def __post_init__(self):
        super().__post_init__()
        try:
            levels = sorted({float(k) for k in self.grid}, reverse=True)
        except (TypeError, ValueError):
            raise InputError(f"sats grid must be a list of keep levels in (0, 1), got {self.grid!r}") from None
        bad = [k for k in levels if not 0.0 < k < 1.0]
        if bad:
            raise InputError(f"sats grid levels must lie in (0, 1) (keep 1 is always a candidate); got {bad[:3]}")
        if len(levels) < MIN_GRID:
            raise InputError(f"sats grid has {len(levels)} distinct keep levels, fewer than {MIN_GRID}; "
                             "give more, e.g. every 0.025 from 0.05 to 0.99")
        self.grid = tuple(levels)
        for f, low in (("error_tokens", MIN_ERROR_TOKENS), ("coarse", 2)):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise InputError(f"sats {f} must be an integer >= {low}, got {v!r}")
        if not (isinstance(self.eps, (int, float)) and 0.0 < float(self.eps) < 1.0):
            raise InputError(f"sats eps must lie in (0, 1), e.g. 1e-6; got {self.eps!r}")
        if not isinstance(self.last_layer_cats, bool):
            raise InputError(f"sats last_layer_cats must be true or false, got {self.last_layer_cats!r}")

    @property
    def keep_metric(self) -> str:
        return "act_keep"

    @property
    def levels(self) -> tuple[float, ...]:
        """Candidate keep levels in ascending threshold order: keep 1 first."""
        return (1.0, *self.grid)

    # -- Err curves and sparsities ------------------------------------------------
    def curves(self, engine, acts: Activations, progress: bool = False) -> tuple[Tensor, Tensor]:
        """(Err, sp), both (L, K): Eq. 1 and the sample's sparsity at every candidate of every
        layer. Cached in the Activations, so several targets share one estimate."""
        if acts.ids is None:
            raise InputError("sats needs the calibration ids: collect with `collect_activations`")
        if acts.tokens < self.error_tokens:
            raise InputError(
                f"calibration text has {acts.tokens} tokens, fewer than sats error_tokens "
                f"{self.error_tokens}; give a longer {option('text_file', python='text')} or a larger "
                f"{option('tokens', python='count')}, or lower error_tokens"
            )
        key = ("sats-curves", self.levels, self.error_tokens, float(self.eps))
        if key not in acts.cache:
            xs = mlp_inputs(engine, acts.ids, self.error_tokens)
            errs, sps = [], []
            for i in _layers(len(xs), progress):
                ts = self._candidates(acts, i, self.grid)
                err = local_errors(engine.model.layers[i].mlp, xs[i], torch.tensor(ts), self.eps)
                errs.append(torch.cat([torch.zeros(1), err.cpu()]))
                k = site_key(i, ACT_SITE)
                sps.append(torch.tensor([0.0] + [1.0 - acts.keep_at(k, t) for t in ts]))
            acts.cache[key] = (torch.stack(errs), torch.stack(sps), xs)
        errs, sps, _ = acts.cache[key]
        return errs, sps

    @staticmethod
    def _candidates(acts: Activations, i: int, levels) -> list[float]:
        return [acts.threshold(site_key(i, ACT_SITE), k) for k in levels]

    def search(self, engine, acts: Activations, progress: bool = False) -> Search:
        """b* = argmin_b |S(b) - (1 - keep)| (§3.1), coarse log sweep then every candidate
        error inside the bracketing budgets."""
        errs, sps = self.curves(engine, acts, progress)
        L = errs.shape[0]
        target = 1.0 - self.keep
        free = L - 1 if self.last_layer_cats else L  # layers the budget decides
        last_sp, last_err = 0.0, 0.0
        if self.last_layer_cats and self.keep < 1.0:
            last_sp, last_err = self._last_layer(engine, acts)

        def S(budgets: Tensor) -> Tensor:  # (B,) -> (B,)
            idx = torch.stack([pick(errs[:free], float(b)) for b in budgets])  # (B, free)
            chosen = sps[:free].gather(1, idx.t()).t()  # (B, free)
            return (chosen.sum(1) + (L - free) * last_sp) / L

        pos = errs[:free][errs[:free] > 0]
        if pos.numel() == 0:
            budgets = torch.zeros(1)
        else:
            lo, hi = math.log10(float(pos.min())), math.log10(float(pos.max()))
            budgets = torch.cat([torch.zeros(1), torch.logspace(lo, hi, self.coarse)])
        s = S(budgets)
        below, above = budgets[s <= target], budgets[s >= target]
        b_lo = float(below.max()) if below.numel() else 0.0
        b_hi = float(above.min()) if above.numel() else float(budgets[-1])
        inside = errs[:free][(errs[:free] >= b_lo) & (errs[:free] <= b_hi)]
        fine = torch.unique(torch.cat([torch.tensor([b_lo, b_hi]), inside]))  # ascending
        s = S(fine)
        gap = (s - target).abs()
        j = int(torch.nonzero(gap == gap.min())[0])  # ties: the smaller budget
        b = float(fine[j])
        idx = pick(errs[:free], b)
        keeps = [self.levels[int(k)] for k in idx]
        errors = [float(errs[i, int(k)]) for i, k in enumerate(idx)]
        if free < L:
            keeps.append(self.keep)
            errors.append(last_err)
        return Search(budget=b, sparsity=float(s[j]), target=target, keeps=keeps, errors=errors)

    def _last_layer(self, engine, acts: Activations) -> tuple[float, float]:
        """(sp, Err) of the last layer at the CATS threshold from the dense sample."""
        errs, sps = self.curves(engine, acts)
        i = errs.shape[0] - 1
        key = ("sats-last", self.keep, self.error_tokens, float(self.eps))
        if key not in acts.cache:
            xs = acts.cache[("sats-curves", self.levels, self.error_tokens, float(self.eps))][2]
            (t,) = self._candidates(acts, i, (self.keep,))
            err = local_errors(engine.model.layers[i].mlp, xs[i], torch.tensor([t]), self.eps)
            acts.cache[key] = (1.0 - acts.keep_at(site_key(i, ACT_SITE), t), float(err[0]))
        return acts.cache[key]

    # -- the Calibrator interface -------------------------------------------------
    def site_keeps(self, engine, acts: Activations, progress: bool = False) -> dict[str, float]:
        keeps = self.search(engine, acts, progress).keeps
        return {site_key(i, ACT_SITE): k for i, k in enumerate(keeps)}

    def fit(self, engine, acts: Activations, *, text: str = "", progress: bool = False) -> Thresholds:
        """Thresholds at b*, refined like CATS (see `Calibrator`), the last layer CATS's own."""
        found = self.search(engine, acts, progress)  # site_keeps repeats it on the cached curves
        th = super().fit(engine, acts, text=text, progress=progress)
        n = engine.dims.n_layers
        values = {site_key(i, ACT_SITE): th.values.get(site_key(i, ACT_SITE), 0.0) for i in range(n)}
        if self.last_layer_cats:
            values[site_key(n - 1, ACT_SITE)] = self._cats_last(engine, acts, text, progress)
        return replace(th, values=values, extras={**th.extras, **found.header()})

    def _cats_last(self, engine, acts: Activations, text: str, progress: bool) -> float:
        """The last layer's threshold from CATS at the same keep and refine settings."""
        from sparsedecode.projection.cats import Cats

        key = ("sats-cats", self.keep, self.refine, self.refine_tokens)
        if key not in acts.cache:
            cats = Cats(keep=self.keep, refine=self.refine, refine_tokens=self.refine_tokens)
            acts.cache[key] = cats.fit(engine, acts, text=text, progress=progress).values
        return acts.cache[key].get(site_key(engine.dims.n_layers - 1, ACT_SITE), 0.0)


def _layers(n: int, progress: bool):
    if not progress:
        return range(n)
    from tqdm.auto import tqdm

    return tqdm(range(n), desc="SATS local errors", unit="layer", leave=False)


__all__ = ["Sats", "Search", "default_grid", "local_errors", "mlp_inputs", "pick"]
