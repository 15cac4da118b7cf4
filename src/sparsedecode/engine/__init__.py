"""The decode loop: chunked prefill, captured decode step, sampling and generation.

`load(ref, ...)` returns an `Engine` (see engine/engine.py); decode attention
backends live in models/attention.py.
"""

from sparsedecode.engine.engine import DEFAULT_MAX_LEN, Engine, Generation, load

__all__ = ["DEFAULT_MAX_LEN", "Engine", "Generation", "load"]
