"""Calibration of activation thresholds: the work every method shares, done once.

A calibrator (ByteCross §3.2 and §4.1; TEAL, CATS) turns activation statistics
of calibration text (WikiText-2 validation by default) into one threshold per
site, so that a target fraction of channels, or of weight bytes, is kept. The
shared steps live here:

- `collect_activations`: dense forward passes over the calibration ids in
  windows, with hooks on the seven projection inputs of every layer and on
  |SiLU(gate(x))| (the CATS site). Each site keeps a random sample of at most
  `cap` elements of |x|, sorted, so quantiles are exact on the kept sample and
  memory stays bounded (a few MB per site). On request it also keeps each
  layer's input hidden states for the first tokens, for methods that re-run a
  layer (TEAL's greedy allocation).
- `quantile_threshold`: keep k -> the (1 - k) quantile of the site's |x|.
- `masks`: forward hooks that zero the input channels with |x| <= t of each
  thresholded site (and the SiLU(gate) channels for CATS) and count what they
  keep. This is the masked reference of the sparse decode path: the same
  decisions, with the bytes still read. `measure_keep` runs it teacher-forced
  on held-out text and reports the realized keep.

Methods are dataclasses in files of their own (teal.py, cats.py), found by name
in `CALIBRATORS`. A method implements `site_keeps(engine, acts)`, the nominal
keep of each site; the base turns keeps into quantile thresholds and refines
them with the sparsity applied (see `Calibrator`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

from sparsedecode.account.units import check_keep
from sparsedecode.errors import InputError, option
from sparsedecode.projection.thresholds import (
    ACT_SITE,
    INPUT_SITES,
    MIN_TOKENS,
    MODULE_OF,
    Thresholds,
    parse_key,
    site_key,
    site_params,
)
from sparsedecode.registry import Registry

WINDOW = 2048
SAMPLE_CAP = 1 << 18  # elements of |x| kept per site: 1 MB, quantile error ~0.001 in keep
# Sites that read the same tensor share one sample.
_SOURCE = {"q": "attn_in", "k": "attn_in", "v": "attn_in", "o": "o_in",
           "gate": "mlp_in", "up": "mlp_in", "down": "down_in", ACT_SITE: ACT_SITE}


# -- the decoder, run layer by layer --------------------------------------------
def rope_at(model, n: int):
    """Positions (n,) and their RoPE tables cos, sin (n, D) on the model's device."""
    pos = torch.arange(n, device=model.embed_tokens.weight.device)
    return pos, model.rope_cos[pos], model.rope_sin[pos]


def run_layers(model, ids: torch.Tensor) -> torch.Tensor:
    """Hidden states (1, L, d) after the last layer for ids (L,) from position 0.

    The dense prefill path without the LM head, which calibration never needs.
    """
    pos, cos, sin = rope_at(model, ids.numel())
    x = model.embed_tokens(ids[None])  # (1, L, d)
    for layer in model.layers:
        x = layer(x, cos, sin, pos, 0)
    return x


def windows(engine, ids, window: int = WINDOW) -> list[torch.Tensor]:
    """ids cut into consecutive windows of at most `window` tokens (and the cache)."""
    t = torch.as_tensor(ids, dtype=torch.long).reshape(-1).to(engine.device)  # (N,)
    w = max(1, min(window, engine.max_len))
    return [t[s : s + w] for s in range(0, t.numel(), w)]


# -- statistics ----------------------------------------------------------------
@dataclass
class Activations:
    """Sorted |x| samples per site key, the calibration token count, and optionally
    each layer's input hidden states (1, T, d) for the first T tokens."""

    samples: dict[str, torch.Tensor]
    tokens: int
    ids: torch.Tensor | None = None  # (N,) the calibration ids, for refine passes
    hidden: list[torch.Tensor] = field(default_factory=list)
    cache: dict = field(default_factory=dict)  # for methods to reuse work across targets

    def threshold(self, key: str, keep: float) -> float | None:
        """Threshold of a site for a nominal keep; None (stays dense) at keep >= 1."""
        return quantile_threshold(self.samples[key], keep)

    def keep_at(self, key: str, t: float) -> float:
        """Fraction of the site's sample with |x| > t."""
        s = self.samples[key]
        return 1.0 - int(torch.searchsorted(s, torch.tensor(t, dtype=s.dtype), right=True)) / s.numel()


