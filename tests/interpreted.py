"""Run a test module's worker in a subprocess under TRITON_INTERPRET=1 (Triton on CPU).

The interpreter is chosen when @triton.jit runs, at import, so a test that wants it
starts a fresh interpreter; the worker prints one JSON line, its report, last.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_interpreted(test_file: str, worker: str, timeout: float = 300) -> dict:
    """Call `worker()` of the module at `test_file` with TRITON_INTERPRET=1; its JSON report.

    Skips where the interpreter cannot run: Triton <= 3.6 turns 1-element arrays into loop
    bounds with int(), which NumPy >= 2.4 refuses (the H200 machine's Triton 3.6 with a newer
    NumPy); CI runs these tests on its own Triton.
    """
    import numpy
    import triton

    version = lambda v: tuple(int(p) for p in v.split(".")[:2])  # noqa: E731
    if version(triton.__version__) <= (3, 6) and version(numpy.__version__) >= (2, 4):
        pytest.skip(f"Triton {triton.__version__}'s interpreter does not run on NumPy {numpy.__version__}")
    path = Path(test_file).resolve()
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    dirs = [str(path.parent), str(Path(__file__).resolve().parent)]  # the test's folder and tests/
    code = f"import sys; sys.path[:0] = {dirs!r}; import {path.stem} as t; t.{worker}()"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])
