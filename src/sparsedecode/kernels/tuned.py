"""The sparse GEMV's measured tile configs, one JSON file per device under `kernels/tuned/`
(written by `benchmarks/kernels/sparse_gemv_bench.py --choose`; docs/kernels/sparse_gemv.md):
{"rows": [{"K", "N", "dtype", "sm_count", "config"}]}, config = (BLOCK_N, BLOCK_K, splits,
num_warps, num_stages)."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

TUNED_DIR = Path(__file__).with_name("tuned")  # one JSON file of measured tile configs per device


def tuned_file(name: str) -> Path:
    """The tuned-config file of a device named `name` (torch.cuda.get_device_name)."""
    return TUNED_DIR / (re.sub(r"[^A-Za-z0-9]", "_", name) + ".json")


def read_tuned(path) -> dict[tuple[int, int, str, int], tuple[int, int, int, int, int]]:
    """(K, N, dtype name, SM count) -> (BLOCK_N, BLOCK_K, splits, num_warps, num_stages) of a
    tuned file, as `sparse_gemv_bench.py --choose` writes it."""
    rows = json.loads(Path(path).read_text())["rows"]
    return {(r["K"], r["N"], r["dtype"], r["sm_count"]): tuple(r["config"]) for r in rows}


@functools.cache
def tuned_configs(name: str) -> dict[tuple[int, int, str, int], tuple[int, int, int, int, int]]:
    """The measured configs shipped for the device named `name` (none for a device without a file)."""
    path = tuned_file(name)
    return read_tuned(path) if path.exists() else {}


__all__ = ["TUNED_DIR", "read_tuned", "tuned_configs", "tuned_file"]
