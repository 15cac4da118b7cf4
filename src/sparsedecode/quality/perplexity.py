"""WikiText-2 perplexity protocols under an engine configuration (ByteCross App. A,
'Quality protocols'; App. G and H; issue 7 defines them).

chunked: consecutive chunks of 2,048 tokens from token 0 of the stream (128 in the
paper). The first 1,024 positions of each chunk run dense (they fill the cache),
the last 1,024 positions run under the configuration, and their next-token
losses are scored (the last target of a chunk is the first token of the next).
The scored half is a prefill, so only the projection branch applies: on every
device it runs as its masked reference (`projection.calibrate.masks`), the same
arithmetic as the sparse GEMV, every weight still read. A KV selection has no
meaning here (a prefill reads the whole cache) and is refused: score it with
the decode protocol.

decode: decode-position perplexity. k windows of L tokens (8 in the paper) whose
starts are evenly spaced over [0, N - L - 1] of the N-token stream, so the runs
are deterministic (App. H: eight 32K windows whose starts span 0 to 256,305).
Each window is prefilled densely except its last 512 tokens; those 512 are fed
one at a time through the engine's real decode step under the configuration,
teacher-forced, and each step scores the next token. The targets are the last
511 tokens of the window and the token after it, as the chunked protocol scores
the next chunk's first token; the cache ends holding all L. The KV selection
runs once after the prefill with room for the 512 steps, as `generate` does
(App. A 'Scored selection'); the projection branch runs in the decode step.

A keep ratio of 1 disables its branch (App. H, Table 16). Both protocols return
the summed NLL and the target count of every window (`WindowNLL`), so
`quality.bootstrap` can resample windows, paired between dense and a
configuration.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from sparsedecode.errors import InputError, option

CHUNK = 2048
DENSE = 1024
SCORED = 512  # decode protocol: targets scored one step at a time per window
PREFILL_CHUNK = 512
PROTOCOLS = ("chunked", "decode")


@dataclass
class WindowNLL:
    """Per window (or chunk) of a protocol: summed next-token NLL in nats, scored
    targets, and the window's first token in the stream."""

    protocol: str
    nll: list[float]
    targets: list[int]
    starts: list[int]

    @property
    def ppl(self) -> float:
        """Aggregate perplexity: exp of the NLL pooled over every scored target."""
        return math.exp(sum(self.nll) / sum(self.targets))

    def to_dict(self) -> dict:
        return {**asdict(self), "ppl": self.ppl}


def check_config(protocol: str, config=None) -> None:
    """Refuse an unknown protocol, and a KV configuration under the chunked protocol."""
    if protocol not in PROTOCOLS:
        raise InputError(f"unknown perplexity protocol '{protocol}': use {' or '.join(PROTOCOLS)}")
    if protocol == "chunked" and config is not None and config.kv is not None:
        raise InputError(
            f"the chunked protocol scores a prefill, which reads the whole cache, so the KV "
            f"configuration ({config.kv.method} keep {config.kv.keep:g}) has no meaning there; "
            f"score KV selections with the decode protocol ({option('protocol', 'decode')})"
        )


def resolve_projection(engine, projection, thresholds=None):
    """The `Thresholds` of a configuration's projection branch (a `config.ProjectionConfig`):
    `thresholds` when given (calibrated for it), else its file, else TEAL at its keep (cached,
    `cached_teal`); checked against the engine's dims and the branch's keep; None when dense or
    when its keep is 1 (the branch is off: nothing is calibrated for it)."""
    from sparsedecode.projection.thresholds import Thresholds

    if projection is None:
        if thresholds is not None:
            raise InputError("thresholds go with a configuration that has a projection branch (proj...)")
        return None
    if thresholds is not None:
        th = thresholds if isinstance(thresholds, Thresholds) else Thresholds.load(thresholds)
        if projection.keep is not None and abs(th.keep - projection.keep) > 1e-9:
            raise InputError(f"the thresholds given were calibrated at keep {th.keep:g}, not at the "
                             f"configuration's projection keep {projection.keep:g}")
    elif projection.keep is not None and projection.keep >= 1.0:
        return None
    elif projection.file is not None:
        th = Thresholds.load(projection.file)
    else:
        from sparsedecode.projection.calibrate import cached_teal

        th = cached_teal(engine, projection.keep, progress=False)
    th.validate(engine.dims)
    return None if th.keep >= 1.0 else th


