"""The sparsedecode cache folder and the content hash its files are checked by.

Everything the package writes for later runs lives under one root: the embedded models'
weights (`models/`), converted checkpoints, the inductor cache, calibrated thresholds and the
shipped text once unpacked (`data/`). It imports nothing of the package, so every floor may use it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of the sparsedecode cache: $SPARSEDECODE_CACHE or ~/.cache/sparsedecode."""
    env = os.environ.get("SPARSEDECODE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sparsedecode"


def sha256_of(path: str | os.PathLike) -> str:
    """sha256 (hex) of a file's bytes, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            h.update(block)
    return h.hexdigest()


__all__ = ["cache_dir", "sha256_of"]
