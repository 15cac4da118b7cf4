"""The runtime gate: each request decodes under its configuration of least predicted cost
(ByteCross §3.3 'Dispatch and batching': 'selects for each request the fastest admissible
configuration from the resulting lookup table, one-time costs included').

`load_gate(engine, "gate.json")` builds a `RuntimeGate`; whoever generates or serves holds it
(`Engine.generate(..., gate=)`, the server's configurations). Per request, after tokenizing,
`Engine.tokens` asks it for (prompt length, max_new_tokens) and it:

1. prices every admissible configuration of the table (`policies.choose`; a KV configuration
   whose budget cannot hold the selector's sinks and window is priced at infinity, so a short
   prompt falls to a configuration without selection instead of failing);
2. installs the cheapest: projection thresholds are calibrated once per keep when the gate is
   built and kept; the sparse projection modules are built once and swapped in and out by
   reference, never rebuilt, and a keep change refills their thresholds in place; the KV
   selection runs after that request's prefill, as for any KV configuration;
3. reports the choice, its predicted ms/token and (after decoding) the measured one.

Switching costs no recompilation per request: the engine keeps one captured decode step per
state of what the step reads (`Engine.keep_graphs`), so each configuration compiles and
captures once, at its first request (or at `warm()`) (`Engine.keep_states`). The price is memory: on CUDA the dense
and the sparse projection weights are both resident (the sparse copy is transposed), and the
selection's compact buffers are sized once for the longest prompt the cache holds.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

from sparsedecode.dispatch.mix import check_request
from sparsedecode.dispatch.policies import choose
from sparsedecode.dispatch.prices import PriceTable
from sparsedecode.errors import InputError


@dataclass(frozen=True)
class Choice:
    """The gate's decision for one request: the configuration, its predicted decode ms per
    token (the step cost along the answer, one-time costs apart), the predicted one-time
    selection seconds, every admissible configuration's predicted total ms, and how long
    choosing took (ms)."""

    spec: str
    prompt_tokens: int
    max_new_tokens: int
    predicted_ms_per_token: float
    predicted_select_s: float
    costs_ms: dict[str, float] = field(default_factory=dict)
    choose_ms: float = 0.0

    def to_dict(self) -> dict:
        return {"mode": self.spec, "predicted_ms_per_token": self.predicted_ms_per_token,
                "predicted_select_s": self.predicted_select_s,
                "predicted_costs_ms": {k: (None if math.isinf(v) else v) for k, v in self.costs_ms.items()},
                "choose_ms": self.choose_ms}


class RuntimeGate:
    """Per-request configuration choice on one engine from a `PriceTable` (a gate table)."""

    def __init__(self, engine, table: PriceTable, *, thresholds: dict | None = None,
                 calib_tokens: int = 2048, seed: int = 0, progress: bool = False, text_file=None):
        from sparsedecode.kv.select import get_selector

        table.check_engine(engine)
        ev = table.admissibility
        if not ev:
            raise InputError("the gate table carries no admissibility evidence: write it with sparsedecode "
                             "dispatch table RECORDS --admit FILE (or --assume-admissible) --out gate.json")
        self.table = table
        self.engine = engine
        self.specs = [s for s in table.specs if s == "dense" or ev.get(s, {}).get("admitted")]
        for s in self.specs:
            m = table.configs[s].mode
            if m.kind == "window":
                raise InputError(f"the gate runs dense, proj, sel and both configurations; {s} reads the cache "
                                 "in place at bounds that change with every prompt (a capture per request)")
            if m.kv_method:
                get_selector(m.kv_method)
        self.projection = None  # a batch engine's: the one projection its batch steps read
        if getattr(engine, "batch", 1) > 1:
            self.projection = batch_projection(table, self.specs)
            self.specs = [s for s in self.specs if projection_of(s) == self.projection]
        self.configs = {s: _with_fields(table.configs[s]) for s in self.specs}  # what each name installs
        self._thresholds = {}
        self.current: str | None = None
        keeps = sorted({table.configs[s].mode.proj_keep for s in self.specs} - {1.0})
        for keep in keeps:
            given = (thresholds or {}).get(keep)
            if given is None:
                from sparsedecode.projection.calibrate import own_teal

                with engine._batch_decoder._on_slot(0) if engine.batch > 1 else contextlib.nullcontext():
                    given, _ = own_teal(engine, keep, tokens=calib_tokens, seed=seed, text_file=text_file,
                                        progress=progress)
            self._thresholds[keep] = given
        if getattr(engine, "batch", 1) == 1:  # a batch grows its rows' compact regions and captures its own step
            self._reserve_kv()
            engine.keep_states("the runtime gate's configurations")  # layouts swapped, graphs kept per state

    def _reserve_kv(self) -> None:
        """Size the selection's compact buffers once for the longest prompt the cache holds,
        so no request reallocates them (a new buffer would need a new capture)."""
        kv = [self.table.configs[s].mode.kv_keep for s in self.specs if self.table.configs[s].uses_kv]
        if not kv:
            return
        self.engine.compact_buffers(math.floor(max(kv) * self.engine.max_len + 0.5) + 1)

    # -- choosing ----------------------------------------------------------------------------
    def choose(self, prompt_tokens: int, max_new_tokens: int, spec: str | None = None) -> Choice:
        """The admissible configuration of least predicted cost for one request, or `spec`
        (one of `specs`) priced for it: infinite where its selection cannot run."""
        t0 = time.perf_counter()
        prompt_tokens, max_new_tokens = check_request(prompt_tokens, max_new_tokens, answer_lo=0)
        answer = max(max_new_tokens, 1)
        best, costs = choose(self.table, prompt_tokens, answer, self.specs)
        if spec is not None:
            if spec not in self.specs:
                raise InputError(f"configuration {spec} is not one the gate may run ({', '.join(self.specs)})")
            best = spec
        price = self.table.configs[best]
        select_s = 0.0 if price.select is None else price.select.at(prompt_tokens)
        per_token = (costs[best] - 1000.0 * select_s) / answer  # the step cost along the answer
        return Choice(best, int(prompt_tokens), int(max_new_tokens), per_token, select_s, costs,
                      (time.perf_counter() - t0) * 1e3)

    # -- installing --------------------------------------------------------------------------
    def install(self, spec: str) -> None:
        """Make the engine decode under `spec` (`Engine.configure` with the thresholds calibrated for
        its keep): the projection modules built once are swapped back by reference and their
        thresholds refilled in place; the KV selection runs after the next prompt's prefill."""
        if spec not in self.specs:
            raise InputError(f"configuration {spec} is not one the gate may run ({', '.join(self.specs)})")
        config = self.configs[spec]
        self.engine.configure(config, thresholds=self._thresholds.get(config.proj_keep))
        self.current = spec

    def warm(self, progress=None) -> dict[str, float]:
        """Compile and capture the decode step of every configuration now (seconds each), so
        that no request pays it; on CPU there is nothing to capture."""
        out = {}
        eng = self.engine
        if not eng.cuda_graph or eng.batch > 1:  # a batch server warms its own step (serve.batch_worker)
            return out
        for spec in self.specs:
            t0 = time.perf_counter()
            self.install(spec)
            price = self.table.configs[spec]
            warm_step(eng, spec, price.sinks + price.window)
            out[spec] = time.perf_counter() - t0
            if progress is not None:
                progress(spec, out[spec])
        return out