# -- chunked ------------------------------------------------------------------
@torch.inference_mode()
def chunked_nll(engine, ids, chunks: int = 128, table: dict | None = None,
                progress: bool = False, *, config=None, thresholds=None, routing=None,
                counts: dict | None = None) -> list[float]:
    """Summed next-token NLL (nats) of each chunk's scored targets; `table` maps threshold
    keys to thresholds (input sites and CATS `act`), or `config` (a `config.SparsityConfig`
    without a KV branch, possibly routed; `thresholds`/`routing`: its calibrated artefacts, as
    `Engine.configure` takes them) names them; neither is dense. `counts` (a dict) receives the
    kept and seen channels of every thresholded key over the scored positions
    (`projection.calibrate.masks`; `keeps_of` turns them into the realized keep)."""
    if config is not None:
        if table is not None:
            raise InputError("give a threshold table or a configuration, not both")
        check_config("chunked", config)
        th = resolve_projection(engine, config.projection, thresholds)
        table = None if th is None else th.values
        routing = _routing_of(config, routing)
        if th is not None and routing is not None:
            return chunked_nll_many(engine, ids, chunks, [(table, _sparse_of(engine, routing))],
                                    progress, counts=counts)[0]
    return chunked_nll_many(engine, ids, chunks, [(table, None)], progress, counts=counts)[0]


def _routing_of(config, routing):
    """The routing table given, or the file the configuration names (None without routing)."""
    if routing is not None:
        return routing
    return None if config is None or config.projection is None else config.projection.routing


def _sparse_of(engine, routing) -> torch.Tensor:
    """(V,) bool: token ids a calibrated routing table (or its file) sends to the sparse path."""
    from sparsedecode.projection.routing import RoutingTable

    table = routing if isinstance(routing, RoutingTable) else RoutingTable.load(routing)
    table.check(engine)
    if not table.calibrated:
        raise InputError("the routing table has no tau yet: run `sparsedecode route calibrate` first")
    return table.sparse_of()


@torch.inference_mode()
def chunked_nll_many(engine, ids, chunks: int, settings, progress: bool = False, *,
                     counts: dict | None = None) -> list[list[float]]:
    """`chunked_nll` of several settings from one dense prefill of each chunk's first half.

    settings: (table, sparse_of) pairs; table maps threshold keys to thresholds (None:
    dense), sparse_of is None or a (V,) bool routing lookup (SATS paper §3.2): a scored
    position applies the thresholds only where its current token id routes sparse and is
    dense elsewhere, as the routed decode step does. Returns per setting the summed NLL
    of each chunk. Each setting rewrites the cache past position DENSE with its own pass,
    so the first half is prefilled once per chunk for all of them. `counts`: see `chunked_nll`
    (pooled over the settings)."""
    from sparsedecode.projection.calibrate import masks

    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)  # (N,)
    need = chunks * CHUNK + 1
    if chunks < 1 or ids.numel() < need:
        raise InputError(
            f"chunked perplexity over {chunks} chunks needs {need:,} tokens, the text has "
            f"{ids.numel():,}; use fewer chunks or a longer text"
        )
    if engine.max_len < CHUNK:
        raise InputError(f"chunked perplexity needs a cache of {CHUNK} tokens; load with max_len >= {CHUNK}")
    out: list[list[float]] = [[] for _ in settings]
    bar = _token_bar(chunks * (DENSE + len(settings) * (CHUNK - DENSE)), progress, "chunked")
    for k in range(chunks):
        bar.set_postfix_str(f"chunk {k + 1}/{chunks}", refresh=False)
        c = ids[k * CHUNK : (k + 1) * CHUNK + 1]  # (2049,): the chunk and the next token
        engine.reset()
        engine.prefill(c[:DENSE])  # dense positions 0..1023
        bar.update(DENSE)
        for j, (table, sparse_of) in enumerate(settings):
            logits = []
            for s in range(DENSE, CHUNK, PREFILL_CHUNK):  # the engine's prefill pieces, made here
                piece = c[s : min(s + PREFILL_CHUNK, CHUNK)]  # (l,)
                t = table
                if table and sparse_of is not None:  # per position: the threshold, or keep all
                    on = sparse_of.to(piece.device)[piece][None, :, None].to(engine.device)  # (1, l, 1)
                    t = {key: torch.where(on, float(v), -1.0) for key, v in table.items()}
                with masks(engine.model, t or {}, counts):
                    logits.append(engine.prefill(piece, chunk=PREFILL_CHUNK, start=s, all_logits=True))
                bar.update(len(piece))
            logits = torch.cat(logits)  # (1024, V)
            nll = F.cross_entropy(logits.double(), c[DENSE + 1 :].to(logits.device), reduction="sum")
            out[j].append(float(nll))
    bar.close()
    engine.reset()
    return out


