"""KV selection applied to an engine after its dense prefill (ByteCross §4.1, App. A, App. G).

`select_kv(engine, method, keep, max_new)` runs once per prompt, after the
prefill of n tokens:

- scored methods (snapkv) score with each layer's post-RoPE queries (B, Hq, W, D)
  of the last W prompt tokens, the observation window. The prefill keeps its last
  64 per layer (SnapKV scores with the prefill's own queries), so the usual window
  costs nothing; a wider one re-runs the last W prompt tokens through the model,
  attending to the cache as prefilled, which it leaves bit for bit (rewriting its
  keys from a W-row GEMM would round differently on CUDA than the prefill's n-row
  one, and decoding would read keys it never scored);
- each layer's selector picks round(keep x n) - max_new positions per KV head
  and the kept keys and values are gathered once into a contiguous buffer with
  room for the max_new generated tokens; every decode step then appends its own
  entry there and reads the buffer through the same attention backend, while
  the full cache keeps receiving every entry (so a new turn can be rescored).
  The buffers stay with the engine: a later selection that fits them reuses
  them, so a captured decode step replays without being captured again;
- `window` reads the cache in place instead: the first `sinks` entries and the
  most recent ones, two split-K calls merged by log-sum-exp, no copy. It reads
  round(keep x n) entries at every step, which is what the selection reads at
  its last generated token.

keep 1.0 keeps everything: decoding reads the full cache exactly as dense.
The one-time cost (observation pass, scoring and gather) is timed, with a
device synchronisation, and returned, split into its phases by device events
(no synchronisation between them), so a record says where it went.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from sparsedecode.account.units import check_keep
from sparsedecode.errors import InputError
from sparsedecode.kv.select import get_selector


@dataclass
class KVSelection:
    """What `select_kv` did: method, keep, prompt length n, entries kept per KV head
    (the budget; n at keep 1.0), the tokens it left room for, its one-time cost and the
    selector's fields."""

    method: str
    keep: float
    n: int
    budget: int
    max_new: int
    select_s: float
    params: dict = field(default_factory=dict)  # the selector's fields as given
    # Seconds of the selection by phase, from device events: 'observe' (the observation pass),
    # 'buffers' (finding or allocating the compact buffers), 'score' (scoring and top-k, all
    # layers), 'gather' (copies into the compact buffers); empty where nothing was scored.
    phases: dict = field(default_factory=dict)
    # Where a scored selection's observation queries came from: 'prefill' (kept by it) or
    # 're-run' (a window wider than the prefill kept); None where nothing was scored.
    observed: str | None = None
    # With select_kv(indices=True), a scored selection's kept positions, one (B, Hkv, budget)
    # int64 tensor per layer on the CPU (for diagnostics such as which needle tokens it kept).
    kept: list | None = field(default=None, repr=False)

    @property
    def mode(self) -> str:
        return "dense" if self.keep >= 1.0 else "window" if self.method == "window" else "sel"


