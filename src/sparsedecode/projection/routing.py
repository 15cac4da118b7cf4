"""Token routing: per token id, the dense MLP or the CATS path (SATS paper §3.2).

CATS / SATS thresholds (SATS paper §2, §3.1) make one sparse model that every
decode step runs. Token routing lets each step choose between the base (dense)
MLP and the sparse path from the current token id alone, so the decision is a
lookup in a table over the vocabulary:

- `build_routing_table`: on a routing text (WikiText-2 validation by default),
  teacher-forced in windows, each position i gets its next-token cross-entropy
  under the dense MLP (l_dense) and under the CATS thresholds at every position
  (l_sparse; the masked reference of the sparse decode path, `calibrate.masks`).
  The excess damage is d_i = max(0, l_sparse - l_dense), and the score of token
  id x is s(x) = mean of d_i over the positions whose current token is x.
  Two full-sequence passes per window, not two decode loops.
- `calibrate_routing`: the routing threshold tau is chosen on a held-out split
  so that the realized routed fraction R(tau), the fraction of its token
  occurrences with s(x) < tau (routed sparse), is closest to a target:
  tau* = argmin |R(tau) - r_tar|. R is a step function of tau, so the
  candidates are the distinct scores themselves (tau = u_k routes exactly the
  tokens scoring below u_k) and one value above the largest.
- `RoutingTable`: scores (V,) float32 (NaN for ids absent from the routing
  text, which route dense unless `unseen='sparse'`), counts (V,), and a JSON
  header naming the model, thresholds, tokenizer (vocabulary size and a hash of
  its vocabulary: ids index tokens, so a table only serves the tokenizer it was
  built with) and the routing text; tau, target and realized fraction once
  calibrated. Saved as one safetensors file.

`Engine.route(table)` runs it in the decode step (`cats_runtime.Router`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from sparsedecode.cache import sha256_of as file_sha256  # a routing text: known by its content
from sparsedecode.errors import InputError, option
from sparsedecode.projection.calibrate import MIN_TOKENS, WINDOW, _bar, masks, run_layers, windows
from sparsedecode.projection.thresholds import ACT_SITE, Thresholds
from sparsedecode.stfile import load_with_header, save_with_header

FORMAT = "sparsedecode-routing/1"
UNSEEN = ("dense", "sparse")
LOSS_ROWS = 256  # positions per LM-head slice: bounds the (rows, V) float32 logits


def tokenizer_fingerprint(tokenizer) -> dict:
    """{'vocab': len(tokenizer), 'sha256': hash of its (id, token) pairs}; both None
    without a tokenizer. Two tokenizers agree on every id iff the hashes agree."""
    if tokenizer is None:
        return {"vocab": None, "sha256": None}
    items = sorted((int(i), str(t)) for t, i in tokenizer.get_vocab().items())
    digest = hashlib.sha256(json.dumps(items, ensure_ascii=False).encode("utf-8")).hexdigest()
    return {"vocab": len(tokenizer), "sha256": digest}


def check_cats(thresholds: Thresholds) -> None:
    """Routing chooses between the dense MLP and the CATS path: 'act' thresholds only."""
    sites = thresholds.sites
    if sites != [ACT_SITE]:
        raise InputError(
            f"token routing chooses between the dense MLP and the CATS path, so it needs a CATS-style "
            f"thresholds file (sites 'act', method cats or sats); this one ({thresholds.method}) has "
            f"sites {', '.join(sites) or 'none'}. Calibrate one: sparsedecode calibrate --method cats"
        )


def routing_for(table, engine) -> RoutingTable:
    """`table` (a RoutingTable or its file) checked against `engine`: its vocabulary and
    tokenizer, and CATS thresholds installed; a warning where the table scored other ones."""
    table = table if isinstance(table, RoutingTable) else RoutingTable.load(table)
    table.check(engine)
    if engine.thresholds is None:
        raise InputError("token routing chooses between the dense MLP and the CATS path: install CATS "
                         f"thresholds first ({option('thresholds', 'FILE', placeholder=True)})")
    check_cats(engine.thresholds)
    mine, theirs = engine.thresholds, table.thresholds
    if (mine.method, mine.keep) != (theirs.get("method"), theirs.get("keep")):
        import warnings

        warnings.warn(
            f"the routing table scored {theirs.get('method')} keep {theirs.get('keep')} "
            f"thresholds and the engine runs {mine.method} keep {mine.keep:g}: its scores "
            "may not rank this sparse path's damage", stacklevel=3)
    return table


@dataclass
class RoutingTable:
    """Per-token-id routing scores and their header.

    scores (V,) float32: s(x), mean excess loss of the sparse path at occurrences of id x
    (NaN where x never occurred); count (V,) int64: those occurrences. vocab: V, the
    model's logit rows. tokenizer: `tokenizer_fingerprint`. thresholds: file, method,
    keep, keep_metric and model of the thresholds scored. text: the routing text
    ({'source', 'path', 'tokens', 'window'}). stats: mean losses over the routing text.
    tau, target, routed, held_out: the operating point once calibrated (`calibrate_routing`).
    adapter: the LoRA adapter the scored model ran ({'path', 'rank', 'alpha', 'targets'}; None:
    the base weights), SATS Table 7's routed fine-tuned models: an engine must run the same one.
    """

    scores: torch.Tensor
    count: torch.Tensor
    model: str
    vocab: int
    tokenizer: dict
    thresholds: dict
    text: dict
    unseen: str = "dense"
    stats: dict = field(default_factory=dict)
    tau: float | None = None
    target: float | None = None
    routed: float | None = None
    held_out: dict = field(default_factory=dict)
    adapter: dict | None = None

    def __post_init__(self):
        if self.adapter is not None and not (isinstance(self.adapter, dict) and isinstance(self.adapter.get("path"), str)):
            raise InputError(f"a routing table's adapter is {{'path': ..., ...}} or null, got {self.adapter!r}")
        if self.unseen not in UNSEEN:
            raise InputError(f"unseen must be 'dense' or 'sparse', got {self.unseen!r}")
        if self.scores.shape != (self.vocab,) or self.count.shape != (self.vocab,):
            raise InputError(
                f"a routing table holds (V,) scores and counts with V = {self.vocab}; got "
                f"{tuple(self.scores.shape)} and {tuple(self.count.shape)}"
            )
        self.scores = self.scores.float().cpu()
        self.count = self.count.long().cpu()

    @property
    def calibrated(self) -> bool:
        return self.tau is not None

    def sparse_of(self, tau: float | None = None) -> torch.Tensor:
        """(V,) bool: True where a token id routes sparse, s(x) < tau (default self.tau);
        ids never seen follow `unseen`."""
        tau = self.tau if tau is None else tau
        if tau is None:
            raise InputError(
                "this routing table has no threshold tau yet; choose one on held-out text: "
                "sparsedecode route calibrate --table FILE --target 0.5"
            )
        seen = self.count > 0
        return torch.where(seen, self.scores < tau, self.unseen == "sparse")

    def routed_fraction(self, ids, tau: float | None = None) -> float:
        """Fraction of the token occurrences in ids (N,) that route sparse: R(tau)."""
        ids = _ids(ids, self.vocab)
        return float(self.sparse_of(tau)[ids].float().mean())

    # -- compatibility -----------------------------------------------------------
    def check(self, engine) -> None:
        """Refuse a table made for another vocabulary or tokenizer than `engine`'s."""
        vocab = engine.dims.vocab
        if vocab != self.vocab:
            raise InputError(
                f"the routing table has {self.vocab:,} entries (built for '{self.model}') but "
                f"'{engine.name}' has a vocabulary of {vocab:,} tokens; build a table for this "
                f"model: sparsedecode route build --model {engine.name} --thresholds FILE --out TABLE"
            )
        self.check_tokenizer(engine.tokenizer, engine.name)
        if self.adapter is not None:
            from sparsedecode.projection.lora import same_adapter

            loaded = getattr(engine, "adapter", None)
            if loaded is None or not same_adapter(loaded, self.adapter["path"]):
                raise InputError(
                    f"the routing table was scored on '{self.model}' with adapter {self.adapter['path']}, and this "
                    f"engine runs {'no adapter' if loaded is None else f'adapter {loaded.path}'}: its scores are "
                    f"that fine-tuned model's; load with {option('adapter', self.adapter['path'])} or build a table "
                    "for this model (sparsedecode route build)")

    def check_tokenizer(self, tokenizer, name: str = "this model") -> None:
        """Refuse a tokenizer whose vocabulary differs from the one the table was built with."""
        have = tokenizer_fingerprint(tokenizer)
        want = self.tokenizer
        if have == {k: want.get(k) for k in have}:
            return
        raise InputError(
            f"the routing table was built with {_describe(want)} ('{self.model}') but {name} has "
            f"{_describe(have)}: its token ids would look up other tokens' scores; build a table "
            f"with this tokenizer: sparsedecode route build --model MODEL --thresholds FILE --out TABLE"
        )

    # -- files -----------------------------------------------------------------
    def header(self) -> dict:
        h = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del h["scores"], h["count"]
        return h

    def save(self, path: str | os.PathLike) -> Path:
        """Write the safetensors file atomically (a temp name, then renamed)."""
        return save_with_header(path, {"scores": self.scores, "count": self.count}, FORMAT, self.header())

    @classmethod
    def load(cls, path: str | os.PathLike) -> RoutingTable:
        """Read a file written by `save`; anything else is an InputError."""
        from sparsedecode.stfile import fit_header

        tensors, header = load_with_header(path, FORMAT, "routing table", "sparsedecode route build",
                                           keys={"scores", "count"})
        fields = tuple(f for f in cls.__dataclass_fields__ if f not in ("scores", "count"))
        header = fit_header(header, fields, ("model", "vocab", "tokenizer", "thresholds", "text"), path,
                            "routing table")
        for key, lo, hi in (("tau", -math.inf, math.inf), ("target", 0.0, 1.0), ("routed", 0.0, 1.0)):
            v = header.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)
                                  or not lo <= v <= hi):
                raise InputError(f"{path}: header {key} is {v!r}" + ("" if key == "tau" else ", outside [0, 1]")
                                 + "; calibrate the table again (sparsedecode route calibrate)")
        scores, count = tensors["scores"], tensors["count"]
        if torch.isinf(scores).any():
            raise InputError(f"{path}: the routing scores hold infinities; build the table again")
        if (count < 0).any():
            raise InputError(f"{path}: negative occurrence counts; build the table again")
        try:
            return cls(scores=scores, count=count, **header)
        except (InputError, TypeError) as err:
            raise InputError(f"{path}: {err}") from None


