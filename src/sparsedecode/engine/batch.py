"""Batched decoding: B sequences in one decode step (ByteCross §3.3, §6, App. F; issue 44).

An engine loaded with `batch=B` holds a static cache of B rows, one per slot. A sequence is
prefilled into a free slot with the batch-1 prefill, unchanged, on that row's views
(`KVCache.slot`); where it asks for KV selection, its own selection follows at once, gathered
into its own region of per-slot compact buffers (ByteCross App. A, one region per sequence).
Then one decode step runs every live sequence: tokens (n, 1) at their own positions (n,), each
projection keeping every token's own channels and reading the weight once, in the rows of
their union (`SparseLinear._forward_rows`, the union u_B >= r_P of §3.3), each attention row
reading its own cache row or its own compact region (`models.attention.rows_attention`).
A sequence that finishes frees its slot; the next queued prompt is prefilled into it before
the next step (`BatchDecoder.run`).

On CPU the step runs the live sequences only (n of B), so the realized union counts no idle
slot and greedy batched decoding reproduces batch-1 decoding token for token. On CUDA the step
is captured in a CUDA graph over all B rows (a shape that never changes): an idle slot decodes
a pad token at position 0 of its own row, which no sequence reads, and its activations join
the union (the recorded `realized_union` says so, `BatchDecoder.idle_rows`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from sparsedecode.config import KVConfig, SparsityConfig
from sparsedecode.engine.generation import Generation
from sparsedecode.engine.sampling import check_sampling, sample
from sparsedecode.errors import InputError, option


@dataclass
class Request:
    """One sequence of a batch: its prompt ids and how to decode it. `kv`: its KV selection
    (a `config.KVConfig`; None: it reads its whole cache)."""

    ids: list[int]
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: Sequence[int] | None = None
    kv: KVConfig | None = None

    def __post_init__(self):
        check_sampling(self.temperature, self.top_p, self.seed)
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 0:
            raise InputError(f"{option('max_new_tokens')} must be a whole number >= 0, got {self.max_new_tokens}")
        if not self.ids:
            raise InputError("empty prompt: give at least one token")
        if self.kv is not None and not isinstance(self.kv, KVConfig):
            raise InputError(f"a request's kv takes a KVConfig or None, got {type(self.kv).__name__}")
        if self.kv is not None and self.kv.method == "window" and self.kv.keep < 1.0:
            raise InputError("window selection in a decode batch is not built: give the batch a scored selector "
                             "(snapkv, sel0.3) or decode with batch=1")


@dataclass
class _Slot:
    index: object  # names the request: its place in the caller's order, or a server's job
    req: Request
    out: Generation
    gen: torch.Generator | None
    stop: set
    pos: int  # tokens in the slot's cache: the next step writes here
    last: int  # the token the next step feeds
    t0: float = 0.0  # when its decoding started (after its prefill)


def as_kv(kv) -> KVConfig | None:
    """A request's KV selection from a KVConfig, None, or text such as 'sel0.3' or
    'snapkv[keep=0.3]' ('dense': none)."""
    if kv is None or isinstance(kv, KVConfig):
        return kv
    if isinstance(kv, str):
        cfg = SparsityConfig.parse(kv)
        if cfg.projection is not None or cfg.adapter is not None:
            raise InputError(f"a request's kv {kv!r} names a projection or adapter too: the projection keep "
                             "applies to the whole batch (Engine.configure); give the KV part only, e.g. sel0.3")
        return cfg.kv
    raise InputError(f"a request's kv takes a KVConfig, text such as 'sel0.3', or None; got {type(kv).__name__}")


class BatchDecoder:
    """The slots of an engine loaded with batch=B (`sparsedecode.load(..., batch=B)`); see the
    module doc. `Engine.generate_batch` builds one and runs its prompts."""

    def __init__(self, engine):
        self.engine = engine
        self.B = engine.batch
        dev = engine.device
        self.slots: list[_Slot | None] = [None] * self.B
        self.caches = [layer.self_attn.cache for layer in engine.model.layers]  # the full (B-row) caches
        self.generations: dict = {}  # request index -> its Generation (admit_chunks)
        self._tok = torch.zeros(self.B, 1, dtype=torch.long, device=dev)  # (B, 1) static inputs
        self._pos = torch.zeros(self.B, dtype=torch.long, device=dev)  # (B,)
        self._graph = None
        self._graph_out = None
        self._graph_key = None
        self.steps = 0  # decode steps run
        self.occupancy = 0  # live sequences summed over steps (occupancy / steps: the mean batch)
        self.idle_rows = 0  # idle slots that a captured step ran anyway, summed over steps

    # -- slots ------------------------------------------------------------------------------
    def _layers(self):
        return [layer.self_attn for layer in self.engine.model.layers]

    def _rows_state(self, need: int):
        """The per-slot compact buffers (B, Hkv, >= need, D) per layer and their (B,) offsets and
        selected flags, grown (entries kept) where a selection needs more room."""
        caches = self.caches
        have = caches[0].rows
        if have is not None and have[0].shape[2] >= need:
            return have
        k = caches[0].k
        B, Hkv, _, D = k.shape
        cap = 1 << max(need - 1, 1).bit_length()  # room grows by powers of two: few regrowths
        offset = torch.zeros(B, dtype=torch.long, device=k.device) if have is None else have[2]
        sel = torch.zeros(B, dtype=torch.bool, device=k.device) if have is None else have[3]
        for c in caches:
            ck, cv = k.new_zeros(B, Hkv, cap, D), k.new_zeros(B, Hkv, cap, D)
            if c.rows is not None:
                old = c.rows[0].shape[2]
                ck[:, :, :old] = c.rows[0]
                cv[:, :, :old] = c.rows[1]
            c.rows = (ck, cv, offset, sel)
        self._graph = None  # the step reads other buffers now
        return caches[0].rows

    def _select(self, b: int, kv: KVConfig, max_new: int, n: int) -> float:
        """Slot b's KV selection after its prefill of n tokens (run with its cache views in
        place): each layer's kept entries gathered into the slot's compact region. Seconds."""
        from sparsedecode.kv.apply import observation_queries
        from sparsedecode.kv.select import get_selector

        eng = self.engine
        selector = get_selector(kv.method, **kv.params)
        sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        budget = selector.budget(n, kv.keep, max_new)
        queries, _ = observation_queries(eng, selector.window)
        views = [a.cache for a in self._layers()]  # the slot's views, in place during its prefill
        _, _, offset, sel = self._rows_state(budget + max_new)
        with torch.no_grad():
            for view, full, q_obs in zip(views, self.caches, queries, strict=True):
                idx = selector.select(q_obs, view.k, n, kv.keep, max_new)  # (1, Hkv, budget)
                ck, cv = full.rows[0], full.rows[1]
                selector.gather(view.k, view.v, idx, check=False, out=(ck[b:b + 1], cv[b:b + 1]))
        offset[b] = n - budget  # slot = position - offset
        sel[b] = True
        sync()
        return time.perf_counter() - t0

    def _check(self, req: Request) -> None:
        """Refuse a request whose prompt and answer do not fit a slot's cache."""
        n = len(req.ids)
        self.engine._check_len(n + req.max_new_tokens, f"the prompt ({n}) plus {req.max_new_tokens} new tokens")

    @contextmanager
    def _on_slot(self, b: int):
        """Every layer reads and writes slot b's rows as a batch-1 cache (`KVCache.slot`)."""
        attn = self._layers()
        for a, c in zip(attn, self.caches, strict=True):
            a.cache = c.slot(b)
        self.engine._slot = b
        try:
            yield
        finally:
            for a, c in zip(attn, self.caches, strict=True):
                a.cache = c
            self.engine._slot = None

    def admit_chunks(self, b: int, index, req: Request, chunk: int = 512) -> Iterator[None]:
        """Prefill `req` into free slot b one chunk of `chunk` tokens at a time, yielding between
        chunks (a server runs decode steps of the other slots there, so a long prompt stalls them
        by one chunk at most); then its KV selection, where it asks for one, and its first token,
        sampled from the prefill. The slot then decodes with the others, or, where the request is
        done already (max_new_tokens 0 or 1, or its first token stops it), stays free.
        `index` names the request in `generations` and in `decode`'s events. Admit one request at
        a time: the prefill keeps its observation window in the layers until the selection."""
        eng = self.engine
        if self.slots[b] is not None:
            raise InputError(f"slot {b} holds a sequence: admit into a free slot")
        ids = eng._as_ids(req.ids)
        n = ids.numel()
        self._check(req)
        out = Generation(prompt_ids=[int(t) for t in req.ids])
        slot = _Slot(index, req, out, None, set(eng.eos_ids if req.stop_ids is None else req.stop_ids), n, 0)
        self.generations[index] = out
        if req.max_new_tokens == 0:
            self._finish_out(out)
            return
        if req.seed is not None:
            slot.gen = torch.Generator(eng.device).manual_seed(req.seed)
        rows = self.caches[0].rows
        if rows is not None:
            rows[3][b] = False  # the slot's last sequence may have selected
        spent = 0.0
        for s in range(0, n, chunk):
            t0 = time.perf_counter()
            with self._on_slot(b):
                logits = eng.prefill(ids[s:s + chunk], chunk=chunk, start=s)
            spent += time.perf_counter() - t0
            if s + chunk < n:
                yield
        t0 = time.perf_counter()
        with self._on_slot(b):
            slot.last = int(sample(logits, req.temperature, req.top_p, slot.gen))
            if req.kv is not None and req.kv.keep < 1.0:
                out.kv_select_s = self._select(b, req.kv, req.max_new_tokens, n)
        out.prefill_s = spent + time.perf_counter() - t0 - out.kv_select_s
        out.ids.append(slot.last)
        slot.t0 = time.perf_counter()
        if slot.last in slot.stop or req.max_new_tokens == 1:
            out.stopped_at_eos = slot.last in slot.stop
            self._finish_out(out)
            return
        self.slots[b] = slot

    def admit(self, b: int, index, req: Request, chunk: int = 512) -> Generation:
        """`admit_chunks` run to its end; the request's `Generation` (its first token in)."""
        for _ in self.admit_chunks(b, index, req, chunk):
            pass
        return self.generations[index]

    def free(self, b: int) -> None:
        """Slot b holds no sequence any more: it reads nothing and the next prompt may use it."""
        self.slots[b] = None
        rows = self.caches[0].rows
        if rows is not None:
            rows[3][b] = False

    # -- the step -----------------------------------------------------------------------------
    def live(self) -> list[int]:
        return [b for b, s in enumerate(self.slots) if s is not None]

    @torch.inference_mode()
    def step(self) -> dict[int, torch.Tensor]:
        """One decode step of every live slot: {slot: float32 logits (V,)}."""
        eng, live = self.engine, self.live()
        if not live:
            return {}
        for b in live:
            s = self.slots[b]
            if s.pos >= eng.max_len:
                raise InputError(f"the cache of {eng.max_len} tokens is full")
        self.steps += 1
        self.occupancy += len(live)
        if eng.device.type != "cuda":  # eager: the live rows only
            idx = torch.tensor(live, dtype=torch.long, device=eng.device)
            tok = torch.tensor([[self.slots[b].last] for b in live], dtype=torch.long, device=eng.device)
            pos = torch.tensor([self.slots[b].pos for b in live], dtype=torch.long, device=eng.device)
            logits = eng.model(tok, pos, None, slots=idx)[:, -1].float()  # (n, V)
            return {b: logits[i] for i, b in enumerate(live)}
        self.idle_rows += self.B - len(live)
        tok = [s.last if s is not None else 0 for s in self.slots]
        pos = [s.pos if s is not None else 0 for s in self.slots]
        self._tok.copy_(torch.tensor(tok, dtype=torch.long).view(-1, 1), non_blocking=True)
        self._pos.copy_(torch.tensor(pos, dtype=torch.long), non_blocking=True)
        out = self._replay()
        return {b: out[b] for b in live}

    def _forward(self) -> torch.Tensor:
        return self.engine.model(self._tok, self._pos, None)[:, -1].float()  # (B, V)

    def _replay(self) -> torch.Tensor:
        rows = self.caches[0].rows
        key = (self.engine._step_key()[0], None if rows is None else id(rows[0]))
        if self._graph is None or key != self._graph_key:
            t0 = time.perf_counter()
            side = torch.cuda.Stream(self.engine.device)
            side.wait_stream(torch.cuda.current_stream(self.engine.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-ups: Triton compiles and autotunes outside the capture
                    self._forward()
            torch.cuda.current_stream(self.engine.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._graph_out = self._forward()
            self._graph, self._graph_key = graph, key
            torch.cuda.current_stream(self.engine.device).synchronize()
            self.engine.compile_s += time.perf_counter() - t0
        self._graph.replay()
        return self._graph_out

    def decode(self) -> list[tuple[object, int, bool]]:
        """One decode step of every live slot and each one's next token sampled: [(index, token,
        done)] in slot order; a sequence done (EOS, a stop id, max_new_tokens) frees its slot."""
        logits = self.step()
        if not logits:
            return []
        picks = {b: sample(lg, self.slots[b].req.temperature, self.slots[b].req.top_p, self.slots[b].gen)
                 for b, lg in logits.items()}
        host = torch.cat(list(picks.values())).tolist()  # one sync for the batch's tokens
        now, events = time.perf_counter(), []
        for b, tok in zip(picks, host, strict=True):
            s = self.slots[b]
            s.pos += 1
            s.last = int(tok)
            s.out.ids.append(s.last)
            s.out.decode_s = now - s.t0
            done = s.last in s.stop or len(s.out.ids) >= s.req.max_new_tokens
            if done:
                s.out.stopped_at_eos = s.last in s.stop
                self._finish_out(s.out)
                self.free(b)
            events.append((s.index, s.last, done))
        return events

    def slot_of(self, index) -> int | None:
        """The slot decoding request `index` (None: not in a slot)."""
        return next((b for b, s in enumerate(self.slots) if s is not None and s.index == index), None)

    def free_slot(self) -> int | None:
        return next((b for b, s in enumerate(self.slots) if s is None), None)

    # -- a whole run --------------------------------------------------------------------------
    def run(self, requests: Sequence[Request], on_token: Callable[[int, int], None] | None = None,
            chunk: int = 512) -> list[Generation]:
        """Decode every request, at most B at a time, in one batch: queued requests wait for a
        free slot, which the next one takes before the next step. `on_token(index, token)` is
        called for each new token. Returns one `Generation` per request, in order."""
        for r in requests:  # every request checked before any is admitted: a bad one leaves no slot taken
            self._check(r)
        self.generations = {}
        queue = deque(enumerate(requests))
        try:
            while queue or self.live():
                b = self.free_slot()
                while b is not None and queue:
                    i, req = queue.popleft()
                    out = self.admit(b, i, req, chunk)
                    if on_token is not None and out.ids:
                        on_token(i, out.ids[0])
                    b = self.free_slot()
                for i, tok, _ in self.decode():
                    if on_token is not None:
                        on_token(i, tok)
        except BaseException:  # interrupted or refused mid-run: no sequence stays in a slot
            for b in self.live():
                self.free(b)
            raise
        return [self.generations[i] for i in range(len(requests))]

    def _finish_out(self, out: Generation) -> None:
        tok = self.engine.tokenizer
        if tok is not None:
            out.text = tok.decode(out.ids, skip_special_tokens=True)


__all__ = ["BatchDecoder", "Request", "as_kv"]
