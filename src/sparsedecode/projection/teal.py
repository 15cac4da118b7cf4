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
candidate errors valid, so each step re-runs only one block, and a candidate
re-runs only what its step changes, on cached outputs of the projections that
did not move (a q, k or v step: that projection, attention and o; an o step: o
alone; see `_LayerProbe`). The trajectory of a
layer is kept in the Activations cache, so calibrating several targets from one
collection walks each layer's path once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from sparsedecode.errors import InputError
from sparsedecode.models.rope import apply_rope
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
QKV = ("q", "k", "v")  # attention sites upstream of the attention scores
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
    """Block outputs of one decoder layer on its cached dense input under site keeps.

    Greedy scoring (TEAL §4.2; ByteCross App. A 'greedy') runs a block once per
    candidate step. The probe keeps each projection's output under the current
    keeps, so a candidate recomputes only what its site feeds: a q, k or v step
    re-projects that site and re-runs attention and o on the other two; an o step
    re-runs o alone on the attention output; a gate or up step re-runs that site
    and down; a down step down alone. Each site's last candidate output is kept
    too (its input is the block's fixed dense input), and a q/k/v candidate's
    attention output while q, k and v stay put, so a candidate re-scored after a
    step elsewhere in its block re-runs only what that step changed (o or down
    alone after an o or down step). The arithmetic is the module's forward, op
    for op, so the scores are unchanged. cache=False re-runs each candidate's
    whole block, attention through the module under `masks`: the reference the
    tests compare with.
    """

    def __init__(self, model, i: int, x: torch.Tensor, acts: Activations, cache: bool = True):
        self.model, self.i, self.acts, self.cache = model, i, acts, cache
        self.layer = layer = model.layers[i]
        self.pos, self.cos, self.sin = rope_at(model, x.shape[1])
        self.rows = slice(min(SKIP, x.shape[1] - 1), None)
        self.table: dict[str, float] = {}
        with torch.inference_mode():
            self.xa = layer.input_layernorm(x)  # (1, T, d)
            self.attn_dense = layer.self_attn(self.xa, self.cos, self.sin, self.pos, 0)  # (1, T, d)
            self.hn = layer.post_attention_layernorm(x + self.attn_dense)  # (1, T, d)
            self.g, self.u = layer.mlp.gate_proj(self.hn), layer.mlp.up_proj(self.hn)  # (1, T, d_ff)
            self.mlp_dense = layer.mlp.down_proj(F.silu(self.g) * self.u)  # (1, T, d)
        self.keeps = dict.fromkeys(INPUT_SITES, 1.0)
        self.err = {"attn": 0.0, "mlp": 0.0}
        self.heads: dict[str, torch.Tensor] = {}  # q, k, v as attention reads them, (1, H, T, D)
        self.y: torch.Tensor | None = None  # o's input (1, T, Hq*D); None until an attention site moves
        self.last: dict[str, tuple[float, torch.Tensor]] = {}  # site -> (keep, output) of its last candidate
        self.last_y: dict[str, tuple[float, torch.Tensor]] = {}  # q/k/v -> (keep, o's input) at this state

    def _t(self, s: str, keep: float) -> float | None:
        return self.acts.threshold(site_key(self.i, s), keep)

    def _sq(self, y: torch.Tensor, ref: torch.Tensor) -> float:
        return float(((y - ref)[:, self.rows].float() ** 2).sum())

    def _attn(self) -> torch.Tensor:
        with masks(self.model, self.table, layers={self.i}):
            return self.layer.self_attn(self.xa, self.cos, self.sin, self.pos, 0)

    def _attn_err(self, keeps: dict) -> float:
        """The reference: the whole attention block through the module, masked by hooks."""
        for s in ATTN:
            self.table[site_key(self.i, s)] = self._t(s, keeps.get(s, 1.0))
        return self._sq(self._attn(), self.attn_dense)

    def _head(self, s: str, keep: float) -> torch.Tensor:
        """q, k or v (1, H, T, D) at keep, as `Attention.forward` hands it to attention."""
        attn = self.layer.self_attn
        B, T, _ = self.xa.shape
        h = getattr(attn, f"{s}_proj")(_mask(self.xa, self._t(s, keep)))
        h = h.view(B, T, attn.n_heads if s == "q" else attn.n_kv_heads, attn.head_dim)
        if s == "v":
            return h.transpose(1, 2)
        if attn.qk_norm:
            h = (attn.q_norm if s == "q" else attn.k_norm)(h)
        return apply_rope(h.transpose(1, 2), self.cos, self.sin)

    def _attend(self, heads: dict) -> torch.Tensor:
        """o's input (1, T, Hq*D): the module's prefill attention from position 0."""
        attn = self.layer.self_attn
        B, T, _ = self.xa.shape
        attn.cache.update(self.pos, heads["k"], heads["v"])
        y = attn._prefill_attention(heads["q"], 0, T).transpose(1, 2)  # (1, T, Hq, D)
        return y.reshape(B, T, attn.n_heads * attn.head_dim)

    def _o_err(self, y: torch.Tensor, keep: float) -> float:
        return self._sq(self.layer.self_attn.o_proj(_mask(y, self._t("o", keep))), self.attn_dense)

    def _gate(self, keep: float) -> torch.Tensor:
        return self.layer.mlp.gate_proj(_mask(self.hn, self._t("gate", keep)))

    def _up(self, keep: float) -> torch.Tensor:
        return self.layer.mlp.up_proj(_mask(self.hn, self._t("up", keep)))

    def _mlp_err(self, g, u, down_keep: float) -> float:
        y = self.layer.mlp.down_proj(_mask(F.silu(g) * u, self._t("down", down_keep)))
        return self._sq(y, self.mlp_dense)

    def _out(self, s: str, keep: float) -> torch.Tensor:
        """Output of q, k, v (a head), gate or up at keep; the last one per site is kept."""
        hit = self.last.get(s)
        if hit is None or hit[0] != keep:
            out = self._gate(keep) if s == "gate" else self._up(keep) if s == "up" else self._head(s, keep)
            hit = self.last[s] = (keep, out)
        return hit[1]

    def _qkv_state(self) -> torch.Tensor:
        """o's input at the current keeps, built on first use."""
        if self.y is None:
            self.heads = {s: self._out(s, self.keeps[s]) for s in QKV}
            self.y = self._attend(self.heads)
        return self.y

    @torch.inference_mode()
    def set_state(self, keeps: dict) -> None:
        """Move to `keeps` (sites not named stay dense) and score both blocks."""
        self.keeps.update(keeps)
        k = self.keeps
        self.y = None
        self.last_y.clear()
        if not any(k[s] < 1.0 for s in ATTN):
            self.err["attn"] = 0.0
        elif self.cache:
            self.err["attn"] = self._o_err(self._qkv_state(), k["o"])
        else:
            self.err["attn"] = self._attn_err(k)
        self.g, self.u = self._gate(k["gate"]), self._up(k["up"])
        self.err["mlp"] = self._mlp_err(self.g, self.u, k["down"])

    def block_err(self, s: str) -> float:
        return self.err["attn" if s in ATTN else "mlp"]

    @torch.inference_mode()
    def try_step(self, s: str, new_keep: float) -> tuple[float, object]:
        """Squared error of s's block with s at new_keep, and what `take` needs."""
        k = {**self.keeps, s: new_keep}
        if not self.cache:
            if s in ATTN:
                return self._attn_err(k), None
            return self._mlp_err(self._gate(k["gate"]), self._up(k["up"]), k["down"]), None
        if s == "o":
            return self._o_err(self._qkv_state(), new_keep), None
        if s in QKV:
            self._qkv_state()
            hit = self.last_y.get(s)
            if hit is None or hit[0] != new_keep:
                hit = self.last_y[s] = (new_keep, self._attend({**self.heads, s: self._out(s, new_keep)}))
            return self._o_err(hit[1], k["o"]), (self._out(s, new_keep), hit[1])
        if s == "gate":
            g = self._out("gate", new_keep)
            return self._mlp_err(g, self.u, k["down"]), g
        if s == "up":
            u = self._out("up", new_keep)
            return self._mlp_err(self.g, u, k["down"]), u
        return self._mlp_err(self.g, self.u, new_keep), None

    def take(self, s: str, new_keep: float, err: float, payload) -> None:
        """Commit the step `try_step(s, new_keep)` scored."""
        if s == "gate":
            self.g = payload
        elif s == "up":
            self.u = payload
        elif s in QKV and payload is not None:
            self.heads[s], self.y = payload
            self.last_y.clear()  # every q/k/v candidate attends over the moved site
        self.keeps[s] = new_keep
        self.err["attn" if s in ATTN else "mlp"] = err
