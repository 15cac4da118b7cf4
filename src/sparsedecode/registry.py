"""Methods found by name: a lazy name -> class map and the one way to build from it.

Calibrators (projection/) and KV selectors (kv/) are dataclasses in files of
their own; their base modules hold a `Registry` of "module:Class" paths, and
the method modules import the base, so classes are imported on first use.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Mapping
from dataclasses import fields

from sparsedecode.errors import InputError


class Registry(Mapping):
    """Name -> class, importing a method's module on first use; `what` names the kind."""

    def __init__(self, what: str, paths: dict[str, str]):
        self.what = what
        self._paths = paths

    def __getitem__(self, name: str) -> type:
        module, cls = self._paths[name].split(":")
        return getattr(importlib.import_module(module), cls)

    def __iter__(self):
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)

    def build(self, name: str, **params):
        """The method `name` built from its fields; an unknown name suggests a close one and
        an unknown field lists the known ones."""
        if name not in self:
            close = difflib.get_close_matches(name, list(self), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise InputError(f"unknown {self.what} '{name}': {hint}choose one of {', '.join(self)}")
        cls = self[name]
        known = [f.name for f in fields(cls)]
        unknown = [k for k in params if k not in known]
        if unknown:
            raise InputError(f"{name} has no option {', '.join(unknown)}; its options are {', '.join(known)}")
        return cls(**params)


__all__ = ["Registry"]
