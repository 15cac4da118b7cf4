"""sparsedecode: faster single-sequence LLM decoding by reading fewer bytes per step.

Importing the package is cheap: the byte account (`sparsedecode.account`) is
pure Python, and the torch-based engine is imported only when first used.
"""

__version__ = "0.1.0"


def load(*args, **kwargs):
    """Load a model into an `Engine` (see `sparsedecode.engine.load`)."""
    from sparsedecode.engine import load as _load

    return _load(*args, **kwargs)


from sparsedecode.config import KVConfig, ProjectionConfig, SparsityConfig  # noqa: E402 (torch-free)

__all__ = ["KVConfig", "ProjectionConfig", "SparsityConfig", "__version__", "load"]
