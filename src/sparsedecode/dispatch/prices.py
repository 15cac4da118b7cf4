"""Latency tables: the step cost of every configuration against context, from timing records
(ByteCross §3.3 'Dispatch and batching', §5.4, App. I).

A `PriceTable` holds, per configuration (a timing mode: dense, proj0.5, sel0.3, both0.5/0.3),
its step-ms curve and, for a KV configuration, the one-time cost of its selection. It is built
from timing records, ours (a campaign folder of 'timing_cell' records, e.g. `campaign run` or
`bench cell`) or the paper's (`sweep_a100/`, `sweep_a6000/`), and it is what the gate table
(`gate.json`) stores.

Choices the paper leaves open, written down here:

- Every measured cell of every block is one point of step-ms against context. The curve goes
  through the geometric mean of the points at each measured context (the least-squares fit in
  log space there) and is interpolated log-log between contexts, clamped at both measured ends
  (App. I: 'interpolating between the compiled sweep lengths'; a request beyond the sweep is
  priced at its last length, never extrapolated).
- The selection's one-time cost (observation pass, scoring, gather) is charged per prompt
  token: `--select-seconds S` is its time at 32K (the paper's 0.24 s on A100-SXM4 and 0.32 s
  on RTX A6000, App. A), S * n / 32768 for a prompt of n tokens. Without it, the cells' own
  `one_time.select_s` are used: their mean at each measured context, interpolated linearly
  in n and clamped (a fixed part, such as a warm-up, stays fixed). The paper's records hold
  only the gather time, so they need S.
- A KV configuration is infeasible for a prompt whose budget round(keep x n) - answer cannot
  hold the selector's sinks and observation window (`kv.snapkv`); such a request is priced at
  infinity for it, never an error.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sparsedecode.account import ModelDims
from sparsedecode.account.dims import dims_from_dict
from sparsedecode.config import SparsityConfig
from sparsedecode.errors import InputError, option
from sparsedecode.validate import (
    require_bool,
    require_dict,
    require_field,
    require_increasing,
    require_list,
    require_number,
    require_str,
)

SELECT_REF_TOKENS = 32768  # --select-seconds is the selection's time on a prompt of this length
SCHEMA = 1
KIND = "gate_table"
CONTEXT_LIMIT = 2**25  # tokens: a curve's contexts (a prompt of 2^24 and an answer of 2^20 fit)
MS_LIMIT = 1e7  # ms per step: nearly three hours a token is a unit error, not a measurement
SECONDS_LIMIT = 1e6  # seconds of one selection
SOURCES = ("sparsedecode", "bytecross")


def _positive_finite(v, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
        raise InputError(f"{what} must be a positive finite number, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class Curve:
    """Step ms against context: one point per measured context (the geometric mean of its
    cells), log-log interpolated and clamped at both ends. `cells` counts the records."""

    contexts: tuple[int, ...]
    ms: tuple[float, ...]
    cells: int = 0

    where: str = field(default="a step curve", compare=False, repr=False)

    def __post_init__(self):
        if not self.contexts or len(self.contexts) != len(self.ms):
            raise InputError(f"{self.where}: a step curve needs one step time per context, and at least one "
                             f"context (got {len(self.contexts)} contexts and {len(self.ms)} times)")
        for n, t in zip(self.contexts, self.ms, strict=True):
            require_number(n, "contexts", lo=1, hi=CONTEXT_LIMIT, integer=True, where=self.where)
            require_number(t, f"ms at context {n}", lo=0, above=True, hi=MS_LIMIT, where=self.where)
        require_increasing(self.contexts, "contexts", where=self.where)
        object.__setattr__(self, "_lx", tuple(math.log(n) for n in self.contexts))
        object.__setattr__(self, "_ly", tuple(math.log(t) for t in self.ms))

    @classmethod
    def from_points(cls, points: list[tuple[int, float]]) -> Curve:
        """A curve through the geometric mean of the points (context, ms) at each context."""
        by: dict[int, list[float]] = {}
        for n, t in points:
            by.setdefault(int(n), []).append(math.log(_positive_finite(t, f"step ms at context {n}")))
        ctx = sorted(by)
        return cls(tuple(ctx), tuple(math.exp(sum(by[n]) / len(by[n])) for n in ctx), len(points))

    @classmethod
    def from_dict(cls, d, where: str) -> Curve:
        d = require_dict(d, "curve", where=where)
        contexts = require_list(require_field(d, "contexts", where=where, prefix="curve."), "curve.contexts",
                                where=where)
        ms = require_list(require_field(d, "ms", where=where, prefix="curve."), "curve.ms", where=where)
        cells = d.get("cells", 0)
        require_number(cells, "curve.cells", lo=0, integer=True, where=where)
        return cls(tuple(contexts), tuple(ms), cells, where=f"{where}: curve")

    def at(self, n: float) -> float:
        """Step ms at context n (pure Python: the runtime gate calls this per request)."""
        lx, ly = self._lx, self._ly
        x = math.log(max(n, 1.0))
        if x <= lx[0]:
            return self.ms[0]
        if x >= lx[-1]:
            return self.ms[-1]
        i = bisect.bisect_right(lx, x)
        w = (x - lx[i - 1]) / (lx[i] - lx[i - 1])
        return math.exp(ly[i - 1] + w * (ly[i] - ly[i - 1]))

    def many(self, n: np.ndarray) -> np.ndarray:
        """Step ms at every context of the array n (vectorized `at`)."""
        x = np.log(np.maximum(np.asarray(n, dtype=float), 1.0))
        return np.exp(np.interp(x, np.asarray(self._lx), np.asarray(self._ly)))

    def to_dict(self) -> dict:
        return {"contexts": list(self.contexts), "ms": list(self.ms), "cells": self.cells}


@dataclass(frozen=True)
class SelectCost:
    """The KV selection's one-time cost in seconds against prompt length n.

    kind 'per_token': seconds_at_32k * n / 32768 (the paper's charge); kind 'measured': the
    records' select times, linear in n between measured contexts and clamped at the ends."""

    kind: str
    seconds_at_32k: float | None = None
    contexts: tuple[int, ...] = ()
    seconds: tuple[float, ...] = ()

    where: str = field(default="", compare=False, repr=False)  # '' : the selection cost (its option)

    def __post_init__(self):
        where = self.where or f"the selection cost ({option('select_seconds')})"
        require_str(self.kind, "select.kind", choices=("per_token", "measured"), where=where)
        if self.kind == "per_token":
            require_number(self.seconds_at_32k, "select.seconds_at_32k", lo=0, hi=SECONDS_LIMIT, where=where)
        else:
            if not self.contexts or len(self.contexts) != len(self.seconds):
                raise InputError(f"{where}: a measured selection cost needs one time per context, and at least "
                                 f"one context (got {len(self.contexts)} contexts and {len(self.seconds)} times)")
            for n, t in zip(self.contexts, self.seconds, strict=True):
                require_number(n, "select.contexts", lo=1, hi=CONTEXT_LIMIT, integer=True, where=where)
                require_number(t, f"select.seconds at context {n}", lo=0, hi=SECONDS_LIMIT, where=where)
            require_increasing(self.contexts, "select.contexts", where=where)

    def at(self, n: float) -> float:
        if self.kind == "per_token":
            return self.seconds_at_32k * n / SELECT_REF_TOKENS
        return float(np.interp(n, self.contexts, self.seconds))

    def many(self, n: np.ndarray) -> np.ndarray:
        n = np.asarray(n, dtype=float)
        if self.kind == "per_token":
            return self.seconds_at_32k * n / SELECT_REF_TOKENS
        return np.interp(n, self.contexts, self.seconds)

    def to_dict(self) -> dict:
        if self.kind == "per_token":
            return {"kind": self.kind, "seconds_at_32k": self.seconds_at_32k}
        return {"kind": self.kind, "contexts": list(self.contexts), "seconds": list(self.seconds)}

    @classmethod
    def from_dict(cls, d, where: str = "a selection cost") -> SelectCost:
        d = require_dict(d, "select", where=where)
        kind = require_str(d.get("kind"), "select.kind", choices=("per_token", "measured"), where=where)
        if kind == "per_token":
            return cls(kind, d.get("seconds_at_32k"), where=where)
        contexts = require_list(require_field(d, "contexts", where=where, prefix="select."), "select.contexts",
                                where=where)
        seconds = require_list(require_field(d, "seconds", where=where, prefix="select."), "select.seconds",
                               where=where)
        return cls(kind, None, tuple(contexts), tuple(seconds), where=where)


@dataclass(frozen=True)
class ConfigPrice:
    """One configuration's prices: its step curve and, for a KV configuration, the cost of
    its selection and the selector's sinks and observation window (for feasibility)."""

    spec: str  # the timing mode string: dense, proj0.5, sel0.3, both0.5/0.3
    curve: Curve
    select: SelectCost | None = None
    sinks: int = 4
    window: int = 64

    def __post_init__(self):
        where = f"configuration {self.spec}"
        require_number(self.sinks, "sinks", lo=0, hi=CONTEXT_LIMIT, integer=True, where=where)
        require_number(self.window, "window", lo=0, hi=CONTEXT_LIMIT, integer=True, where=where)
        if self.uses_kv and self.select is None:
            raise InputError(f"{where} selects KV entries but carries no selection cost: a missing cost is "
                             "not a free selection; rebuild the table (sparsedecode dispatch table RECORDS "
                             "--select-seconds S)")

    @property
    def mode(self) -> SparsityConfig:
        return SparsityConfig.parse(self.spec)

    @property
    def uses_kv(self) -> bool:
        return self.mode.kv_method is not None

    def feasible(self, prompt, answer):
        """Whether the KV budget round(keep x prompt) - answer of a request holds sinks and
        window; prompt and answer may be arrays (an array of bools comes back)."""
        if not self.uses_kv:
            return True if np.isscalar(prompt) else np.ones(np.shape(prompt), dtype=bool)
        budget = np.floor(self.mode.kv_keep * np.asarray(prompt, dtype=float) + 0.5) - answer
        ok = budget >= self.sinks + self.window
        return bool(ok) if np.isscalar(prompt) else ok

    def to_dict(self) -> dict:
        return {"spec": self.spec, "curve": self.curve.to_dict(),
                "select": None if self.select is None else self.select.to_dict(),
                "sinks": self.sinks, "window": self.window}


@dataclass(frozen=True)
class PriceTable:
    """Step curves and one-time costs per configuration, with what they were measured on.

    `gpu` is the device name of the records ('CPU' for CPU cells); `records` the folders
    they came from; `admissibility` maps a configuration to its evidence (see
    `dispatch.policies.admissible`). `batch`: sequences a priced step decodes (issue 44; ByteCross
    §3.3 'Dispatch and batching'): a table of batch B prices the step of B sequences from the
    campaign's batch-B cells, its curves in ms a step, which is each sequence's ms per token."""

    model: str
    dims: ModelDims | None
    gpu: str
    device: str
    dtype: str | None
    attention: str | None
    source: str  # 'sparsedecode' or 'bytecross'
    records: tuple[str, ...]
    configs: dict[str, ConfigPrice]
    admissibility: dict[str, dict] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    batch: int = 1

    def __post_init__(self):
        require_number(self.batch, "batch", lo=1, hi=4096, integer=True, where="gate table")
        if "dense" not in self.configs:
            raise InputError(
                f"the price table of {', '.join(self.records) or 'these records'} has no dense curve: "
                "every speedup and the gate's fallback need the dense cells of the same campaign "
                f"(configurations found: {', '.join(self.configs) or 'none'})")

    @property
    def specs(self) -> list[str]:
        return list(self.configs)

    def step_ms(self, spec: str, n: float) -> float:
        return self.configs[spec].curve.at(n)

    def check_engine(self, engine) -> None:
        """Refuse to price an engine of another model (other dims; without dims, another name)
        or on another device than the records."""
        if self.dims is None:
            if self.model != engine.name:
                raise InputError(
                    f"the gate table was timed on {self.model} and carries no dims to compare; the engine runs "
                    f"{engine.name}: build a gate table from timing records of {engine.name} (sparsedecode "
                    "dispatch table RECORDS --out gate.json)")
            diff = []
        else:
            diff = dims_differences(self.dims, engine.dims)
        if diff:
            raise InputError(
                f"the gate table was timed on {self.model} and the engine runs {engine.name}, whose dims "
                f"differ ({', '.join(diff)}): build a gate table from timing records of "
                f"{engine.name} (sparsedecode dispatch table RECORDS --out gate.json)")
        batch = getattr(engine, "batch", 1)
        if self.batch != batch:
            raise InputError(
                f"the gate table prices steps of {self.batch} sequence(s) and the engine decodes {batch} at "
                f"once: build a table of its batch size (sparsedecode dispatch table RECORDS --batch {batch}) "
                "from a campaign that timed it (a grid's batch key)")
        here = device_name(engine.device)
        if here.upper() != self.gpu.upper():
            raise InputError(
                f"the gate table was timed on {self.gpu} and the engine runs on {here}: step times do not "
                f"transfer between devices; time the cells on {here} and build the table from them")

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "kind": KIND, "model": self.model,
                "dims": None if self.dims is None else self.dims.to_dict(), "gpu": self.gpu,
                "device": self.device, "dtype": self.dtype, "attention": self.attention,
                "source": self.source, "records": list(self.records),
                "configs": {k: c.to_dict() for k, c in self.configs.items()},
                "admissibility": self.admissibility, "notes": list(self.notes), "batch": self.batch}

    @classmethod
    def read(cls, path: str | Path) -> PriceTable:
        """A gate table file written by `sparsedecode dispatch table`."""
        from sparsedecode.textfile import read_json

        path = Path(path)
        if not path.is_file():
            raise InputError(f"gate table {path} not found (make one with sparsedecode dispatch table "
                             "RECORDS --out gate.json)")
        return cls.from_dict(read_json(path, "gate table"), str(path))

    @classmethod
    def from_dict(cls, d: dict, where: str = "gate table") -> PriceTable:
        """A table from its JSON; every field's type and range is checked, and a bad one is
        refused in one line naming `where`, the field, its value and what is expected."""
        if not isinstance(d, dict) or d.get("kind") != KIND:
            got = d.get("kind") if isinstance(d, dict) else type(d).__name__
            raise InputError(f"{where}: not a gate table (kind {got!r}, expected '{KIND}'); make one "
                             "with sparsedecode dispatch table RECORDS --out gate.json")
        if "schema" in d:
            require_number(d["schema"], "schema", lo=SCHEMA, hi=SCHEMA, integer=True, where=where)
        configs_in = require_dict(require_field(d, "configs", where=where), "configs", where=where)
        configs = {}
        for spec, c in configs_in.items():
            at = f"{where}: configuration {spec}"
            try:
                SparsityConfig.parse(spec)
            except InputError as e:
                raise InputError(f"{where}: configuration name {spec!r}: {e}") from None
            c = require_dict(c, f"configs.{spec}", where=where)
            select = c.get("select")
            configs[spec] = _config_price(
                spec, Curve.from_dict(require_field(c, "curve", where=at), at),
                None if select is None else SelectCost.from_dict(select, at),
                c.get("sinks", 4), c.get("window", 64), at)
        dims = None if d.get("dims") is None else dims_from_dict(d["dims"], where)
        opt = lambda k: None if d.get(k) is None else require_str(d[k], k, where=where)  # noqa: E731
        strings = lambda k: tuple(require_str(x, f"{k}[{i}]", where=where, empty=True)  # noqa: E731
                                  for i, x in enumerate(require_list(d.get(k, []), k, where=where, empty=True)))
        admissibility = require_dict(d.get("admissibility") or {}, "admissibility", where=where)
        for spec, e in admissibility.items():
            if spec not in configs:
                raise InputError(f"{where}: field 'admissibility' names {spec!r}, which is not one of the "
                                 f"table's configurations ({', '.join(configs)})")
            e = require_dict(e, f"admissibility.{spec}", where=where)
            require_bool(e.get("admitted"), f"admissibility.{spec}.admitted", where=where)
            if e.get("reason") is not None:
                require_str(e["reason"], f"admissibility.{spec}.reason", where=where, empty=True)
        try:
            return cls(require_str(d.get("model"), "model", where=where), dims,
                       require_str(d.get("gpu"), "gpu", where=where),
                       require_str(d.get("device", "cuda"), "device", where=where), opt("dtype"), opt("attention"),
                       require_str(d.get("source", "sparsedecode"), "source", choices=SOURCES, where=where),
                       strings("records"), configs, admissibility, strings("notes"), d.get("batch", 1))
        except InputError as err:
            if str(err).startswith(where):
                raise
            raise InputError(f"{where}: {err}") from None


