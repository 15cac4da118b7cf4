"""The decode loop: chunked prefill, captured decode step, sampling and generation.

`load(ref, ...)` (engine/loader.py) returns an `Engine` (engine/engine.py); decode attention
backends live in models/attention.py.
"""

from sparsedecode.engine.engine import DEFAULT_MAX_LEN, Engine, Generation
from sparsedecode.engine.loader import cache_length, load

__all__ = ["DEFAULT_MAX_LEN", "Engine", "Generation", "cache_length", "load"]
