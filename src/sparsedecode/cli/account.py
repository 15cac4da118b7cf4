"""`sparsedecode account`: the byte account on the command line (being written)."""
