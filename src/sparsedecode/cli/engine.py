"""`sparsedecode generate` and `sparsedecode models` (filled by the engine work, issue 3)."""
