"""TEAL: magnitude thresholds on the inputs of all seven projections.

Liu et al., 2025b, 'Training-Free Activation Sparsity in Large Language Models'
(ICLR 2025; the projection branch of ByteCross §3.2 and §4.1). A channel of a
projection's input is kept when |x| > t, and only the weight columns of kept
channels are read. Thresholds come from the distribution of |x| at each site on
calibration text (WikiText-2 validation by default):

- uniform: every site at its own (1 - keep) quantile, so each projection keeps
  about `keep` of its input channels, hence about `keep` of its weight bytes;
- greedy (TEAL §4.2, block-wise allocation): per layer, start dense and
  repeatedly add one small step of sparsity to the projection whose step adds
  the least output error per parameter removed, until the layer's
  parameter-weighted keep reaches the target. A step removes `step` of the
  layer's parameter-weighted keep (a projection's own keep falls by
  step x P_layer / P_site, at most `max_site_step`, so a small k or v is not
  emptied in one step), as TEAL's steps weighted by parameter size do. The last
  step is shortened so every layer lands on the target.

Greedy error, our choice for CPU cost: each candidate is scored on its own
block, fed the block's dense input from the calibration text (the first
`greedy_tokens` tokens, cached once per layer): the attention output for
q/k/v/o and the MLP output for gate/up/down. Both outputs add to the residual
stream, so their squared L2 errors are summed as the layer's error (TEAL scores
the whole decoder layer output). A step in one block leaves the other block's
candidate errors valid, so each step re-runs only one block, and an MLP
candidate re-runs only the projections its step changes. The trajectory of a
layer is kept in the Activations cache, so calibrating several targets from one
collection walks each layer's path once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from sparsedecode.errors import InputError
from sparsedecode.projection.calibrate import (
    Activations,
    Calibrator,
    _bar,
    _mask,
    masks,
    rope_at,
)
from sparsedecode.projection.thresholds import INPUT_SITES, site_key, site_params

ATTN = ("q", "k", "v", "o")
MLP = ("gate", "up", "down")
SKIP = 4  # leading positions (attention sinks, outlier norms) left out of the error


@dataclass
class Teal(Calibrator):
    """keep: target parameter-weighted keep in (0, 1] (of gate/up/down with ff_only);
    greedy: TEAL's block-wise allocation instead of one keep for every site;
    ff_only: sparsify gate/up/down only; step: parameter-weighted keep removed per
    greedy step; max_site_step: cap on one projection's keep change per step;
    greedy_tokens: calibration tokens whose layer inputs score greedy steps."""

    greedy: bool = False
    ff_only: bool = False
    step: float = 0.02
    max_site_step: float = 0.1
    greedy_tokens: int = 1024
    name: ClassVar[str] = "teal"

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 < float(self.step) <= 0.5:
            raise InputError(f"teal step {self.step} must lie in (0, 0.5], e.g. 0.02")
        if not 0.0 < float(self.max_site_step) <= 1.0:
            raise InputError(f"teal max_site_step {self.max_site_step} must lie in (0, 1]")
        if int(self.greedy_tokens) < 4 * SKIP:
            raise InputError(f"teal greedy_tokens {self.greedy_tokens} must be at least {4 * SKIP}")

    @property
    def keep_metric(self) -> str:
        return "ff_keep" if self.ff_only else "param_keep"

    @property
    def hidden_tokens(self) -> int:
        return int(self.greedy_tokens) if self.greedy else 0

    @property
    def sites(self) -> tuple[str, ...]:
        return MLP if self.ff_only else INPUT_SITES

    def site_keeps(self, engine, acts: Activations, progress: bool = False) -> dict[str, float]:
        n = engine.dims.n_layers
        if not self.greedy:
            return {site_key(i, s): self.keep for i in range(n) for s in self.sites}
        if len(acts.hidden) != n:
            raise InputError("greedy TEAL needs layer inputs: collect with hidden_tokens > 0")
        keeps = {}
        for i in _bar(range(n), progress, "greedy allocation"):
            keeps.update({site_key(i, s): k for s, k in self.layer_keeps(engine, acts, i).items()})
        return keeps

    # -- greedy allocation -----------------------------------------------------
    def _weights(self, dims) -> dict[str, float]:
        total = sum(site_params(dims, s) for s in self.sites)
        return {s: site_params(dims, s) / total for s in self.sites}

    def layer_keeps(self, engine, acts: Activations, i: int) -> dict[str, float]:
        """Nominal keep of each site of layer i whose parameter-weighted mean is `keep`."""
        w = self._weights(engine.dims)
        path = self._path(engine, acts, i, w)
        keeps = dict.fromkeys(self.sites, 1.0)
        for s, dec in path:
            level = sum(w[x] * keeps[x] for x in self.sites)
            if level <= self.keep + 1e-12:
                break
            keeps[s] -= min(dec, (level - self.keep) / w[s])
        return keeps

    def _path(self, engine, acts: Activations, i: int, w: dict[str, float]) -> list:
        """The greedy steps (site, keep decrement) of layer i, walked down to `keep`."""
        key = ("teal-greedy", i, self.ff_only, float(self.step), float(self.max_site_step),
               acts.hidden[i].shape[1])
        path = acts.cache.setdefault(key, [])
        keeps = dict.fromkeys(self.sites, 1.0)
        for s, dec in path:
            keeps[s] -= dec

        def level():
            return sum(w[s] * keeps[s] for s in self.sites)

        if level() <= self.keep + 1e-12:
            return path
        probe = _LayerProbe(engine.model, i, acts.hidden[i], acts)
        probe.set_state(keeps)
        cand: dict[str, tuple] = {}
        while level() > self.keep + 1e-12:
            best, best_score = None, float("inf")
            for s in self.sites:
                if keeps[s] <= 1e-9:
                    continue
                dec = min(self.step / w[s], self.max_site_step, keeps[s])
                if s not in cand:
                    cand[s] = (dec, *probe.try_step(s, keeps[s] - dec))
                dec, err, _ = cand[s]
                score = (err - probe.block_err(s)) / (dec * w[s])
                if score < best_score:
                    best, best_score = s, score
            if best is None:
                break
            dec, err, payload = cand[best]
            keeps[best] -= dec
            probe.take(best, keeps[best], err, payload)
            path.append((best, dec))
            block = ATTN if best in ATTN else MLP
            for s in block:
                cand.pop(s, None)
        return path


class _LayerProbe:
    """Block outputs of one decoder layer on its cached dense input under site keeps."""

    def __init__(self, model, i: int, x: torch.Tensor, acts: Activations):
        self.model, self.i, self.acts = model, i, acts
        self.layer = layer = model.layers[i]
        self.pos, self.cos, self.sin = rope_at(model, x.shape[1])
        self.rows = slice(min(SKIP, x.shape[1] - 1), None)
        self.table: dict[str, float] = {}
        with torch.inference_mode():
            self.xa = layer.input_layernorm(x)  # (1, T, d)
            self.attn_dense = self._attn()  # (1, T, d)
            self.hn = layer.post_attention_layernorm(x + self.attn_dense)  # (1, T, d)
            self.g, self.u = layer.mlp.gate_proj(self.hn), layer.mlp.up_proj(self.hn)  # (1, T, d_ff)
            self.mlp_dense = layer.mlp.down_proj(F.silu(self.g) * self.u)  # (1, T, d)
        self.keeps = dict.fromkeys(INPUT_SITES, 1.0)
        self.err = {"attn": 0.0, "mlp": 0.0}

    def _t(self, s: str, keep: float) -> float | None:
        return self.acts.threshold(site_key(self.i, s), keep)

    def _sq(self, y: torch.Tensor, ref: torch.Tensor) -> float:
        return float(((y - ref)[:, self.rows].float() ** 2).sum())

    def _attn(self) -> torch.Tensor:
        with masks(self.model, self.table, layers={self.i}):
            return self.layer.self_attn(self.xa, self.cos, self.sin, self.pos, 0)

    def _attn_err(self, keeps: dict) -> float:
        for s in ATTN:
            self.table[site_key(self.i, s)] = self._t(s, keeps.get(s, 1.0))
        return self._sq(self._attn(), self.attn_dense)

    def _gate(self, keep: float) -> torch.Tensor:
        return self.layer.mlp.gate_proj(_mask(self.hn, self._t("gate", keep)))

    def _up(self, keep: float) -> torch.Tensor:
        return self.layer.mlp.up_proj(_mask(self.hn, self._t("up", keep)))

    def _mlp_err(self, g, u, down_keep: float) -> float:
        y = self.layer.mlp.down_proj(_mask(F.silu(g) * u, self._t("down", down_keep)))
        return self._sq(y, self.mlp_dense)

    @torch.inference_mode()
    def set_state(self, keeps: dict) -> None:
        """Move to `keeps` (sites not named stay dense) and score both blocks."""
        self.keeps.update(keeps)
        k = self.keeps
        self.err["attn"] = self._attn_err(k) if any(k[s] < 1.0 for s in ATTN) else 0.0
        self.g, self.u = self._gate(k["gate"]), self._up(k["up"])
        self.err["mlp"] = self._mlp_err(self.g, self.u, k["down"])

    def block_err(self, s: str) -> float:
        return self.err["attn" if s in ATTN else "mlp"]

    @torch.inference_mode()
    def try_step(self, s: str, new_keep: float) -> tuple[float, object]:
        """Squared error of s's block with s at new_keep, and what `take` needs."""
        k = {**self.keeps, s: new_keep}
        if s in ATTN:
            return self._attn_err(k), None
        if s == "gate":
            g = self._gate(new_keep)
            return self._mlp_err(g, self.u, k["down"]), g
        if s == "up":
            u = self._up(new_keep)
            return self._mlp_err(self.g, u, k["down"]), u
        return self._mlp_err(self.g, self.u, new_keep), None

    def take(self, s: str, new_keep: float, err: float, payload) -> None:
        """Commit the step `try_step(s, new_keep)` scored."""
        if s == "gate":
            self.g = payload
        elif s == "up":
            self.u = payload
        self.keeps[s] = new_keep
        self.err["attn" if s in ATTN else "mlp"] = err
