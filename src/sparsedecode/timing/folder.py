"""The files of a campaign folder: DIR/spec.toml, DIR/cells/{group}/*.json and DIR/failed/{group}/
(ByteCross App. A 'Timing': every cell a record, failed attempts kept). Shared by a run, which
binds its spec and retires failed records before retrying them (timing/campaign.py), and by a
merge of runs made elsewhere (timing/merge.py)."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import fields, replace
from pathlib import Path

from sparsedecode.timing.spec import CampaignSpec


def spec_differences(saved: CampaignSpec, spec: CampaignSpec) -> list[str]:
    """The fields in which `spec` is another campaign than `saved`. shared_gpu is a policy of
    the run, not part of what is measured (each record keeps its cell's policy and what it saw),
    so runs of one campaign may differ in it."""
    old = replace(saved, shared_gpu=spec.shared_gpu)
    return [f.name for f in fields(CampaignSpec) if getattr(old, f.name) != getattr(spec, f.name)]


def write_atomic(path: Path, data: bytes) -> None:
    """`data` at `path` through a temporary file beside it: a reader sees the old file or the new."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_cell(path: Path) -> dict | None:
    """The record at `path`, or None when it is unreadable, not UTF-8, not JSON or not an object."""
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def finished(path: Path) -> tuple[dict | None, str | None]:
    """(record, None) when the record at `path` is a finished cell: kind 'timing_cell', status
    'ok' and every timing field present, finite and positive (`cells.check_ok_record`, as
    report and dispatch check it); otherwise (the record or None, why it is not). A record
    that only says {"status": "ok"} is not a finished cell: a resume moves it to DIR/failed/
    and runs the cell again."""
    from sparsedecode.errors import InputError
    from sparsedecode.timing.cells import KIND, check_ok_record

    rec = read_cell(path)
    if rec is None:
        return None, "unreadable record (not UTF-8 JSON holding an object)"
    if rec.get("status") != "ok":
        return rec, str(rec.get("error") or f"status {rec.get('status')!r}")
    if rec.get("kind") != KIND:
        return rec, f"incomplete record: kind {rec.get('kind')!r}, expected '{KIND}'"
    try:
        check_ok_record(rec, path)
    except InputError as e:
        return rec, f"incomplete record: {e}"
    return rec, None


def failed_path(folder: Path, group: str, stem: str, taken=()) -> Path:
    """DIR/failed/{group}/{stem}.{k}.json with the first k free on disk and not in `taken`."""
    k = 1
    while (p := folder / "failed" / group / f"{stem}.{k}.json").exists() or p in taken:
        k += 1
    return p


def retire(folder: Path, path: Path) -> Path:
    """Move a failed (or unreadable) record to DIR/failed/{group}/, under a new name."""
    dest = failed_path(folder, path.parent.name, path.stem)
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.rename(path, dest)
    return dest


__all__ = ["failed_path", "finished", "read_cell", "retire", "spec_differences", "write_atomic"]
