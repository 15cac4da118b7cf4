"""Model loading (HF folders, hub ids, GGUF, embedded PyPI defaults) and the compact decoder."""
