"""Placeholder: commands of `sparsedecode eval` (issue 7), filled in by their own change."""

from __future__ import annotations

from sparsedecode.cli.eval import eval_app  # noqa: F401  (commands register on it)