def _describe(fingerprint: dict) -> str:
    if fingerprint.get("sha256") is None:
        return "no tokenizer"
    return (f"a tokenizer of {fingerprint['vocab']:,} tokens "
            f"(vocabulary sha256 {fingerprint['sha256'][:12]})")


def held_out_start(table: RoutingTable, path: str | os.PathLike, explicit: bool) -> tuple[int, str]:
    """(first token of held-out text in `path`, why) for calibrating `table`: after the table's
    routing range when `path` holds the routing text, 0 when it is other text the user gave.
    Refuses when that cannot be told, so tau is never calibrated on the routing tokens."""
    rec = table.text or {}
    sha, start, n = rec.get("sha256"), int(rec.get("start") or 0), int(rec.get("tokens") or 0)
    here = file_sha256(path)
    if sha is not None:
        if here == sha:
            return start + n, f"the routing text after its {n:,} routing tokens from {start:,}"
        if explicit:
            return 0, "other text than the routing text (its sha256 differs)"
        raise InputError(
            f"the table's routing text (sha256 {sha[:12]}, recorded at {rec.get('path')}) is not at {path}: "
            f"give that text ({option('text_file', python='its ids')}; calibration then starts after its "
            "routing tokens) or other held-out text")
    same_path = rec.get("path") and Path(rec["path"]).resolve() == Path(path).resolve()
    if same_path:
        return start + n, f"the routing text after its {n:,} routing tokens (same path; the table has no hash)"
    raise InputError(
        "the table records no hash of its routing text, so held-out text cannot be told apart from "
        f"the {n:,} routing tokens ({rec.get('source') or 'unknown text'}): build the table again with "
        "this version of sparsedecode route build")


