"""A timing campaign folder read into paired cells (ByteCross App. A "Timing", §4.2-4.4).

Our harness writes one JSON record of kind ``timing_cell`` per cell at
``DIR/cells/{group}/{cell}_{context}_b{block}.json``. ``load_cells`` turns the
ok ones into :class:`~sparsedecode.timing.paper.PaperCell` (the type the
statistics of ``stats.py`` take, so one code path serves our records and the
paper's), keeps the fields only our records carry (byte bound, bytes per step,
achieved GB/s, attention path, one-time costs, realized keeps, peak memory) in
a side table keyed by record path, and lists failed records and sparse cells
that lack a dense partner of the same group, context and block, so a report can
show them instead of dropping them.

A folder of the paper's own records (flat ``*.json`` without ``kind``) is read
with ``paper.load_campaign``; their extras are empty and the report fills bytes
from the byte account. Which format a folder holds is decided by the records'
``kind`` field, never by file names.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from sparsedecode.account import ModelDims, known_model
from sparsedecode.account.dims import dims_from_dict
from sparsedecode.errors import InputError
from sparsedecode.timing.paper import (
    PaperCell,
    check_positive,
    check_runs,
    load_campaign,
    record_field,
)

KIND = "timing_cell"
_NUM = (int, float)

# Fields an ok record must hold (contract of the harness), with their JSON types.
_REQUIRED: dict[str, tuple[type, ...]] = {
    "block": (int,),
    "group": (str,),
    "cell": (str,),
    "mode": (str,),
    "context": (int,),
    "projection_keep": _NUM,
    "kv_keep": _NUM,
    "tokens_per_sec": _NUM,
    "tokens_per_sec_runs": (list,),
    "ms_per_token": _NUM,
    "model_name": (str,),
    "gpu": (str,),
    "device": (str,),
}
# Extras: checked when present and not null.
_EXTRAS: dict[str, tuple[type, ...]] = {
    "byte_bound": _NUM,
    "achieved_gbps": _NUM,
    "bytes_per_step": _NUM,
    "attention": (str,),
    "runtime": (str,),
    "label": (str,),
    "one_time": (dict,),
    "realized_projection_keep": _NUM,
    "kv_read_fraction": _NUM,
    "kv_budget": (int,),
    "peak_memory_bytes": (int,),
    "mode_spec": (str,),
    "compile_mode": (str,),
    "step_ms_median": _NUM,
    "model": (dict,),
    "dtype": (str,),
    "impl": (str,),
    "dense_step": (str,),
    "profile": (dict,),
    "phases": (dict,),
    "gpu_neighbors": (dict,),
    "timestamp": (str,),
    "batch": (int,),
    "realized_union": _NUM,
    "union_source": (str,),
}


@dataclass(frozen=True)
class CellExtras:
    """What our records add to a PaperCell; None where a record leaves a field out.

    bytes_per_step is in bytes, achieved_gbps in GB/s (decimal), byte_bound the
    speedup bound over dense from the byte account at the realized keeps (§3.3).
    """

    byte_bound: float | None = None
    achieved_gbps: float | None = None
    bytes_per_step: float | None = None
    attention: str | None = None
    runtime: str | None = None  # "CUDA graph", "compiled" or "eager"
    label: str | None = None
    one_time: dict = field(default_factory=dict)
    realized_projection_keep: float | None = None
    kv_read_fraction: float | None = None
    kv_budget: int | None = None
    peak_memory_bytes: int | None = None
    mode_spec: str | None = None
    compile_mode: str | None = None
    step_ms_median: float | None = None
    dtype: str | None = None
    obs: int | None = None  # the selection's observation window (the cell spec's obs)
    impl: str | None = None  # whose step: ours, or a peer (timing.peer)
    dense_step: str | None = None  # what runs the projections that hold no threshold
    profile: dict | None = None  # the step under torch.profiler (timing.profile), when asked
    gpu_neighbors: dict | None = None  # timing.neighbors: {'before', 'after'} the timed steps; None = no probe
    phases: dict | None = None  # where load and capture went: {'load': {...}, 'capture': {...}} (seconds)
    timestamp: str | None = None  # when the record was written (ISO 8601)
    timed_steps: int | None = None  # warm-up + repeats x steps of the cell spec, the steps it timed or warmed
    batch: int = 1  # sequences a step decoded (timing.batch_cell); ms_per_token divides the step by it
    realized_union: float | None = None  # a batch's union of kept projection rows (what its step reads)
    union_source: str | None = None  # whose activations gave that union (random weights or the model's own)


@dataclass(frozen=True)
class FailedCell:
    """A record with status 'failed': where it was meant to sit, and its error."""

    path: Path
    error: str
    group: str | None = None
    cell: str | None = None
    context: int | None = None
    block: int | None = None


@dataclass(frozen=True)
class MissingPair:
    """A sparse cell with no dense cell of the same group, context and block."""

    path: Path
    group: str
    cell: str
    context: int
    block: int


@dataclass(frozen=True)
class CampaignCells:
    """One campaign folder: ok cells, their extras, failed records and unpaired cells.

    ``source`` is 'sparsedecode' (kind 'timing_cell' records) or 'bytecross'
    (the paper's records). ``dims`` are the model's dimensions when the records
    carry them or the model name is in the known-model table; ``dims_note`` says
    where they came from, or why there are none.
    """

    folder: Path
    campaign: str
    source: str
    model: str
    gpu: str
    device: str
    cells: tuple[PaperCell, ...]
    extras: dict[Path, CellExtras]
    failed: tuple[FailedCell, ...]
    missing: tuple[MissingPair, ...]
    dims: ModelDims | None = None
    dims_note: str = ""
    retired: int = 0  # failed records the harness moved to DIR/failed/ before retrying the cell
    batched: int = 0  # cells of several sequences a step left out (load_cells(batched=False))

    @property
    def cpu(self) -> bool:
        """CPU cells time the reference path, not GPU speed; reports label them 'CPU'."""
        return self.device == "cpu" or self.gpu.upper() == "CPU"

    def extra(self, cell: PaperCell) -> CellExtras:
        return self.extras.get(cell.path, _NO_EXTRAS)

    def batch(self, cell: PaperCell) -> int:
        """Sequences a step of `cell` decoded (1 for the single-sequence protocol)."""
        return self.extra(cell).batch

    def paired(self) -> list[PaperCell]:
        """Dense cells and the sparse cells that have a dense partner."""
        unpaired = {m.path for m in self.missing}
        return [c for c in self.cells if c.path not in unpaired]


_NO_EXTRAS = CellExtras()


def _read_json(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"{path}: not a JSON timing record ({err})") from err
    if not isinstance(obj, dict):
        raise InputError(f"{path}: timing record is a {type(obj).__name__}, expected a JSON object")
    return obj


def check_ok_record(obj: dict, path: Path, campaign: str | None = None) -> tuple[PaperCell, CellExtras]:
    """The cell and extras of a finished ('ok') timing record, every field checked: the one
    validator of timing records that report, dispatch, merge, a resume and `campaign status`
    apply. Missing timing fields, NaN, infinity and non-positive times are refused (file and
    field named)."""
    campaign = campaign if campaign is not None else path.parent.parent.parent.name
    v = {name: record_field(obj, name, types, path, required=True) for name, types in _REQUIRED.items()}
    runs = check_runs(v["tokens_per_sec_runs"], path)
    check_positive(v, path)
    x = {name: record_field(obj, name, types, path, required=False) for name, types in _EXTRAS.items()}
    check_positive(x, path, ("step_ms_median", "bytes_per_step", "achieved_gbps", "byte_bound"))
    for k, t in (x["one_time"] or {}).items():
        if isinstance(t, bool) or (isinstance(t, int | float) and not (math.isfinite(t) and t >= 0)):
            raise InputError(f"{path}: field 'one_time.{k}' is {t}, expected a finite number of seconds >= 0")
    cell = PaperCell(
        campaign=campaign,
        path=path,
        gpu=v["gpu"],
        model=v["model_name"],
        mode=v["mode"],
        cell=v["cell"],
        group=v["group"],
        block=v["block"],
        context=v["context"],
        projection_keep=float(v["projection_keep"]),
        kv_keep=float(v["kv_keep"]),
        ms_per_token=float(v["ms_per_token"]),
        tokens_per_sec=float(v["tokens_per_sec"]),
        tokens_per_sec_runs=tuple(float(r) for r in runs),
        torch=obj["env"].get("torch") if isinstance(obj.get("env"), dict) else None,
    )
    floats = lambda k: None if x[k] is None else float(x[k])  # noqa: E731
    extras = CellExtras(
        byte_bound=floats("byte_bound"),
        achieved_gbps=floats("achieved_gbps"),
        bytes_per_step=floats("bytes_per_step"),
        attention=x["attention"],
        runtime=x["runtime"],
        label=x["label"],
        one_time=dict(x["one_time"] or {}),
        realized_projection_keep=floats("realized_projection_keep"),
        kv_read_fraction=floats("kv_read_fraction"),
        kv_budget=x["kv_budget"],
        peak_memory_bytes=x["peak_memory_bytes"],
        mode_spec=x["mode_spec"],
        compile_mode=x["compile_mode"],
        step_ms_median=floats("step_ms_median"),
        dtype=x["dtype"],
        obs=_spec_obs(obj),
        impl=x["impl"],
        dense_step=x["dense_step"],
        profile=x["profile"],
        gpu_neighbors=x["gpu_neighbors"],
        phases=x["phases"],
        timestamp=x["timestamp"],
        timed_steps=_spec_steps(obj),
        batch=x["batch"] if x["batch"] is not None else 1,
        realized_union=floats("realized_union"),
        union_source=x["union_source"],
    )
    if extras.batch < 1:
        raise InputError(f"{path}: field 'batch' is {extras.batch}, expected a number of sequences >= 1")
    return cell, extras


def _spec_obs(obj: dict) -> int | None:
    spec = obj.get("spec")
    obs = spec.get("obs") if isinstance(spec, dict) else None
    return obs if isinstance(obs, int) and not isinstance(obs, bool) else None


def _spec_steps(obj: dict) -> int | None:
    """warm-up + repeats x steps of the record's cell spec, when it has them."""
    spec = obj.get("spec")
    got = [spec.get(k) if isinstance(spec, dict) else None for k in ("warmup", "repeats", "steps")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in got):
        return None
    return got[0] + got[1] * got[2]


def _failed_cell(obj: dict, path: Path) -> FailedCell:
    error = obj.get("error")
    if not isinstance(error, str) or not error:
        raise InputError(f"{path}: failed timing record lacks field 'error' (a message)")
    get = lambda k, t: obj[k] if isinstance(obj.get(k), t) and not isinstance(obj[k], bool) else None  # noqa: E731
    return FailedCell(path, error, get("group", str), get("cell", str), get("context", int),
                      get("block", int))


def _record_files(folder: Path) -> list[Path]:
    """DIR/cells/**/*.json when DIR/cells exists, else DIR/*.json; hidden temp files skipped."""
    cells = folder / "cells"
    files = sorted(cells.rglob("*.json")) if cells.is_dir() else sorted(folder.glob("*.json"))
    return [f for f in files if not f.name.startswith(".")]


def _one(values: dict[str, Path], what: str, folder: Path) -> str:
    if len(values) > 1:
        listed = ", ".join(f"'{v}' ({p.name})" for v, p in sorted(values.items()))
        raise InputError(
            f"{folder}: records of several {what}s in one campaign folder: {listed}; "
            f"a report compares cells of one model on one GPU, so split the folder"
        )
    return next(iter(values))


def _dims(model: dict | None, name: str, where: Path | None) -> tuple[ModelDims | None, str]:
    """Dims from a record's model.dims (ModelDims fields or a HF config), else by known name.
    ModelDims fields that describe no model (zero KV heads, a field missing) are refused,
    never replaced by the known model's."""
    dims = (model or {}).get("dims") if isinstance(model, dict) else None
    if isinstance(dims, dict):
        if set(dims) <= set(ModelDims.__dataclass_fields__):
            return dims_from_dict(dims, str(where)), "dims from the records' model.dims"
        try:
            return ModelDims.from_config(dims, name=name), "dims from the records' model config"
        except InputError:
            pass
    return known_dims(name)


def known_dims(name: str) -> tuple[ModelDims | None, str]:
    """Dims of a model name such as 'Llama-3.1-8B-Instruct' from the known-model table.

    The paper's records name the released checkpoint; the table holds the same
    architecture under 'llama-3.1-8b' (an instruct model reads the bytes of its base).
    """
    key = name.strip().lower().rsplit("/", 1)[-1]
    for candidate in (key, key.removesuffix("-instruct")):
        try:
            m = known_model(candidate)
        except InputError:
            continue
        return ModelDims.from_config(m.config, name=m.name), f"dims of known model '{m.name}'"
    return None, f"model '{name}' is not in the known-model table and its records carry no dims"


def load_cells(folder: str | Path, batched: bool = False) -> CampaignCells:
    """Read a campaign folder of our 'timing_cell' records or of the paper's records.

    Cells of several sequences a step (`timing.batch_cell`) price another thing than a
    single-sequence step: they are left out, and counted in `batched`, unless `batched` (the
    timing report, which shows them per batch size).

    InputError for a missing or empty folder, a malformed record (file and field
    named), two records of one cell, and records of several models or GPUs.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(f"{folder}: campaign folder not found")
    files = _record_files(folder)
    if not files:
        raise InputError(
            f"{folder}: no timing records (expected cells/{{group}}/*.json from the timing "
            "harness, or the paper's *.json records)"
        )
    objs = [(f, _read_json(f)) for f in files]
    ours = [f for f, o in objs if o.get("kind") == KIND]
    if not ours and not (folder / "cells").is_dir():
        return _paper_cells(folder)
    for f, o in objs:
        if o.get("kind") != KIND:
            kind = repr(o["kind"]) if "kind" in o else "missing"
            raise InputError(f"{f}: field 'kind' is {kind}, expected '{KIND}'")
    campaign = folder.name
    cells, extras, failed, n_batched = [], {}, [], 0
    models, gpus, devices = {}, {}, {}
    model_obj, model_path = None, None
    for path, obj in objs:
        status = obj.get("status")
        if status not in ("ok", "failed"):
            raise InputError(f"{path}: field 'status' is {status!r}, expected 'ok' or 'failed'")
        for key, seen in (("model_name", models), ("gpu", gpus)):
            if isinstance(obj.get(key), str):
                seen.setdefault(obj[key], path)
        if status == "failed":
            failed.append(_failed_cell(obj, path))
            continue
        cell, extra = check_ok_record(obj, path, campaign)
        if extra.batch > 1 and not batched:
            n_batched += 1
            continue
        devices.setdefault(obj["device"], path)
        cells.append(cell)
        extras[path] = extra
        if model_obj is None and obj.get("model"):
            model_obj, model_path = obj["model"], path
    model = _one(models, "model", folder) if models else "unknown"
    gpu = _one(gpus, "GPU", folder) if gpus else "unknown"
    device = _one(devices, "device", folder) if devices else ("cpu" if gpu == "CPU" else "cuda")
    dims, note = _dims(model_obj, model, model_path)
    out = _finish(folder, campaign, "sparsedecode", model, gpu, device, cells, extras, failed,
                  dims, note)
    retired = folder / "failed"
    n_retired = sum(1 for _ in retired.rglob("*.json")) if retired.is_dir() else 0
    return replace(out, retired=n_retired, batched=n_batched)


def _paper_cells(folder: Path) -> CampaignCells:
    cells = load_campaign(folder)
    models = {c.model: c.path for c in reversed(cells)}
    gpus = {c.gpu: c.path for c in reversed(cells)}
    model, gpu = _one(models, "model", folder), _one(gpus, "GPU", folder)
    dims, note = known_dims(model)
    return _finish(folder, folder.name, "bytecross", model, gpu, "cuda", cells, {}, [], dims, note)


def _finish(folder, campaign, source, model, gpu, device, cells, extras, failed, dims, note):
    seen: dict[tuple, Path] = {}
    for c in cells:
        key = (c.group, c.cell, c.context, c.block)
        if key in seen:
            raise InputError(
                f"{c.path}: cell '{c.cell}' of group '{c.group}' at context {c.context}, block "
                f"{c.block} was also recorded in {seen[key]}; cells differing by attention path "
                "or other settings belong in different groups"
            )
        seen[key] = c.path
    dense = {(c.group, c.context, c.block) for c in cells if c.mode == "dense"}
    missing = [
        MissingPair(c.path, c.group, c.cell, c.context, c.block)
        for c in cells
        if c.mode != "dense" and (c.group, c.context, c.block) not in dense
    ]
    order = lambda c: (c.group, c.cell, c.context, c.block)  # noqa: E731
    return CampaignCells(
        folder=folder,
        campaign=campaign,
        source=source,
        model=model,
        gpu=gpu,
        device=device,
        cells=tuple(sorted(cells, key=order)),
        extras=extras,
        failed=tuple(sorted(failed, key=lambda f: str(f.path))),
        missing=tuple(sorted(missing, key=order)),
        dims=dims,
        dims_note=note,
    )


__all__ = ["KIND", "CampaignCells", "CellExtras", "FailedCell", "MissingPair", "check_ok_record", "known_dims",
           "load_cells"]