def quantile_threshold(sorted_abs: torch.Tensor, keep: float) -> float | None:
    """The (1 - keep) quantile of a sorted sample of |x| (linear interpolation)."""
    if keep >= 1.0:
        return None
    n = sorted_abs.numel()
    p = (1.0 - max(keep, 0.0)) * (n - 1)
    lo = math.floor(p)
    hi = min(lo + 1, n - 1)
    a, b = float(sorted_abs[lo]), float(sorted_abs[hi])
    return a + (b - a) * (p - lo)


@torch.inference_mode()
def collect_activations(engine, ids, *, window: int = WINDOW, cap: int = SAMPLE_CAP,
                        hidden_tokens: int = 0, seed: int = 0, table: Mapping | None = None,
                        progress: bool = False) -> Activations:
    """Passes over ids in windows; a sample of |x| at every site of every layer.

    Dense, or with the thresholds `table` applied (`masks`): each site then
    records its raw input under the sparsity of every site upstream of it.
    Raises InputError when ids has fewer than MIN_TOKENS tokens.
    """
    n = len(ids)
    if n < MIN_TOKENS:
        raise InputError(
            f"calibration text has {n} tokens, fewer than the {MIN_TOKENS} needed; "
            "give a longer text or more calibration tokens"
        )
    model = engine.model
    chunks = windows(engine, ids, window)
    per_window = math.ceil(cap / len(chunks))
    gen = torch.Generator(device=engine.device).manual_seed(seed)
    parts: dict[str, list[torch.Tensor]] = {}
    hidden: list[torch.Tensor] = []
    first = [True]

    def keep_sample(name: str, x: torch.Tensor) -> None:
        flat = x.detach().reshape(-1)
        if flat.numel() > per_window:
            flat = flat[torch.randint(flat.numel(), (per_window,), generator=gen, device=flat.device)]
        parts.setdefault(name, []).append(flat.abs().float())

    def pre(name):
        return lambda mod, args: keep_sample(name, args[0])

    def post_act(name):
        return lambda mod, args, out: keep_sample(name, F.silu(out))

    def pre_layer(mod, args):
        if first[0] and hidden_tokens > 0:
            hidden.append(args[0][:, :hidden_tokens].detach().clone())

    handles = []
    try:
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            handles += [
                layer.register_forward_pre_hook(pre_layer),
                attn.q_proj.register_forward_pre_hook(pre(f"layers.{i}.attn_in")),
                attn.o_proj.register_forward_pre_hook(pre(f"layers.{i}.o_in")),
                mlp.gate_proj.register_forward_pre_hook(pre(f"layers.{i}.mlp_in")),
                mlp.down_proj.register_forward_pre_hook(pre(f"layers.{i}.down_in")),
                mlp.gate_proj.register_forward_hook(post_act(f"layers.{i}.{ACT_SITE}")),
            ]
        # Registered after the sampling hooks, so those see each site's unmasked input.
        with masks(model, table or {}):
            for chunk in _bar(chunks, progress, "collecting activations"):
                run_layers(model, chunk)
                first[0] = False
    finally:
        for h in handles:
            h.remove()
        engine.reset()
    merged = {name: _sorted(torch.cat(p)) for name, p in parts.items()}
    samples = {
        site_key(i, s): merged[f"layers.{i}.{_SOURCE[s]}"]
        for i in range(len(model.layers))
        for s in (*INPUT_SITES, ACT_SITE)
    }
    ids_t = torch.as_tensor(ids, dtype=torch.long).reshape(-1).cpu()
    return Activations(samples=samples, tokens=n, ids=ids_t, hidden=hidden)


def _sorted(x: torch.Tensor) -> torch.Tensor:
    """Ascending copy on the CPU (numpy's sort is about 3x faster than torch's here)."""
    import numpy as np

    return torch.from_numpy(np.sort(x.cpu().numpy()))


# -- masking (the masked reference of the sparse path) ---------------------------
def _mask(x: torch.Tensor, t: float | None) -> torch.Tensor:
    return x if t is None else x * (x.abs() > t)


