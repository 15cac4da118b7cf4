"""Shared helpers of the dispatch tests: the paper's record folders and small tables."""

from pathlib import Path

import pytest

from sparsedecode.account import ModelDims

RECORDS = Path(__file__).resolve().parents[2] / "data/bytecross"
CPU_CELLS = Path(__file__).resolve().parents[2] / "benchmarks/records/cpu/dispatch/cpu_gate_smollm2"


def paper(name: str) -> Path:
    path = RECORDS / name
    if not path.is_dir():
        pytest.skip(f"ByteCross records not found at {path} (data/bytecross in the checkout)")
    return path


def dims(**kw) -> ModelDims:
    base = dict(name="m", n_layers=2, d=64, d_ff=128, n_heads=4, n_kv_heads=2, head_dim=16, vocab=100)
    return ModelDims(**{**base, **kw})
