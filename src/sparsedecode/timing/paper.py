"""Importer for the ByteCross paper's own timing records (arXiv 2609.33889).

The paper's repository keeps one JSON object per timing cell under
``records/<campaign>/`` (RECORDS_README.md, "Timing campaigns"). Its ``block``,
``group`` and ``cell`` fields pair every sparse cell with the dense cell of the
same block and context (App. A "Timing"); the crossing campaigns of App. E hold
only the projection and selection cells. This module reads them into plain
frozen dataclasses and nothing else: the statistics live in ``stats.py``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from sparsedecode.errors import InputError

# field -> accepted JSON types; bool is excluded from numbers below.
_REQUIRED: dict[str, tuple[type, ...]] = {
    "mode": (str,),
    "context": (int,),
    "projection_keep": (int, float),
    "kv_keep": (int, float),
    "tokens_per_sec": (int, float),
    "tokens_per_sec_runs": (list,),
    "ms_per_token": (int, float),
    "model": (str,),
    "gpu": (str,),
    "block": (int,),
    "group": (str,),
    "cell": (str,),
}
_OPTIONAL_INT = ("keep_tokens", "static_tokens", "allocated_tokens")
_OPTIONAL_FLOAT = ("prefill_seconds", "gather_seconds")


@dataclass(frozen=True)
class PaperCell:
    """One timed cell: a fresh process that decoded at one context in one block.

    ``ms_per_token`` is the paper's step time, 1000 / mean of the five repeat
    throughputs ``tokens_per_sec_runs`` (tok/s, each a repeat of 50 steps).
    """

    campaign: str  # folder name, e.g. "crossing_a100_1"; a launch of App. E
    path: Path
    gpu: str
    model: str
    mode: str  # dense | proj | sel | both | window
    cell: str  # e.g. "dense", "proj50", "sel30", "p50_s30"
    group: str  # pairs cells of one campaign, e.g. "sweep", "p70_s30"
    block: int
    context: int  # tokens
    projection_keep: float
    kv_keep: float
    ms_per_token: float
    tokens_per_sec: float
    tokens_per_sec_runs: tuple[float, ...]
    keep_tokens: int | None = None
    static_tokens: int | None = None
    allocated_tokens: int | None = None
    prefill_seconds: float | None = None
    gather_seconds: float | None = None
    torch: str | None = None


def record_field(obj: dict, name: str, types: tuple[type, ...], path: Path, *, required: bool):
    """Field `name` of a timing record when it has one of `types` (never a bool); a missing or
    null field is an error when `required`, else None. Shared by this importer and our
    campaign reader (timing/cells.py)."""
    value = obj.get(name)
    if value is None:
        if required:
            raise InputError(f"{path}: timing record lacks field '{name}'")
        return None
    if isinstance(value, bool) or not isinstance(value, types):
        raise InputError(
            f"{path}: field '{name}' is {value!r}, expected {'/'.join(t.__name__ for t in types)}"
            + ("" if required else " or null")
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(f"{path}: field '{name}' is {value}, expected a finite number")
    return value


TIMES = ("ms_per_token", "tokens_per_sec", "context")  # positive in every finished record


def check_positive(values: dict, path: Path, names=TIMES) -> None:
    """Each of `names` in `values` (already typed by record_field) is > 0 when present."""
    for name in names:
        v = values.get(name)
        if v is not None and not v > 0:
            raise InputError(f"{path}: field '{name}' is {v!r}, expected a positive number")


def _field(obj: dict, name: str, types: tuple[type, ...], path: Path):
    return record_field(obj, name, types, path, required=True)


def _optional(obj: dict, name: str, types: tuple[type, ...], path: Path):
    return record_field(obj, name, types, path, required=False)


def check_runs(runs: list, path: Path) -> list:
    """`runs` (a record's tokens_per_sec_runs) when it is a non-empty list of positive numbers."""
    if not runs or not all(
        isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and r > 0 for r in runs
    ):
        raise InputError(
            f"{path}: field 'tokens_per_sec_runs' must be a non-empty list of positive finite numbers"
        )
    return runs


def read_cell(path: str | Path, campaign: str | None = None) -> PaperCell:
    """Parse one timing record; InputError names the file and the bad field."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise InputError(f"{path}: timing record not found") from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: not a JSON timing record ({err})") from err
    if not isinstance(obj, dict):
        raise InputError(f"{path}: timing record is a {type(obj).__name__}, expected a JSON object")
    v = {name: _field(obj, name, types, path) for name, types in _REQUIRED.items()}
    runs = check_runs(v["tokens_per_sec_runs"], path)
    check_positive(v, path)
    return PaperCell(
        campaign=campaign if campaign is not None else path.parent.name,
        path=path,
        gpu=v["gpu"],
        model=v["model"],
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
        **{k: _optional(obj, k, (int,), path) for k in _OPTIONAL_INT},
        **{k: _optional(obj, k, (int, float), path) for k in _OPTIONAL_FLOAT},
        torch=_optional(obj, "torch", (str,), path),
    )


def load_campaign(folder: str | Path) -> list[PaperCell]:
    """All ``*.json`` cells of one campaign folder, sorted by (group, cell, context, block)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(
            f"{folder}: campaign folder not found (expected a folder of ByteCross *.json timing records)"
        )
    files = sorted(folder.glob("*.json"))
    if not files:
        raise InputError(f"{folder}: campaign folder holds no *.json timing records")
    cells = [read_cell(f, campaign=folder.name) for f in files]
    return sorted(cells, key=lambda c: (c.group, c.cell, c.context, c.block))


def load_records(root: str | Path, campaigns: list[str] | tuple[str, ...]) -> list[PaperCell]:
    """Cells of several campaign folders under ``root`` (the paper's ``records/``)."""
    root = Path(root)
    if not root.is_dir():
        raise InputError(f"{root}: records folder not found")
    return [cell for name in campaigns for cell in load_campaign(root / name)]