@contextmanager
def masks(model, table: Mapping[str, float], counts: dict | None = None,
          layers=None) -> Iterator[None]:
    """Zero, at every thresholded site, the channels with |x| <= t.

    `table` maps site keys to thresholds and is read at call time, so a caller
    may change it between forward passes. Input sites are masked by forward
    pre-hooks on their projection; the CATS site `act` zeroes gate's output
    where |SiLU(gate)| <= t, which zeroes those channels of SiLU(gate)·up, i.e.
    skips the rows of up and the columns of down. With `counts`, each key
    accumulates [kept, seen] channel counts (device tensors, no host sync).
    """

    def count(key, kept):
        if counts is not None:
            c = counts.setdefault(key, [0, 0])
            c[0] = c[0] + kept.sum()
            c[1] += kept.numel()

    def pre(key):
        def hook(mod, args):
            t = table.get(key)
            if t is None:
                return None
            kept = args[0].abs() > t
            count(key, kept)
            return (args[0] * kept, *args[1:])
        return hook

    def post_act(key):
        def hook(mod, args, out):
            t = table.get(key)
            if t is None:
                return None
            kept = F.silu(out).abs() > t
            count(key, kept)
            return out * kept
        return hook

    handles = []
    try:
        for i, layer in enumerate(model.layers):
            if layers is not None and i not in layers:
                continue
            for s in INPUT_SITES:
                parent = layer.self_attn if s in ("q", "k", "v", "o") else layer.mlp
                mod = getattr(parent, MODULE_OF[s])
                handles.append(mod.register_forward_pre_hook(pre(site_key(i, s))))
            handles.append(layer.mlp.gate_proj.register_forward_hook(post_act(site_key(i, ACT_SITE))))
        yield
    finally:
        for h in handles:
            h.remove()


@torch.inference_mode()
def measure_keep(engine, thresholds: Thresholds, ids, ff_only: bool = False, *,
                 window: int = WINDOW, progress: bool = False) -> dict:
    """Realized keep of `thresholds` on ids, measured with the sparsity applied (masked).

    Teacher-forced dense-shaped passes in windows, every position masked (the
    masked reference of the sparse decode path). Returns per-key and per-site
    keeps, 'param_keep' (the fraction of the weights of all seven projections
    read, each site weighted by its parameter count), 'ff_keep' (the same over
    gate/up/down), 'act_keep' (SiLU(gate) channels kept; None without CATS
    sites) and 'keep', the one of these that `thresholds.keep_metric` names.
    With ff_only, attention thresholds are ignored (those projections dense).
    """
    table = dict(thresholds.values)
    if ff_only:
        table = {k: v for k, v in table.items() if parse_key(k)[1] not in ("q", "k", "v", "o")}
    counts: dict = {}
    chunks = windows(engine, ids, window)
    try:
        with masks(engine.model, table, counts):
            for chunk in _bar(chunks, progress, "measuring keep"):
                run_layers(engine.model, chunk)
    finally:
        engine.reset()
    return {"tokens": len(ids), "masked": True, "ff_only": ff_only,
            **keeps_of(counts, engine.dims, thresholds.keep_metric)}


def keeps_of(counts: dict, dims, keep_metric: str) -> dict:
    """The realized keeps of `masks`' counts ({key: [kept, seen]}): 'param_keep' (the fraction of
    the weights of all seven projections read, each site weighted by its parameter count),
    'ff_keep' (the same over gate/up/down), 'act_keep' (SiLU(gate) channels kept; None without
    CATS sites), per site ('sites') and per key ('layers'), and 'keep', the one `keep_metric` names."""
    per_key = {k: float(c[0]) / c[1] for k, c in counts.items()}
    sites: dict[str, float] = {}
    for s in (*INPUT_SITES, ACT_SITE):
        seen = [counts[site_key(i, s)] for i in range(dims.n_layers) if site_key(i, s) in counts]
        if seen:
            sites[s] = float(sum(c[0] for c in seen)) / sum(c[1] for c in seen)

    def read_fraction(i: int, s: str) -> float:
        own = per_key.get(site_key(i, s), 1.0)
        act = per_key.get(site_key(i, ACT_SITE), 1.0)
        # CATS skips rows of up and columns of down; down's own input test already sees those zeros.
        if s == "up" or (s == "down" and site_key(i, s) not in per_key):
            return own * act
        return own

    def weighted(site_names) -> float:
        num = sum(site_params(dims, s) * read_fraction(i, s)
                  for i in range(dims.n_layers) for s in site_names)
        return num / (dims.n_layers * sum(site_params(dims, s) for s in site_names))

    act = sites.get(ACT_SITE)
    out = {
        "param_keep": weighted(INPUT_SITES),
        "ff_keep": weighted(("gate", "up", "down")),
        "act_keep": act,
        "sites": sites,
        "layers": per_key,
    }
    out["keep"] = out.get(keep_metric)
    return out