def projection_of(spec: str) -> str:
    """The projection part of a configuration's name: 'proj0.5' of 'both0.5/0.3', 'dense' of 'sel0.3'."""
    from sparsedecode.config import SparsityConfig

    return str(SparsityConfig.parse(spec).with_(kv=None))


def batch_projection(table: PriceTable, specs: list[str]) -> str:
    """The projection configuration a batch engine runs under a gate (ByteCross §3.3 'Dispatch and
    batching'): one step reads one set of weight rows for all its sequences, so the projection is
    chosen per batch size, not per request. Each projection among `specs` is priced by the cheapest
    step of its configurations (with or without selection) at every context the table's curves hold,
    summed; the cheapest projection is the batch's, and each request then chooses its KV selection
    among the configurations that share it. The table prices steps of the engine's batch size
    (`PriceTable.batch`)."""
    contexts = sorted({n for s in specs for n in table.configs[s].curve.contexts})
    by: dict[str, list[str]] = {}
    for s in specs:
        by.setdefault(projection_of(s), []).append(s)
    cost = {p: sum(min(table.step_ms(s, n) for s in group) for n in contexts) for p, group in by.items()}
    return min(cost, key=lambda p: (cost[p], p != "dense"))


def warm_step(engine, spec: str, room: int = 0) -> None:
    """Compile and capture the decode step of the configuration `spec` installed on `engine`:
    a prompt of zeros long enough for its KV selection to keep `room` entries (sinks + window)
    and two more, the selection, one step; then the cache is forgotten."""
    kv = engine.kv_config if engine.kv_config is not None and engine.kv_config.keep < 1.0 else None
    n = 16 if kv is None else math.ceil((room + 2) / kv.keep) + 1
    if n + 2 > engine.max_len:
        raise InputError(f"the cache of {engine.max_len} tokens cannot hold a prompt that {spec} can select "
                         f"from ({n} tokens); load with a larger max_len")
    engine.prefill([0] * n)
    if kv is not None:
        engine.select_kv(kv.method, kv.keep, 1, **kv.params)
    engine.decode_step(0)
    engine.reset()