def _ids(ids, vocab: int) -> torch.Tensor:
    t = torch.as_tensor(ids, dtype=torch.long).reshape(-1).cpu()  # (N,)
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
        raise InputError(f"token ids must lie in [0, {vocab}); got ids up to {int(t.max())}")
    return t


# -- scores ---------------------------------------------------------------------
def _next_token_loss(model, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy (n,) float32 of targets (n,) under hidden states (1, >= n, d)."""
    out = []
    for s in range(0, targets.numel(), LOSS_ROWS):
        h = hidden[0, s : s + LOSS_ROWS][: targets.numel() - s]  # (r, d)
        logits = model.lm_head(model.norm(h)).float()  # (r, V)
        out.append(F.cross_entropy(logits, targets[s : s + logits.shape[0]], reduction="none"))
    return torch.cat(out)


@torch.inference_mode()
def position_losses(engine, thresholds: Thresholds, ids, *, window: int = WINDOW,
                    progress: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens (n,), l_dense (n,), l_sparse (n,)) for every position of ids (N,) that has a
    next token (n = N - 1): the current token id and its next-token cross-entropy (nats)
    under the dense MLP and under the CATS thresholds at every position. Windows of
    `window` tokens start from position 0 each; a window's last position is scored
    against the first token of the next."""
    check_cats(thresholds)
    model = engine.model
    all_ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1).to(engine.device)  # (N,)
    chunks = windows(engine, all_ids, window)
    toks, dense, sparse = [], [], []
    start = 0
    try:
        for chunk in _bar(chunks, progress, "routing scores"):
            targets = all_ids[start + 1 : start + 1 + chunk.numel()]  # (<= w,)
            start += chunk.numel()
            if targets.numel() == 0:
                continue
            dense.append(_next_token_loss(model, run_layers(model, chunk), targets))
            with masks(model, thresholds.values):
                sparse.append(_next_token_loss(model, run_layers(model, chunk), targets))
            toks.append(chunk[: targets.numel()])
    finally:
        engine.reset()
    return (torch.cat(toks).cpu(), torch.cat(dense).cpu(), torch.cat(sparse).cpu())