# -- the calibrator interface and registry ---------------------------------------
@dataclass
class Calibrator:
    """A threshold calibration method. Subclasses are dataclasses whose fields are
    their configuration; they validate them in __post_init__ (calling this one)
    and implement `site_keeps`, the nominal keep of each site.

    keep: the target, in (0, 1]. refine: masked re-collection passes over the
    first `refine_tokens` calibration tokens. Thresholds first come from the
    dense statistics; sparsifying upstream sites then shifts each site's
    input distribution (most at down, whose input is built from masked gate/up
    outputs), so the realized keep of dense quantiles drifts low (0.34 at a
    nominal 0.4 on smollm2-135m). A refine pass re-collects every site's input
    with all thresholds applied and re-takes the same quantiles there, which
    brings the realized keep back to the target.
    """

    keep: float = 0.5
    refine: int = 1
    refine_tokens: int = 2048
    name: ClassVar[str] = ""

    def __post_init__(self):
        self.keep = check_keep(self.keep, f"{self.name} keep")
        for f, low in (("refine", 0), ("refine_tokens", MIN_TOKENS)):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise InputError(f"{self.name} {f} must be an integer >= {low}, got {v!r}")

    @property
    def keep_metric(self) -> str:
        """What `keep` is a fraction of (a key of `measure_keep`'s result)."""
        return "param_keep"

    @property
    def hidden_tokens(self) -> int:
        """Leading calibration tokens whose per-layer inputs the method needs."""
        return 0

    def site_keeps(self, engine, acts: Activations, progress: bool = False) -> dict[str, float]:
        """Site key -> nominal keep (the quantile level of its threshold)."""
        raise NotImplementedError

    def calibrate(self, engine, ids, *, text: str = "", progress: bool = False) -> Thresholds:
        """Thresholds for `engine`'s model from calibration ids (described by `text`)."""
        acts = collect_activations(engine, ids, hidden_tokens=self.hidden_tokens, progress=progress)
        return self.fit(engine, acts, text=text, progress=progress)

    def fit(self, engine, acts: Activations, *, text: str = "", progress: bool = False) -> Thresholds:
        """Thresholds from statistics already collected (several targets share one pass)."""
        keeps = self.site_keeps(engine, acts, progress)
        values = _thresholds(acts, keeps)
        for _ in range(self.refine):
            masked = collect_activations(engine, acts.ids[: self.refine_tokens], table=values,
                                         progress=progress)
            values = _thresholds(masked, keeps)
        params = asdict(self)
        return Thresholds(
            values=values, method=self.name, keep=self.keep, model=engine.name,
            dims=engine.dims.to_dict(), keep_metric=self.keep_metric,
            calibration={"text": text, "tokens": acts.tokens},
            extras={k: v for k, v in params.items() if k != "keep"},
        )


def _thresholds(acts: Activations, keeps: dict[str, float]) -> dict[str, float]:
    values = {k: acts.threshold(k, kp) for k, kp in keeps.items()}
    return {k: t for k, t in values.items() if t is not None}


CALIBRATORS: Mapping[str, type[Calibrator]] = Registry("calibration method", {
    "teal": "sparsedecode.projection.teal:Teal",
    "cats": "sparsedecode.projection.cats:Cats",
    "sats": "sparsedecode.projection.sats:Sats",
})


