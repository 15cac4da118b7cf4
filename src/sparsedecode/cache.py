"""Where sparsedecode keeps what it fetches or builds: $SPARSEDECODE_CACHE or ~/.cache/sparsedecode."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of the sparsedecode cache: $SPARSEDECODE_CACHE or ~/.cache/sparsedecode."""
    env = os.environ.get("SPARSEDECODE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sparsedecode"