class _Phases:
    """Device-side stopwatch: marks between phases, read once after the final synchronisation
    (CUDA events on a GPU, the host clock elsewhere, where work runs as it is issued)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []
        self.mark("start")

    def mark(self, name: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((name, ev))
        else:
            self.marks.append((name, time.perf_counter()))

    def seconds(self) -> dict:
        """Seconds per phase name, summed over its intervals (each mark closes the one before)."""
        out: dict = {}
        for (_, a), (name, b) in zip(self.marks, self.marks[1:], strict=False):
            dt = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            out[name] = out.get(name, 0.0) + dt
        return out


def observation_queries(engine, window: int) -> tuple[list[torch.Tensor], str]:
    """Post-RoPE queries (B, Hq, W, D) of each layer for the last W = min(window, n) cached
    prompt tokens, and where they came from: 'prefill', the queries the prefill computed and
    kept (its last RECENT_QUERIES per layer; SnapKV scores with the prefill's own queries), or
    're-run', the window run again over the cache as prefilled (which it does not write), where
    the window is wider than what the prefill kept."""
    n = engine.pos
    w = min(window, n)
    attn = [layer.self_attn for layer in engine.model.layers]
    kept = [a.recent for a in attn]
    if all(r is not None and r[1] == n and r[0].shape[2] >= w for r in kept):
        return [r[0][:, :, r[0].shape[2] - w:] for r in kept], "prefill"
    ids, start = engine.last_prefill  # (L,) ids the last prefill put at positions [start, start + L)
    if ids is None or start + ids.numel() != n or ids.numel() < w:
        raise InputError(
            f"the observation window is the last {w} prompt tokens, and the last prefill did not end "
            f"at the cache's {n} tokens with at least that many: prefill the prompt right before selecting"
        )
    for a in attn:
        a.observe = []
    try:
        pos = torch.arange(n - w, n, device=engine.device)  # (W,)
        with torch.inference_mode():
            engine.model(ids[ids.numel() - w:][None], pos, n - w)
        return [a.observe[0] for a in attn], "re-run"
    finally:
        for a in attn:
            a.observe = None


def clear_kv(engine) -> None:
    """Decode reads the full cache again (dense attention); `Engine.clear_kv` forgets the selection."""
    for layer in engine.model.layers:
        layer.self_attn.cache.read_compact(None)
    engine.invalidate_step()


def select_kv(engine, method: str, keep: float, max_new: int, indices: bool = False,
              **params) -> KVSelection:
    """Select the KV entries decoding reads for the next max_new tokens; see the module doc.
    indices: also return a scored selection's kept positions per layer (`KVSelection.kept`)."""
    check_keep(keep, "kv keep")
    if max_new < 0:
        raise InputError(f"max_new must be >= 0, got {max_new}")
    n = engine.pos
    if n < 1:
        raise InputError("select_kv runs after the prefill: prefill a prompt first")
    if n + max_new > engine.max_len:
        raise InputError(f"{n} cached tokens plus {max_new} new exceed the cache of {engine.max_len}")
    selector = get_selector(method, **params)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    phases = _Phases(engine.device)
    recapture = True
    kept, observed = None, None
    if keep >= 1.0:
        clear_kv(engine)
        budget = n
    else:
        budget = selector.budget(n, keep, max_new)
        caches = [layer.self_attn.cache for layer in engine.model.layers]
        if method == "window":
            clear_kv(engine)
            sinks = min(selector.sinks, budget)
            for cache in caches:  # round(keep x n) entries per step: budget + the room for new ones
                cache.read_window(sinks, budget - sinks + max_new)
        else:
            queries, observed = observation_queries(engine, selector.window)
            phases.mark("observe")
            bufs, offset, recapture = engine.compact_buffers(budget + max_new)
            phases.mark("buffers")
            kept = [] if indices else None
            with torch.no_grad():  # not inference_mode: the step writes these buffers in place
                for cache, q_obs, (k_buf, v_buf) in zip(caches, queries, bufs, strict=True):
                    idx = selector.select(q_obs, cache.k, n, keep, max_new)  # (B, Hkv, budget)
                    phases.mark("score")
                    if kept is not None:
                        kept.append(idx.cpu())
                    selector.gather(cache.k, cache.v, idx, check=False, out=(k_buf, v_buf))  # one copy
                    phases.mark("gather")
                    cache.read_compact(k_buf, v_buf, offset, host_offset=n - budget)
            offset.fill_(n - budget)  # (1,): slot = position - offset
    sync()
    sel = KVSelection(method, keep, n, budget, max_new, time.perf_counter() - t0, dict(params),
                      phases.seconds(), observed, kept)
    if recapture:
        engine.invalidate_step()  # the decode step reads other buffers now
    return sel


WARM_KEYS = 8192  # keys of the load-time warm-up: past 4,096, where torch.sort leaves its small-segment path


def warm_selection(engine) -> float:
    """Pay at load what a CUDA process's first scored selection would pay (issue 26, item 4):
    Triton's one-time setup (it hashes its own library for the cache key: about 0.35 s on the
    H200) and the first launch of the score, sort and gather kernels (CUDA loads kernels lazily).
    Runs SnapKV's select and gather on random queries and keys of the model's shapes; touches no
    cache and no state of `engine`. Seconds taken; 0.0 off CUDA, where nothing is compiled."""
    if engine.device.type != "cuda":
        return 0.0
    a = engine.args
    t0 = time.perf_counter()
    selector = get_selector("snapkv")
    gen = torch.Generator(engine.device).manual_seed(0)
    q = torch.randn(1, a.n_heads, selector.window, a.head_dim, device=engine.device, dtype=engine.dtype,
                    generator=gen)  # (B, Hq, W, D)
    k, v = (torch.randn(1, a.n_kv_heads, WARM_KEYS, a.head_dim, device=engine.device, dtype=engine.dtype,
                        generator=gen) for _ in range(2))  # (B, Hkv, T, D)
    with torch.no_grad():
        idx = selector.select(q, k, WARM_KEYS, 0.3, 0)
        selector.gather(k, v, idx, check=False)
    torch.cuda.synchronize(engine.device)
    return time.perf_counter() - t0


__all__ = ["KVSelection", "WARM_KEYS", "clear_kv", "observation_queries", "select_kv", "warm_selection"]
