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


def run_interpreted(test_file: str, worker: str, timeout: float = 300) -> dict:
    """Call `worker()` of the module at `test_file` with TRITON_INTERPRET=1; its JSON report."""
    path = Path(test_file).resolve()
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    dirs = [str(path.parent), str(Path(__file__).resolve().parent)]  # the test's folder and tests/
    code = f"import sys; sys.path[:0] = {dirs!r}; import {path.stem} as t; t.{worker}()"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])
