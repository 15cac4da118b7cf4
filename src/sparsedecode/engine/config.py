"""What a decode step reads: the projection branch, the KV branch, both or neither (ByteCross §4).

`SparsityConfig(projection=..., kv=KVConfig(...))` names a mode: `dense`, `proj`
(input-sparse projections), `sel` (attention-scored KV selection), `window`
(sink + recent window), `both` (projection and selection) or `proj+window`;
with `routing` (token routing between the dense MLP and CATS thresholds, SATS
paper §3.2) the mode gains a `+route` suffix. `Engine.configure(config)`
installs it; every mode runs in the same captured decode step through the same
attention backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sparsedecode.account.units import check_keep
from sparsedecode.errors import InputError


@dataclass(frozen=True)
class KVConfig:
    """A KV selector by name (`kv.SELECTORS`), its keep ratio and its fields."""

    method: str
    keep: float
    params: dict = field(default_factory=dict)

    def __post_init__(self):
        check_keep(self.keep, "kv keep")


@dataclass(frozen=True)
class SparsityConfig:
    """projection: a `Thresholds` or a thresholds file (None: dense projections);
    kv: a `KVConfig` (None: the decode step reads the whole cache); routing: a calibrated
    `projection.routing.RoutingTable` or its file, which routes each decode step to the
    dense MLP or to the CATS `projection` by its token id (None: every step sparse)."""

    projection: object = None
    kv: KVConfig | None = None
    routing: object = None

    def __post_init__(self):
        if self.routing is not None and self.projection is None:
            raise InputError(
                "token routing chooses between the dense MLP and CATS thresholds: give the "
                "thresholds too (SparsityConfig(projection=FILE, routing=TABLE))"
            )

    @property
    def mode(self) -> str:
        proj = self.projection is not None
        kv = None if self.kv is None or self.kv.keep >= 1.0 else (
            "window" if self.kv.method == "window" else "sel")
        route = "+route" if self.routing is not None else ""
        if proj and kv:
            return ("both" if kv == "sel" else "proj+window") + route
        return "proj" + route if proj else kv or "dense"


__all__ = ["KVConfig", "SparsityConfig"]
