"""The decode loop: chunked prefill, a captured decode step, sampling and generation.

Protocol of ByteCross App. A: allocate the cache once for prompt + generated
tokens, prefill densely in chunks of 512 (causal SDPA over the cached prefix),
then decode one token per step. On CUDA the step (the whole model forward of
one token plus the float32 cast of its logits) is optionally compiled with
torch.compile and then captured in a CUDA graph. Its inputs are two static
device tensors, the token id and the position, updated in place before each
replay, so nothing inside the step waits on the host; the host only reads
the sampled token afterwards, to stream it and to stop at EOS. On CPU the
same step runs eagerly. The sdpa_fused path slices the cache on the host: its
step also takes the valid length as a Python int, compiled as a dynamic size
(one graph for every length), and runs without a CUDA graph, whose shapes are fixed.
With token routing (SATS paper §3.2, `Engine.route`) the step first looks its
token id up in a device table to pick the dense or the CATS MLP path, inside
the same captured step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import torch

from sparsedecode.config import SparsityConfig
from sparsedecode.engine.batch import BatchDecoder
from sparsedecode.engine.branches import Branches
from sparsedecode.engine.device import (
    dict_tag_guards_off,
    use_compile_cache,
)
from sparsedecode.engine.generation import Generation, HostToken, encode
from sparsedecode.engine.sampling import check_sampling, sample
from sparsedecode.errors import InputError, option
from sparsedecode.kernels.options import GemvOptions, KernelOptions

DEFAULT_MAX_LEN = 4096


class Engine(Branches):
    """A loaded model with its static cache of `batch` rows (1: one sequence; B > 1: a decode
    batch, `generate_batch`, engine/batch.py). Build it with `load`."""

    def __init__(self, model, args, *, tokenizer, source_path, device, dtype, attention,
                 name, init, eos_ids=(), compile: bool | str | None = None, kernels=None):
        self.model, self.args = model, args
        self.dims = args.dims()
        self.tokenizer = tokenizer
        self.source_path = source_path
        self.device, self.dtype = device, dtype
        self.attention = attention
        self.name, self.init = name, init
        self.max_len = model.max_len
        self.batch = model.layers[0].self_attn.cache.k.shape[0]  # cache rows: sequences decoded at once
        self._slot: int | None = None  # the batch row a batch-1 call runs on (engine/batch.py)
        self.eos_ids = tuple(dict.fromkeys(int(e) for e in eos_ids))
        self.pos = 0  # tokens in the cache (host copy; the step reads `_pos`)
        self._tok = torch.zeros(1, 1, dtype=torch.long, device=device)  # (1, 1) static input
        self._pos = torch.zeros(1, dtype=torch.long, device=device)  # (1,) static input
        use_cuda = device.type == "cuda"
        # compile: None (on for CUDA), a bool, or a torch.compile mode such as
        # "max-autotune-no-cudagraphs" (we capture the graph ourselves either way).
        self.compile_mode = compile if isinstance(compile, str) else None
        self.compile = (use_cuda if compile is None else bool(compile)) and compile is not False
        self.host_len = attention == "sdpa_fused"  # the step slices on the host: pass the length
        self.cuda_graph = use_cuda and not self.host_len
        self._step_fn = self._decode_forward
        self.compile_s = 0.0  # seconds this engine spent compiling and capturing decode steps
        self.capture_phases: dict[str, float] = {}  # of the last capture (`_capture`)
        self.load_phases: dict[str, float] = {}  # where `load` spent its time (engine/loader.py)
        self.compile_cache = use_compile_cache() if self.compile else None
        if self.compile:
            # dynamic=None: the host length is specialized on the first call and traced as a
            # dynamic size from the second on; every tensor shape stays static.
            dict_tag_guards_off()
            self._step_fn = torch.compile(
                self._decode_forward, fullgraph=True, dynamic=None if self.host_len else False,
                mode=self.compile_mode,
            )
        self._graph = None
        self._graph_out = None
        # With keep_graphs (the runtime gate turns it on), a captured step is kept per state of
        # what it reads (`_step_key`) and replayed when that state returns, so switching
        # configurations between requests captures each one once.
        self.keep_graphs = False
        self._graphs: dict[tuple, tuple] = {}
        self._kv_buffers: list | None = None  # the KV selection's compact buffers (compact_buffers)
        self._kv_offset: torch.Tensor | None = None
        self._layouts: dict | None = None  # keep_states: projection-module layouts by their sites
        self.config = SparsityConfig()  # what `configure` installed last
        self.adapter = None  # a projection.lora.Adapter loaded with the model, merged or apart (fixed for life)
        self.thresholds = None  # set by sparsify
        self.kv = None  # a kv.apply.KVSelection while decoding reads selected entries
        self.kv_config = None  # a config.KVConfig: selected after every prompt's prefill
        self.router = None  # a cats_runtime.Router while decode steps are routed (route)
        self.routing = None  # its projection.routing.RoutingTable
        self.last_prefill: tuple[torch.Tensor | None, int] = (None, 0)  # (ids (L,), start)
        self.kernels = KernelOptions(GemvOptions(dense=False))  # what every kernel launches with, resolved
        self.kernels_asked = KernelOptions()  # as given (set_kernels); gemv.dense None: see _resolved
        self.linear_needed_by: str | None = None  # what installed needs nn.Linear modules (CATS, the gate)
        # the C decode step's plan for what the step reads now (engine.cpu_step.plan): (key, CpuStep or
        # None, why not), and whether the last step ran it
        self._cpu_plan: tuple | None = None
        self.ran_cpu_step = False
        self.set_kernels(kernels if kernels is not None else KernelOptions())
        # the slots of a decode batch (engine/batch.py); None for one sequence
        self._batch_decoder = BatchDecoder(self) if self.batch > 1 else None

    # -- the model calls ----------------------------------------------------
    def _decode_forward(self, host_len: int | None = None) -> torch.Tensor:
        if self.router is not None:
            self.router.step()  # this token's path, read by every CatsMLP (a device lookup)
        # resolved: a CPU engine of batch 1, uncompiled, the C step built (_resolved); a step traced by
        # hand stays PyTorch's
        if self.kernels.cpu.step and not torch.compiler.is_compiling():
            step = self._cpu_step()
            self.ran_cpu_step = step is not None
            if step is not None:
                return step(int(self._tok), int(self._pos))
        return self.model(self._tok, self._pos, None, host_len)[0, -1].float()  # (V,)

    def _cpu_step(self):
        """The C step for the decode step as it stands (engine.cpu_step), or None where it cannot
        run it: then the PyTorch step runs, or, where cpu.step=true was asked for, the step is
        refused with the reason."""
        from sparsedecode.engine import cpu_step

        self._cpu_plan = cpu_step.plan(self, self._cpu_plan)
        if self._cpu_plan[1] is None and self.kernels_asked.cpu.step:
            raise InputError(f"cpu.step=true, and the C step cannot run this decode step: {self._cpu_plan[2]}; "
                             "drop cpu.step=true (the default runs the PyTorch step here by itself)")
        return self._cpu_plan[1]

    @property
    def step_runtime(self) -> str:
        """What ran the last decode step, for users and records: 'CUDA graph', 'compiled', 'C step'
        (kernels/cpu_step.c) or 'eager' (then `cpu_step_refusal` says why not the C step)."""
        if self.cuda_graph:
            return "CUDA graph"
        if self.compile:
            return "compiled"
        return "C step" if self.ran_cpu_step else "eager"

    @property
    def cpu_step_refusal(self) -> str | None:
        """Why the C step did not run the last decode step, where cpu.step is on (None: it ran,
        or it is off)."""
        if not self.kernels.cpu.step or self.ran_cpu_step or self._cpu_plan is None:
            return None
        return self._cpu_plan[2]

    def _check_len(self, n: int, what: str) -> None:
        window = self.args.max_position
        if n > window:
            raise InputError(
                f"{what} of {n} tokens exceeds the model window of {window} tokens; "
                "shorten the prompt or the number of new tokens"
            )
        if n > self.max_len:
            raise InputError(
                f"{what} of {n} tokens exceeds the allocated cache of {self.max_len} tokens "
                f"(model window {window}); load with a larger {option('max_len')} (up to {window}) "
                "or shorten the prompt"
            )

    def _one_sequence(self, what: str) -> None:
        """Refuse a batch-1 call on an engine of B > 1 cache rows, outside a slot's prefill."""
        if self.batch > 1 and self._slot is None:
            raise InputError(f"{what} runs one sequence, and this engine was loaded with {option('batch', self.batch)}: "
                             "decode with generate_batch, or load with batch=1")

    def _as_ids(self, ids) -> torch.Tensor:
        t = torch.as_tensor(ids, dtype=torch.long).reshape(-1).to(self.device)  # (L,)
        if t.numel() == 0:
            raise InputError("empty prompt: give at least one token")
        return t

    @torch.inference_mode()
    def prefill(self, ids, chunk: int = 512, *, start: int = 0, all_logits: bool = False):
        """Run ids (L,) through the model at positions [start, start+L) in chunks of `chunk`.

        Returns the float32 logits of the last position (V,), or of every
        position (L, V) with all_logits. The cache then holds start+L tokens.
        """
        self._one_sequence("prefill")
        ids = self._as_ids(ids)
        if chunk < 1:
            raise InputError(f"prefill chunk must be >= 1, got {chunk}")
        L = ids.numel()
        self._check_len(start + L, "the prompt")
        if start == 0 and any(layer.self_attn.cache.compact is not None or layer.self_attn.cache.window
                              is not None for layer in self.model.layers):  # a new prompt: selection void
            self.clear_kv()
        outs = []
        for s in range(0, L, chunk):
            piece = ids[s : s + chunk]  # (l,)
            p0 = start + s
            pos = torch.arange(p0, p0 + piece.numel(), device=self.device)  # (l,)
            logits = self.model(piece[None], pos, p0, last=not all_logits)[0]  # (l, V), or (1, V)
            outs.append(logits.float() if all_logits else logits[-1:].float())
        self.pos = start + L
        self.last_prefill = (ids, start)
        return torch.cat(outs) if all_logits else outs[-1][0]

    def forward_logits(self, ids, chunk: int = 512) -> torch.Tensor:
        """Float32 logits (L, V) of every position of ids (L,), starting from an empty cache."""
        return self.prefill(ids, chunk=chunk, all_logits=True)

    @torch.inference_mode()
    def decode_step(self, token) -> torch.Tensor:
        """Feed one token (int or (1,) device tensor) at the next position; return its
        float32 logits (V,). On CUDA the result is the graph's static output buffer, and on CPU
        the C step's (engine.cpu_step): read it before the next step."""
        self._one_sequence("decode_step")
        if self.pos >= self.max_len:
            raise InputError(
                f"the cache of {self.max_len} tokens is full; load with a larger {option('max_len')} "
                f"(model window {self.args.max_position})"
            )
        if isinstance(token, torch.Tensor):
            self._tok.copy_(token.reshape(1, 1))
        else:
            self._tok.fill_(int(token))
        self._pos.fill_(self.pos)
        out = self.decode_replay()
        self.pos += 1
        return out

    def seek(self, pos: int, token: int | None = None) -> None:
        """Put the next decode step at position `pos` (the cache holding `pos` tokens), with
        `token` as its input when given: how a harness steps from a filled cache."""
        if not 0 <= pos < self.max_len:
            raise InputError(f"position {pos} is outside the cache of {self.max_len} tokens")
        self.pos = int(pos)
        self._pos.fill_(self.pos)
        if token is not None:
            self._tok.fill_(int(token))

    def rewind(self, ids) -> None:
        """Back to the end of the prompt `ids` (a prefix of what the cache holds, prefilled from
        position 0): the next step or selection reads the cache as if only `ids` were there."""
        ids = self._as_ids(ids)
        self.seek(ids.numel())
        self.last_prefill = (ids, 0)

    def eager_step(self) -> torch.Tensor:
        """The model once on the static token and position, outside any captured graph, so
        that counters (the realized keep) see it; writes the cache slot at `pos`. Logits (1, 1, V)."""
        with torch.inference_mode():
            return self.model(self._tok, self._pos, None)

    def compact_buffers(self, need: int) -> tuple[list, torch.Tensor, bool]:
        """The KV selection's compact buffers: per layer a (k, v) pair of at least `need` slots
        (B, Hkv, slots, D), the offset tensor the step reads (slot = position - offset), and
        whether the step must read them anew (just allocated, or not read before). Buffers
        that fit are reused, so a captured step replays as is: only entries and offset change."""
        caches = [layer.self_attn.cache for layer in self.model.layers]
        bufs = self._kv_buffers
        reading = bufs is not None and all(
            c.compact is not None and c.compact[0] is b[0] for c, b in zip(caches, bufs, strict=True))
        if bufs is not None and bufs[0][0].shape[2] >= need:
            return bufs, self._kv_offset, not reading
        k = caches[0].k
        B, Hkv, _, D = k.shape
        self._kv_buffers = [(k.new_zeros(B, Hkv, need, D), k.new_zeros(B, Hkv, need, D)) for _ in caches]
        self._kv_offset = torch.zeros(1, dtype=torch.long, device=k.device)  # (1,)
        return self._kv_buffers, self._kv_offset, True

    @property
    def graphs(self) -> int:
        """Captured decode steps held: the current one, or with keep_graphs every kept one."""
        return len(self._graphs) if self.keep_graphs else int(self._graph is not None)

    def invalidate_step(self) -> None:
        """What the decode step reads has changed (modules, buffers, bounds): the next step
        replays the graph kept for the new state (`keep_graphs`) or captures one."""
        self._graph = None

    def decode_replay(self) -> torch.Tensor:
        """Run the decode step on the current static token and position (the timed unit)."""
        if not self.cuda_graph:
            return self._step_fn(self.pos + 1) if self.host_len else self._step_fn()
        if self._graph is None:
            key, refs = self._step_key() if self.keep_graphs else (None, None)
            hit = self._graphs.get(key) if key is not None else None
            if hit is not None:
                self._graph, self._graph_out = hit[0], hit[1]
            else:
                self._capture()
                if key is not None:
                    self._graphs[key] = (self._graph, self._graph_out, refs)
        self._graph.replay()
        return self._graph_out

    _STEP_ATTRS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv", "gate_proj", "up_proj", "down_proj",
                   "gate_up")

    def _step_key(self) -> tuple[tuple, list]:
        """What a captured decode step reads, as ids, and the objects behind them: each layer's
        MLP and projection modules, the cache it attends over (the compact buffer of a selection
        or a window's bounds) and the router. The kept graph holds the objects, so their ids
        stay theirs."""
        refs, key = [], []
        for layer in self.model.layers:
            a, m = layer.self_attn, layer.mlp
            mods = [m] + [getattr(p, n, None) for p in (a, m) for n in self._STEP_ATTRS]
            compact = a.cache.compact[0] if a.cache.compact is not None else None
            refs += mods + [compact]
            key.append((tuple((id(x), getattr(x, "track", None)) for x in mods), id(compact), a.cache.window))
        refs.append(self.router)
        key.append(id(self.router))
        return tuple(key), refs

    def _capture(self) -> None:
        # Warm-up on a side stream (compiles, autotunes, allocates), then capture.
        # The warm-ups rewrite the cache slot at `_pos`, which the real step rewrites too.
        t0 = time.perf_counter()
        counts = None if self.router is None else self.router.counts.clone()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        marks = []
        with torch.cuda.stream(side):
            for _ in range(3):
                self._step_fn()
                side.synchronize()
                marks.append(time.perf_counter())
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._graph_out = self._step_fn()
        self._graph = graph
        if counts is not None:  # the warm-ups are not decode steps
            self.router.counts.copy_(counts)
        torch.cuda.current_stream(self.device).synchronize()
        end = time.perf_counter()
        # where the last capture went: the first call compiles (or loads the compile caches)
        self.capture_phases = {"first_call_s": marks[0] - t0, "warmup_s": marks[-1] - marks[0],
                               "graph_s": end - marks[-1]}
        self.compile_s += end - t0

    def set_kernels(self, kernels) -> None:
        """Launch every kernel with `kernels` (a `kernels.options.KernelOptions`) from the next
        step on. The options reach each sparse projection and attention layer, and the captured
        steps of the old ones are dropped, kept graphs too: no replay runs stale options."""
        from sparsedecode.models.decoder import set_attention_options_
        from sparsedecode.projection.sparse_linear import check_dense_gemv, set_gemv_options_

        if not isinstance(kernels, KernelOptions):
            raise InputError(f"set_kernels takes a KernelOptions, got {type(kernels).__name__}; build one with "
                             "KernelOptions.parse('gemv.pdl=false')")
        self._check_lora_kernels(kernels)
        self.kernels_asked, kernels = kernels, self._resolved(kernels)
        check_dense_gemv(self.model, kernels.gemv)
        old, self.kernels = self.kernels, kernels
        set_gemv_options_(self.model, kernels.gemv)  # sparsify passes them to projections made later
        if kernels.gemv.dense != old.gemv.dense:  # the dense sites change module: lay them out again
            th, self.thresholds = self.thresholds, None
            self._dense_projections()
            if th is not None:
                self.sparsify(th)
        set_attention_options_(self.model, kernels.attention)
        self._cpu_plan = None
        self._graph = None
        self._graphs.clear()

    def need_linear(self, by: str | None) -> None:
        """Say what installed needs the nn.Linear modules (`by`, e.g. "CATS thresholds"; None:
        nothing) and resolve gemv.dense again from the options asked for. A gemv.dense=true asked
        for is refused there, and the engine stays as it was."""
        before, self.linear_needed_by = self.linear_needed_by, by
        try:
            self.set_kernels(self.kernels_asked)
        except InputError:
            self.linear_needed_by = before
            raise

    def _resolved(self, kernels: KernelOptions) -> KernelOptions:
        """gemv.dense None read as on when nothing installed needs the nn.Linear modules
        (`linear_needed_by`): on CUDA with Triton, and on CPU where the C kernel was built for the
        engine's dtype (its step is faster than F.linear's in the CPU decode records,
        `benchmarks/records/cpu/decode/`, docs/kernels/cpu_gemv.md 'dense-step'); off elsewhere.
        true where something needs them is refused."""
        from sparsedecode.kernels.common import triton
        from sparsedecode.projection import sparse_linear

        if kernels.cpu.step is not False:  # what never changes for this engine is settled here, once
            from sparsedecode.kernels.cpu_gemv import cpu_kernel
            from sparsedecode.kernels.cpu_step import step_entry

            if kernels.cpu.step and (self.device.type != "cpu" or self.compile or self.batch > 1):
                raise InputError("cpu.step=true runs the decode step of a CPU engine of batch 1 without "
                                 "torch.compile; drop cpu.step=true")
            built = self.device.type != "cpu" or step_entry(self.dtype) is not None
            if kernels.cpu.step and not built:
                raise InputError(f"cpu.step=true, and there is no {self.dtype} C step "
                                 f"({cpu_kernel().reason or 'not built for it'}); drop cpu.step=true")
            kernels = kernels.with_(cpu__step=self.device.type == "cpu" and not self.compile and self.batch == 1
                                    and built)
        if kernels.gemv.dense and self.linear_needed_by:
            raise InputError(f"{self.linear_needed_by} run the dense nn.Linear modules, which gemv.dense=true "
                             "replaces: drop gemv.dense=true (the default turns it off here by itself)")
        if kernels.gemv.dense is not None:
            return kernels
        on = self.linear_needed_by is None and (
            (self.device.type == "cuda" and triton is not None)
            or sparse_linear.cpu_rows(torch.empty(0, 0, dtype=self.dtype, device=self.device)))
        return kernels.with_(gemv__dense=on)

    def select_kv(self, method: str, keep: float, max_new: int, indices: bool = False, **params):
        """KV branch (ByteCross §4.1, App. A): after the prefill, decode reads only the
        entries `method` ('snapkv' or 'window', `kv.SELECTORS`) keeps at `keep` for the next
        `max_new` tokens; returns a `kv.apply.KVSelection` with the one-time cost (and, with
        indices=True, a scored selection's kept positions per layer). The next prefill from
        position 0 returns to dense attention."""
        from sparsedecode.kv.apply import select_kv

        self._one_sequence("select_kv")
        self.kv = None
        self.kv = select_kv(self, method, keep, max_new, indices=indices, **params)
        return self.kv

    def clear_kv(self) -> None:
        """Decode reads the whole cache again (dense attention) until the next selection."""
        from sparsedecode.kv.apply import clear_kv

        clear_kv(self)
        self.kv = None

    def rescore(self, max_new: int):
        """Select again with the current method and keep after a new turn was prefilled
        (`prefill(ids, start=engine.pos)`): its last tokens are the new observation window,
        scored against the full cache, which kept every entry, so nothing is recomputed."""
        if self.kv is None:
            raise InputError("rescore needs a selection to repeat: call select_kv first")
        return self.select_kv(self.kv.method, self.kv.keep, max_new, **self.kv.params)

    def reset(self) -> None:
        """Forget the cached tokens (the buffers stay allocated)."""
        self.pos = 0

    # -- generation ----------------------------------------------------------
    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of a prompt; with chat=True, wrapped in the model's chat template."""
        if self.tokenizer is None:
            raise InputError(
                f"'{self.name}' was loaded without a tokenizer (init='{self.init}'); pass token ids"
            )
        return encode(self.tokenizer, prompt, chat, self.name)

    def tokens(self, ids, max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
               seed: int | None = None, stop_ids: Sequence[int] | None = None,
               timing: Generation | None = None, lookahead: bool | None = None, gate=None) -> Iterator[int]:
        """Yield new token ids after prefilling ids, stopping after an EOS id or max_new_tokens.

        With `lookahead` (the default on CUDA) step i+1 is queued on the GPU before token i is
        read back to the host, so the host's per-token work (the sync, sampling's launch, the
        caller's text handling) overlaps a step instead of leaving the GPU idle between steps,
        as gpt-fast and vLLM's async scheduling do. A generation that stops early (EOS, or the
        caller closes the iterator) has run one step too many; its position is taken back, so
        the engine ends where it would have without (the extra slot lies past the valid prefix).
        `gate` (a `dispatch.runtime.RuntimeGate` on this engine) chooses the request's
        configuration by its prompt and max_new_tokens, installed by `configure` before the prefill."""
        check_sampling(temperature, top_p, seed)
        if max_new_tokens < 0:
            raise InputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        ids = self._as_ids(ids)
        self._check_len(ids.numel() + max_new_tokens, f"the prompt ({ids.numel()}) plus {max_new_tokens} new tokens")
        stop = set(self.eos_ids if stop_ids is None else stop_ids)
        gen = torch.Generator(self.device).manual_seed(seed) if seed is not None else None
        if gate is not None:  # the request's configuration, before its prefill
            choice = gate.choose(ids.numel(), max_new_tokens)
            gate.install(choice.spec)
            if timing is not None:
                timing.choice = choice
        t0 = time.perf_counter()
        logits = self.prefill(ids)
        nxt = sample(logits, temperature, top_p, gen)  # (1,)
        tok = int(nxt)
        if self.kv_config is not None:  # the KV branch: once per prompt, after the prefill
            kv = self.kv_config
            sel = self.select_kv(kv.method, kv.keep, max_new_tokens, **kv.params)
            if timing is not None:
                timing.kv_select_s = sel.select_s
        t1 = time.perf_counter()
        c1 = self.compile_s
        if timing is not None:
            timing.prefill_s = t1 - t0 - timing.kv_select_s
        if lookahead is None:
            lookahead = self.device.type == "cuda"
        host = HostToken(self.device)
        host.put(nxt)
        ahead = False  # a step past the last yielded token is queued
        try:
            for i in range(max_new_tokens):
                last = i == max_new_tokens - 1
                if lookahead and not last:
                    nxt = sample(self.decode_step(nxt), temperature, top_p, gen)  # step i+1, queued
                    ahead = True
                tok = host.get()  # token i: the one host sync per step, outside the captured step
                if ahead:
                    host.put(nxt)
                if timing is not None:  # a step compiled and captured on the way is not decode time
                    timing.compile_s = self.compile_s - c1
                    timing.decode_s = time.perf_counter() - t1 - timing.compile_s
                    timing.stopped_at_eos = tok in stop
                yield tok
                if tok in stop or last:
                    return
                if ahead:
                    ahead = False
                else:
                    nxt = sample(self.decode_step(nxt), temperature, top_p, gen)
                    host.put(nxt)
        finally:
            if ahead:  # stopped with step i+1 run: take its position back
                self.pos -= 1

    def generate(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, chat: bool = False,
                 on_text: Callable[[str], None] | None = None,
                 stop_ids: Sequence[int] | None = None, gate=None) -> Generation:
        """Generate from a prompt string or token ids; `on_text` receives text as it streams.

        Stops at the model's EOS ids (or `stop_ids`), which are kept in `ids` but not in `text`.
        `gate`: see `tokens`.
        """
        if self.batch > 1:  # one sequence through the batch's slots
            if gate is not None:
                raise InputError(f"a runtime gate chooses per request, and this engine decodes batches "
                                 f"({option('batch', self.batch)}): load with batch=1 to gate")
            out = self.generate_batch([prompt], max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                      chat=chat, stop_ids=stop_ids)[0]
            if on_text is not None and out.text:
                on_text(out.text)
            return out
        ids = self.encode(prompt, chat) if isinstance(prompt, str) else [int(t) for t in prompt]
        out = Generation(prompt_ids=list(ids))
        shown = ""
        for tok in self.tokens(ids, max_new_tokens, temperature=temperature, top_p=top_p,
                               seed=seed, stop_ids=stop_ids, timing=out, gate=gate):
            out.ids.append(tok)
            if self.tokenizer is not None and on_text is not None:
                text = self.tokenizer.decode(out.ids, skip_special_tokens=True)
                if not text.endswith("\ufffd") and len(text) > len(shown):
                    on_text(text[len(shown):])
                    shown = text
        if self.tokenizer is not None:
            out.text = self.tokenizer.decode(out.ids, skip_special_tokens=True)
            if on_text is not None and len(out.text) > len(shown):
                on_text(out.text[len(shown):])
        return out

    def generate_batch(self, prompts, max_new_tokens=128, *, temperature=0.0, top_p=1.0, seed=None,
                       chat: bool = False, stop_ids: Sequence[int] | None = None, kv=(),
                       on_token: Callable[[int, int], None] | None = None) -> list[Generation]:
        """Generate from several prompts (strings or token ids) in one decode batch of up to
        `batch` sequences (ByteCross §3.3, App. F; engine/batch.py): more prompts than slots
        wait in order for a free slot. max_new_tokens, temperature, top_p and seed take one
        value for every prompt or a list of one per prompt; `kv` likewise takes each prompt's KV
        selection (a KVConfig, text such as 'sel0.3', or None for its whole cache; left out:
        the engine's configured one, `kv_config`). The projection configuration is the engine's,
        for the whole batch. `on_token(i, token)` sees each new token of prompt i. Returns one
        `Generation` per prompt, in order."""
        from sparsedecode.engine.batch import Request, as_kv

        if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
            raise InputError("generate_batch takes a list of prompts (strings or token id lists), at least one")
        if self.linear_needed_by is not None or self.router is not None:
            raise InputError(f"a decode batch runs dense or TEAL-thresholded projections; {self.linear_needed_by or 'token routing'} "
                             "is not built for batches: decode with batch=1")
        if self.attention != "split_k":
            raise InputError(f"a decode batch attends with split_k; this engine runs {self.attention!r}")
        n = len(prompts)

        def each(v, name):
            if isinstance(v, (list, tuple)):
                if len(v) != n:
                    raise InputError(f"{name} gives {len(v)} values for {n} prompts: give one value or one per prompt")
                return list(v)
            return [v] * n

        kvs = [self.kv_config] * n if kv == () else [as_kv(k) for k in each(kv, "kv")]
        reqs = [Request(self.encode(p, chat) if isinstance(p, str) else [int(t) for t in p], m, t, tp, sd,
                        stop_ids, k)
                for p, m, t, tp, sd, k in zip(prompts, each(max_new_tokens, "max_new_tokens"),
                                              each(temperature, "temperature"), each(top_p, "top_p"),
                                              each(seed, "seed"), kvs, strict=True)]
        return self._batch_decoder.run(reqs, on_token)

    def __repr__(self) -> str:
        return (f"Engine({self.name!r}, {self.args.model_type}, device={self.device}, "
                f"dtype={str(self.dtype).removeprefix('torch.')}, max_len={self.max_len}, "
                f"attention={self.attention!r}, init={self.init!r})")


__all__ = ["DEFAULT_MAX_LEN", "Engine", "Generation"]