def resumable_chunked_nll(engine, ids, chunks: int, names: list[str], settings, progress_file,
                          desc: str = "chunks") -> dict[str, list[float]]:
    """`chunked_nll_many` of named `settings` over `chunks` chunks of `ids`, one chunk at a time,
    the per-chunk NLLs saved after each chunk in `progress_file` (JSON, written atomically): a
    rerun with the same names and chunk count continues from the last saved chunk, any other
    starts over. Nothing is lost when a long evaluation is interrupted; delete the file once its
    results are recorded."""
    import json
    import os
    from pathlib import Path

    from tqdm import tqdm

    if len(names) != len(settings):
        raise InputError(f"{len(names)} names for {len(settings)} settings")
    prog = Path(progress_file)
    done = json.loads(prog.read_text()) if prog.exists() else {}
    if done.get("names") != list(names) or done.get("chunks") != chunks:
        done = {}  # another set of settings: start over
    nll = done.get("nll") or {n: [] for n in names}
    start = min(len(v) for v in nll.values())
    for k in tqdm(range(start, chunks), desc=desc, unit="chunk", initial=start, total=chunks):
        out = chunked_nll_many(engine, ids[k * CHUNK : (k + 1) * CHUNK + 1], 1, settings)
        for n, v in zip(names, out, strict=True):
            nll[n] = nll[n][:k] + v
        tmp = prog.with_name(prog.name + ".tmp")
        tmp.write_text(json.dumps({"names": list(names), "chunks": chunks, "nll": nll}))
        os.replace(tmp, prog)
    return nll