def _config_price(spec, curve, select, sinks, window, where) -> ConfigPrice:
    try:
        return ConfigPrice(spec, curve, select, sinks, window)
    except InputError as e:  # name the file: ConfigPrice names only the configuration
        raise InputError(f"{where.rsplit(': configuration', 1)[0]}: {e}") from None


def dims_differences(a: ModelDims, b: ModelDims) -> list[str]:
    """'field a vs b' for each field but the name in which two models' dims differ."""
    return [f"{k} {getattr(a, k)} vs {getattr(b, k)}" for k in a.__dataclass_fields__
            if k != "name" and getattr(a, k) != getattr(b, k)]


def device_name(device) -> str:
    """'NVIDIA H200' for a CUDA device, 'CPU' for the CPU (as timing records name them)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return "CPU"


def cell_spec(cell) -> str:
    """The configuration of a timing cell (ours or the paper's) as a mode string."""
    if cell.mode == "dense":
        return "dense"
    return str(SparsityConfig.from_fields(cell.mode, cell.projection_keep, cell.kv_keep))


def from_records(folders: list[str | Path], select_seconds: float | None = None,
                 obs_window: int | None = None, batch: int = 1) -> PriceTable:
    """A price table from campaign folders of one model and one device (ours or the paper's).

    select_seconds: the selection's time at 32K, charged per prompt token (needed for the
    paper's records, which hold only the gather); else the cells' `one_time.select_s`.
    batch: price the step of this many sequences from the cells of that batch size (a batch
    campaign's grid); each curve point is then ms a step, what each of its sequences waits a token."""
    from sparsedecode.timing.cells import load_cells

    if not folders:
        raise InputError("give at least one folder of timing records")
    if select_seconds is not None:
        if isinstance(select_seconds, bool) or not math.isfinite(select_seconds) or select_seconds < 0:
            raise InputError(f"{option('select_seconds')} must be a finite number of seconds >= 0, got {select_seconds}")
    require_number(batch, "batch", lo=1, hi=4096, integer=True, where="dispatch table")
    loaded = [load_cells(f, batched=True) for f in folders]
    have = sorted({c.batch(x) for c in loaded for x in c.cells})
    if batch not in have:
        raise InputError(f"{', '.join(str(c.folder) for c in loaded)} hold no cells of batch {batch} (batch sizes "
                         f"timed: {', '.join(map(str, have)) or 'none'}); time them with a grid's batch key, or "
                         "price one of those")
    first = loaded[0]
    for c in loaded[1:]:
        for what, a, b in (("model", first.model, c.model), ("GPU", first.gpu, c.gpu)):
            if a != b:
                raise InputError(f"{c.folder} holds records of {what} {b} and {first.folder} of {a}: "
                                 "one price table prices one model on one device")
    points: dict[str, list[tuple[int, float]]] = {}
    selects: dict[str, list[tuple[int, float]]] = {}
    attention, dtype, obs = set(), set(), set()
    for camp in loaded:
        for cell in camp.cells:
            if cell.mode == "window" or camp.batch(cell) != batch:
                continue  # the paper's window cells have no dense partner here; not a gate choice
            spec = cell_spec(cell)
            points.setdefault(spec, []).append((cell.context, cell.ms_per_token * batch))  # a step's ms
            ex = camp.extra(cell)
            if ex.attention:
                attention.add(ex.attention)
            if ex.dtype:
                dtype.add(ex.dtype)
            if ex.obs:
                obs.add(ex.obs)
            if SparsityConfig.parse(spec).kv_method:
                s = (ex.one_time or {}).get("select_s")
                if isinstance(s, int | float) and not isinstance(s, bool) and s > 0:
                    selects.setdefault(spec, []).append((cell.context, float(s)))
    if len(attention) > 1:
        raise InputError(f"the records mix attention paths ({', '.join(sorted(attention))}): a speedup "
                         "is only meaningful against a dense step on the same path; give one path's records")
    window = obs_window or (obs.pop() if len(obs) == 1 else 64)
    configs, notes = {}, []
    order = sorted(points, key=lambda s: (["dense", "proj", "sel", "window", "both"].index(SparsityConfig.parse(s).kind), s))
    for spec in order:
        sel = None
        if SparsityConfig.parse(spec).kv_method:
            if select_seconds is not None:
                sel = SelectCost("per_token", seconds_at_32k=float(select_seconds))
            elif spec in selects:
                by: dict[int, list[float]] = {}
                for n, s in selects[spec]:
                    by.setdefault(n, []).append(s)
                ctx = sorted(by)
                sel = SelectCost("measured", contexts=tuple(ctx),
                                 seconds=tuple(sum(by[n]) / len(by[n]) for n in ctx))
            else:
                why = ("the paper's records hold only the gather, not the scoring pass"
                       if first.source == "bytecross" else "no one_time.select_s")
                raise InputError(
                    f"the records of {spec} carry no selection time ({why}): "
                    f"give {option('select_seconds', 'S', placeholder=True)}, the selection's time on a 32K prompt (the paper: 0.24 on "
                    "A100-SXM4, 0.32 on RTX A6000)")
        configs[spec] = ConfigPrice(spec, Curve.from_points(points[spec]), sel, window=window)
    if first.cpu:
        notes.append("CPU timings: the projection branch runs the masked reference, which reads every weight")
    if batch > 1:
        notes.append(f"steps of {batch} sequences: each curve is ms a step of the batch (each sequence's ms per "
                     "token); the projection configuration is the whole batch's")
    return PriceTable(first.model, first.dims, first.gpu, first.device, dtype.pop() if len(dtype) == 1 else None,
                      attention.pop() if attention else None, first.source,
                      tuple(str(c.folder) for c in loaded), configs, {}, tuple(notes), batch)


def select_seconds_of(record: dict, where: str = "--select-record") -> float:
    """The selection's time at 32K from a 'kv_select_bench' record: its median select time,
    scaled per prompt token from the record's context."""
    if not isinstance(record, dict) or record.get("kind") != "kv_select_bench":
        got = record.get("kind") if isinstance(record, dict) else type(record).__name__
        raise InputError(f"{where}: a '{got}' record, expected 'kv_select_bench' (benchmarks/kv_select_h200.py)")
    n, s = record.get("context"), record.get("select_s_median")
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise InputError(f"{where}: field 'context' is {n!r}, expected a positive token count")
    return _positive_finite(s, f"{where}: field 'select_s_median'") * SELECT_REF_TOKENS / n


__all__ = ["KIND", "SELECT_REF_TOKENS", "ConfigPrice", "Curve", "PriceTable", "SelectCost", "device_name",
           "dims_differences", "from_records", "select_seconds_of"]
