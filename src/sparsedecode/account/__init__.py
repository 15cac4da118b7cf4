"""The byte account of a decode step (ByteCross §3.1-3.3, §4.3, App. A, App. C).

Pure Python: imports neither torch nor numpy, so it answers instantly and runs
anywhere.
"""

from sparsedecode.account.dims import ModelDims, load_config, resolve_dims
from sparsedecode.account.known import KNOWN_MODELS, KnownModel, known_model

__all__ = ["KNOWN_MODELS", "KnownModel", "ModelDims", "known_model", "load_config", "resolve_dims"]