def _token_bar(total: int, enabled: bool, desc: str):
    """A bar counted in tokens (prefilled or decoded), so it moves within a window and its ETA
    holds from the first one; a no-op bar when not `enabled`."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="tok", unit_scale=True, leave=False, disable=not enabled)


def pooled_ppl(nll_per_chunk: list[float], targets_per_chunk: int = CHUNK - DENSE) -> float:
    """exp of the mean NLL over every scored target."""
    return math.exp(sum(nll_per_chunk) / (targets_per_chunk * len(nll_per_chunk)))


# -- decode-position ----------------------------------------------------------
def decode_starts(n_tokens: int, windows: int, length: int) -> list[int]:
    """First tokens of `windows` windows of `length` tokens, evenly spaced over
    [0, n_tokens - length - 1] (each window also needs the token after it)."""
    if windows < 1:
        raise InputError(f"the decode protocol needs at least one window, got {windows}")
    span = n_tokens - length - 1
    if span < 0:
        raise InputError(
            f"decode-position windows of {length:,} tokens need {length + 1:,} tokens of text (the "
            f"window and the token after it), the text has {n_tokens:,}; use a shorter {option('length')} "
            "or a longer text"
        )
    if windows == 1:
        return [0]
    return [i * span // (windows - 1) for i in range(windows)]


def check_decode_length(engine, length: int, scored: int = SCORED) -> None:
    """Refuse a window the engine cannot hold or that leaves nothing to prefill."""
    if scored < 1 or length <= scored:
        raise InputError(
            f"decode-position windows of {length:,} tokens cannot score their last {scored:,}: "
            f"the length must exceed the scored tokens (at least one token is prefilled); "
            f"use {option('length')} > {scored}"
        )
    window = engine.args.max_position
    if length > window:
        raise InputError(
            f"decode-position windows of {length:,} tokens exceed the model window of {window:,} "
            f"tokens; use {option('length', window)} or less"
        )
    if length > engine.max_len:
        raise InputError(
            f"decode-position windows of {length:,} tokens need a cache of {length:,} tokens, the "
            f"engine holds {engine.max_len:,}; load with max_len >= {length} (`eval ppl` sizes it "
            f"from {option('length')}) or use {option('length', engine.max_len)} or less"
        )


def _prefill_chunk(n: int, chunk: int = PREFILL_CHUNK) -> int:
    """A prefill chunk that leaves no one-token tail: a one-token call takes the decode path
    of the projections (sparse under a configuration), and the prefill must stay dense."""
    while n > chunk and n % chunk == 1:
        chunk -= 1
    return chunk


def decode_nll(engine, ids, windows: int = 8, length: int | None = None, config=None, *,
               thresholds=None, routing=None, scored: int = SCORED, progress: bool = False) -> WindowNLL:
    """Decode-position NLL of `windows` windows of `length` tokens (default: the engine's
    cache) under `config` (a `config.SparsityConfig`; None is dense; `thresholds`/`routing`:
    its calibrated artefacts, as `Engine.configure` takes them); see the module doc. The
    engine is left configured with `config`."""
    from sparsedecode.config import SparsityConfig

    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)  # (N,)
    length = engine.max_len if length is None else length
    check_decode_length(engine, length, scored)
    starts = decode_starts(ids.numel(), windows, length)
    config = config or SparsityConfig()
    th = resolve_projection(engine, config.projection, thresholds)
    if th is None:  # dense projections (keep 1 reads every row)
        engine.configure(config.with_(projection=None))
    else:
        engine.configure(config, thresholds=th, routing=routing)
    kv = config.kv
    n = length - scored  # dense prefill
    chunk = _prefill_chunk(n)
    bar = _token_bar(len(starts) * length, progress, "decode")
    out = []
    for i, s in enumerate(starts):
        bar.set_postfix_str(f"window {i + 1}/{len(starts)}", refresh=False)
        w = ids[s : s + length + 1].to(engine.device)  # (L+1,): the window and the next token
        engine.reset()
        engine.prefill(w[:n], chunk=chunk)  # from position 0: a previous selection is void
        bar.update(n)
        if kv is not None:
            engine.select_kv(kv.method, kv.keep, max_new=scored, **kv.params)
        # not inference_mode: a selection's buffers must stay ordinary tensors (kv.apply)
        with torch.no_grad():
            total = torch.zeros((), dtype=torch.float64, device=engine.device)
            for t in range(n, length):
                logits = engine.decode_step(w[t : t + 1])  # (V,): predicts w[t + 1]
                total += F.cross_entropy(logits[None].double(), w[t + 1 : t + 2], reduction="sum")
                bar.update(1)
        out.append(float(total))  # one host sync per window
    bar.close()
    engine.reset()
    return WindowNLL("decode", out, [scored] * len(starts), starts)


def evaluate(engine, ids, protocol: str, config=None, *, thresholds=None, routing=None, chunks: int = 128,
             windows: int = 8, length: int | None = None, scored: int = SCORED,
             progress: bool = False, counts: dict | None = None) -> WindowNLL:
    """Per-window NLL of `protocol` ('chunked' or 'decode') under `config` (None is dense;
    `thresholds`/`routing`: its calibrated artefacts). chunked: `counts` receives the channels
    the masks kept (`chunked_nll`)."""
    check_config(protocol, config)
    if protocol == "chunked":
        nll = chunked_nll(engine, ids, chunks, progress=progress, config=config, thresholds=thresholds,
                          routing=routing, counts=counts)
        return WindowNLL("chunked", nll, [CHUNK - DENSE] * chunks, [k * CHUNK for k in range(chunks)])
    return decode_nll(engine, ids, windows, length, config, thresholds=thresholds, routing=routing, scored=scored,
                      progress=progress)


__all__ = [
    "CHUNK", "DENSE", "PROTOCOLS", "SCORED", "WindowNLL", "check_config", "check_decode_length",
    "chunked_nll", "chunked_nll_many", "decode_nll", "decode_starts", "evaluate", "pooled_ppl", "resolve_projection",
    "resumable_chunked_nll",
]