def _with_fields(price):
    """The configuration a priced name installs: its KV selector with the sinks and observation
    window it was priced with."""
    from sparsedecode.config import KVConfig

    c = price.mode
    if c.kv is None:
        return c
    return c.with_(kv=KVConfig(c.kv.method, c.kv.keep, {"window": price.window, "sinks": price.sinks}))


def load_gate(engine, gate, **kwargs) -> RuntimeGate:
    """A RuntimeGate from a gate table file (or dict, or PriceTable) for `engine`."""
    if isinstance(gate, PriceTable):
        table = gate
    elif isinstance(gate, dict):
        table = PriceTable.from_dict(gate)
    else:
        table = PriceTable.read(gate)
    return RuntimeGate(engine, table, **kwargs)




def check_requests(engine, gate: RuntimeGate, requests: list[tuple[int, int]], *, seed: int = 0,
                   repeats: int = 1, progress=None) -> list[dict]:
    """Decode each (prompt tokens, answer tokens) request under `gate` from seeded
    random token ids, never stopping early (EOS ignored), and set the measured decode ms/token
    beside the table's prediction. The gate's configurations are captured first (`warm`), so no
    timed request pays a compile."""
    import torch

    if not isinstance(gate, RuntimeGate) or gate.engine is not engine:
        raise InputError("check_requests needs a RuntimeGate built on this engine (load_gate(engine, FILE))")
    rows = []
    gen = torch.Generator().manual_seed(seed)
    for p, a in requests:
        ids = torch.randint(0, engine.dims.vocab, (p,), generator=gen).tolist()
        for r in range(repeats):
            out = engine.generate(ids, max_new_tokens=a, stop_ids=(), gate=gate)
            c = out.choice
            row = {"prompt_tokens": p, "answer_tokens": a, "repeat": r, "mode": c.spec,
                   "predicted_ms_per_token": c.predicted_ms_per_token, "ms_per_token": out.ms_per_token,
                   "ratio": out.ms_per_token / c.predicted_ms_per_token,
                   "predicted_select_s": c.predicted_select_s, "kv_select_s": out.kv_select_s,
                   "prefill_s": out.prefill_s, "decode_steps": len(out.ids) - 1, "choose_ms": c.choose_ms,
                   "predicted_costs_ms": c.to_dict()["predicted_costs_ms"]}
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows


__all__ = ["Choice", "RuntimeGate", "check_requests", "load_gate"]