def token_scores(tokens: torch.Tensor, l_dense: torch.Tensor, l_sparse: torch.Tensor,
                 vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(s (V,) float32, count (V,) int64): s(x) = mean over occurrences i of id x of
    d_i = max(0, l_sparse_i - l_dense_i); NaN where x never occurs."""
    d = (l_sparse.double() - l_dense.double()).clamp_min(0.0)  # (n,)
    count = torch.bincount(tokens, minlength=vocab)  # (V,)
    total = torch.zeros(vocab, dtype=torch.float64).index_add_(0, tokens, d)  # (V,)
    scores = torch.where(count > 0, total / count.clamp_min(1), math.nan).float()
    return scores, count


def build_routing_table(engine, thresholds, ids, *, window: int = WINDOW, unseen: str = "dense",
                        thresholds_file: str | None = None, text: str = "",
                        text_path: str | None = None, text_sha256: str | None = None,
                        text_start: int = 0, progress: bool = False) -> RoutingTable:
    """The routing table of `thresholds` (a CATS/SATS `Thresholds` or its file) for
    `engine`'s model from routing ids (N,) (SATS §3.2). Needs at least MIN_TOKENS ids.
    The table records its text (path, content sha256, start offset in tokens, token count) so
    that calibration can hold out what follows (`cli route calibrate`)."""
    if unseen not in UNSEEN:
        raise InputError(f"unseen must be 'dense' or 'sparse', got {unseen!r}")
    if not isinstance(thresholds, Thresholds):
        thresholds_file = thresholds_file or str(thresholds)
        thresholds = Thresholds.load(thresholds)
    thresholds.validate(engine.dims)
    vocab = engine.dims.vocab
    ids = _ids(ids, vocab)
    if ids.numel() < MIN_TOKENS:
        raise InputError(
            f"routing text has {ids.numel()} tokens, fewer than the {MIN_TOKENS} needed; "
            f"give a longer {option('text_file', python='text')} or a larger {option('tokens', python='count')}"
        )
    tokens, l_dense, l_sparse = position_losses(engine, thresholds, ids, window=window,
                                                progress=progress)
    scores, count = token_scores(tokens, l_dense, l_sparse, vocab)
    d = (l_sparse - l_dense).clamp_min(0.0)
    return RoutingTable(
        scores=scores, count=count, model=engine.name, vocab=vocab,
        tokenizer=tokenizer_fingerprint(engine.tokenizer),
        thresholds={"file": thresholds_file, "method": thresholds.method, "keep": thresholds.keep,
                    "keep_metric": thresholds.keep_metric, "model": thresholds.model},
        text={"source": text, "path": text_path, "sha256": text_sha256, "start": int(text_start),
              "tokens": int(ids.numel()), "window": min(window, engine.max_len)},
        unseen=unseen, adapter=None if getattr(engine, "adapter", None) is None else {
            k: v for k, v in engine.adapter.summary().items() if k in ("path", "rank", "alpha", "targets")},
        stats={"positions": int(tokens.numel()), "distinct_tokens": int((count > 0).sum()),
               "loss_dense": float(l_dense.mean()), "loss_sparse": float(l_sparse.mean()),
               "mean_excess": float(d.mean()), "sparse_worse": float((d > 0).float().mean())},
    )


# -- the operating point ----------------------------------------------------------
def routing_curve(table: RoutingTable, ids) -> tuple[list[float], list[float]]:
    """(taus, R(tau)) at every distinct routed fraction on ids (N,), ascending: taus are
    the distinct scores (tau = u_k routes the ids scoring below u_k) and one above the
    largest (every seen id sparse). Exact float32 values, so s(x) < tau is evaluated as
    stored."""
    ids = _ids(ids, table.vocab)
    if ids.numel() == 0:
        raise InputError("no held-out tokens to calibrate the routing threshold on")
    occ = torch.bincount(ids, minlength=table.vocab).double()  # (V,)
    seen = table.count > 0
    base = float(occ[~seen].sum()) if table.unseen == "sparse" else 0.0
    s, o = table.scores[seen], occ[seen]  # (S,)
    uniq, inverse = torch.unique(s, sorted=True, return_inverse=True)  # (U,)
    per = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inverse, o)  # (U,)
    below = torch.cat([torch.zeros(1, dtype=torch.float64), per.cumsum(0)])  # (U+1,)
    if uniq.numel():
        top = torch.nextafter(uniq[-1:], torch.tensor([math.inf]))  # (1,) float32
        taus = torch.cat([uniq, top]).tolist()
    else:  # no seen id: every tau gives the same fraction
        taus = [0.0]
        below = below[:1]
    return taus, ((below + base) / ids.numel()).tolist()


def calibrate_routing(table: RoutingTable, engine, held_out_ids, target: float, *,
                      text: str = "", held_out: dict | None = None) -> RoutingTable:
    """A copy of `table` with tau* = argmin |R(tau) - target| on held-out ids (N,)
    (SATS §3.2: 25/50/75% targets), and the realized R(tau*). `engine` is the Engine
    (or just its tokenizer: calibration runs no model) whose tokenizer must match."""
    try:
        target = float(target)
    except (TypeError, ValueError):
        raise InputError(f"routing target '{target}' is not a number: give a fraction in [0, 1]") from None
    if not 0.0 <= target <= 1.0:
        raise InputError(
            f"routing target {target:g} is outside [0, 1]: it is the fraction of tokens routed "
            "to the sparse path (e.g. 0.25, 0.5, 0.75)"
        )
    if hasattr(engine, "dims"):
        table.check(engine)
    else:
        table.check_tokenizer(engine)
    ids = _ids(held_out_ids, table.vocab)
    taus, fracs = routing_curve(table, ids)
    k = min(range(len(taus)), key=lambda i: (abs(fracs[i] - target), i))
    return dataclasses.replace(
        table, tau=float(taus[k]), target=target, routed=float(fracs[k]),
        held_out={"source": text, **(held_out or {}), "tokens": int(ids.numel())},
    )


__all__ = [
    "FORMAT", "RoutingTable", "build_routing_table", "calibrate_routing", "check_cats", "file_sha256",
    "held_out_start", "routing_for",
    "position_losses", "routing_curve", "token_scores", "tokenizer_fingerprint",
]
