"""JSON records: one file per timing cell or quality run (DESIGN.md 'Records').

Written atomically (temp file + rename) so an interrupted campaign loses
nothing, never overwritten, and stamped with the environment that made them.
Imports no torch at module level; `environment()` reports torch/triton/GPU
only when torch is already importable.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import tempfile
from importlib import metadata
from pathlib import Path

from sparsedecode.errors import InputError

SCHEMA = 1


def git_commit(cwd: str | os.PathLike | None = None) -> str | None:
    """HEAD of the checkout the package runs from, with '-dirty' when it has edits.

    $SPARSEDECODE_GIT_COMMIT wins when set: a copy of the tree without its history
    (a remote GPU machine) can still stamp the commit it was sent from.
    """
    if os.environ.get("SPARSEDECODE_GIT_COMMIT"):
        return os.environ["SPARSEDECODE_GIT_COMMIT"]
    where = cwd or Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=5
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=where,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    if len(sha) != 40:  # not a commit: no repository, or one without history
        return None
    return sha + ("-dirty" if dirty else "")


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def environment(with_torch: bool = True) -> dict:
    """Versions, host and accelerator of this process, for a record's `env`."""
    env = {
        "python": platform.python_version(),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "sparsedecode": _version("sparsedecode"),
        "transformers": _version("transformers"),
        "git_commit": git_commit(),
    }
    if with_torch:
        try:
            import torch
        except ImportError:
            return env
        env["torch"] = torch.__version__
        env["triton"] = _version("triton")
        env["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name()
            env["cuda"] = torch.version.cuda
        else:
            env["gpu"] = None
    return env


def stamp(record: dict, with_torch: bool = True) -> dict:
    """`record` with schema, timestamp and environment added (a new dict)."""
    out = {"schema": SCHEMA, **record}
    out.setdefault("timestamp", _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    out.setdefault("env", environment(with_torch))
    return out


def write_record(path: str | os.PathLike, record: dict, overwrite: bool = False) -> Path:
    """Write `record` as JSON at `path` atomically; refuse to overwrite unless asked."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise InputError(f"record {path} exists; records are never overwritten (pick a new path)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1, sort_keys=False, default=_jsonable)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_record(path: str | os.PathLike) -> dict:
    """The record at `path`; an InputError naming the file when it is not a record."""
    from sparsedecode.textfile import read_json

    rec = read_json(path, "record")
    if not isinstance(rec, dict) or "kind" not in rec:
        raise InputError(f"{path} is not a sparsedecode record (no 'kind' field)")
    return rec


def json_line(x) -> str:
    """`x` as one line of JSON (tensors and arrays as lists, paths as strings), as records are."""
    return json.dumps(x, default=_jsonable)


def _jsonable(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON-serialisable: {type(x).__name__}")