def get_calibrator(name: str, **params) -> Calibrator:
    """Build the calibrator `name` from its fields; an unknown name suggests a close one."""
    return CALIBRATORS.build(name, **params)


def _bar(items, enabled: bool, desc: str):
    if not enabled:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, unit="window", leave=False)


__all__ = [
    "CALIBRATORS", "MIN_TOKENS", "Activations", "Calibrator", "collect_activations",
    "get_calibrator", "masks", "measure_keep", "quantile_threshold", "rope_at", "run_layers",
]


def cached_teal(engine, keep: float, tokens: int = 8192, text_file=None, progress: bool = True):
    """Uniform TEAL thresholds at `keep` for `engine`, calibrated on the first `tokens` of
    WikiText-2 validation (or `text_file`) once and cached under the sparsedecode cache
    (`generate --proj-keep`). The cache file is named by the text's sha256, so other text
    calibrates anew; with `progress` the first run says (stderr) where the file goes and how
    to reuse it."""
    from sparsedecode.cache import cache_dir, sha256_of
    from sparsedecode.corpus import text_ids, wikitext_path

    keep = check_keep(keep, option("keep", flag="--proj-keep"))
    path = wikitext_path("valid", text_file)
    text = sha256_of(path)[:16]  # the content names the file: the same text anywhere, other text anew
    out = cache_dir() / "thresholds" / f"{engine.name}-teal-{keep:g}-{tokens}-text{text}.safetensors"
    if out.is_file():
        return Thresholds.load(out)
    ids = text_ids(engine.tokenizer, path)
    if len(ids) < tokens:
        raise InputError(f"{path} has {len(ids):,} tokens, fewer than the {tokens:,} calibration needs")
    if progress:
        import sys

        print(f"[calibrating TEAL thresholds for keep {keep:g} on {tokens:,} tokens of {path.name}, once per "
              f"model, keep and text: later runs reuse them from {out}, and --thresholds FILE takes that "
              "file anywhere]", file=sys.stderr, flush=True)
    th = get_calibrator("teal", keep=keep).calibrate(
        engine, ids[:tokens], text=f"{path.name}[:{tokens}]", progress=progress
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    th.save(out)
    return th


def own_teal(engine, keep: float, tokens: int = 2048, seed: int = 0, text_file=None, progress: bool = False):
    """Uniform TEAL thresholds at `keep` on the model's own activations, as a timing cell
    calibrates them: WikiText-2 validation (or `text_file`, cached per model, `cached_teal`)
    with a tokenizer, `tokens` seeded random ids without one (a random-init model for timing).
    Returns (thresholds, what they were calibrated on)."""
    return own_thresholds(engine, keep, "teal", tokens=tokens, seed=seed, text_file=text_file, progress=progress)


def own_thresholds(engine, keep: float, method: str = "teal", tokens: int = 2048, seed: int = 0, text_file=None,
                   progress: bool = False):
    """Thresholds of `method` (teal, cats, sats: `CALIBRATORS`) at `keep` on the model's own
    activations: WikiText-2 validation (or `text_file`) with a tokenizer, TEAL's cached
    (`cached_teal`), `tokens` seeded random ids without one (a random-init model for timing: its
    keep is real, App. A). Returns (thresholds, what they were calibrated on)."""
    if engine.tokenizer is not None:
        what = "wikitext-2 validation" if text_file is None else "text option (valid split)"
        if method == "teal":
            return cached_teal(engine, keep, tokens=tokens, text_file=text_file, progress=progress), what
        from sparsedecode.corpus import text_ids, wikitext_path

        path = wikitext_path("valid", text_file)
        ids = text_ids(engine.tokenizer, path)
        if len(ids) < tokens:
            raise InputError(f"{path} has {len(ids):,} tokens, fewer than the {tokens:,} calibration needs")
        th = get_calibrator(method, keep=keep).calibrate(engine, ids[:tokens], text=f"{path.name}[:{tokens}]",
                                                         progress=progress)
        return th, what
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, engine.dims.vocab, (tokens,), generator=gen)
    th = get_calibrator(method, keep=keep).calibrate(engine, ids, text=f"random ids (seed {seed})",
                                                    progress=progress)
    return th, f"random ids (seed {seed})"
