"""What a decode step reads, installed on an `Engine`: the projection branch (ByteCross §3.2:
sparse projections, CATS, token routing per SATS paper §3.2), the one installer `configure`
(a `config.SparsityConfig`), the layouts kept for the runtime gate (`keep_states`, ByteCross
§3.3) and what harnesses ask of the cache (a random fill, the realized projection keep). A mixin
of `Engine`, apart so engine.py stays the decode loop."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from sparsedecode.errors import InputError, option

CPU_STEP_APART = ("cpu.step=true with lora.merge=false: the C step reads the base weights only and takes no "
                  "adapter apart; drop cpu.step=true (the PyTorch step runs it) or merge")


class Branches:
    """The branch-installing half of `Engine` (engine/engine.py holds its state)."""

    def sparsify(self, thresholds) -> None:
        """Run the projection branch in the decode step (ByteCross §3.2): each site whose
        threshold `thresholds` (a `Thresholds` or a path to one) holds reads only the weight
        rows of input channels above it; a CATS file (sites 'act') drops MLP channels with
        |SiLU(gate)| at or below its threshold (`projection.cats_runtime`). Prefill stays
        dense. Thresholds of other dims are refused. A file with the sites of the one
        installed only updates the thresholds in place. The decode step is compiled and
        captured again on its next call."""
        from sparsedecode.projection.cats_runtime import cats_
        from sparsedecode.projection.sparse_linear import sparsify_
        from sparsedecode.projection.thresholds import ACT_SITE, Thresholds

        th = thresholds if isinstance(thresholds, Thresholds) else Thresholds.load(thresholds)
        th.validate(self.dims)
        sites = set(th.sites)
        if ACT_SITE in sites and sites != {ACT_SITE}:
            raise InputError("a thresholds file holds CATS ('act') or input-site thresholds, not both")
        if (ACT_SITE in sites) != (self.linear_needed_by == "CATS thresholds") and self._layouts is None:
            old, self.thresholds = self.thresholds, None  # laid out anew below: set_kernels must not put it back
            try:
                self.need_linear("CATS thresholds" if ACT_SITE in sites else None)  # the dense MLP beside CATS
            except InputError:
                self.thresholds = old
                raise
        if self.thresholds is None or set(self.thresholds.sites) != sites:
            self._dense_projections()  # from the dense model: nothing of an earlier file stays
        # else the same sites are sparse already: their thresholds are set in place below, and
        # no weight is laid out again (a sweep over keeps costs no copies)
        if ACT_SITE in sites:
            for mlp in cats_(self.model, th.values):
                mlp.set_router(self.router)  # routing, if on, follows the new thresholds
        else:
            self.route(None)  # routing picks between dense and CATS MLPs only
            if sites:
                sparsify_(self.model, th.values, ff_only=not sites - {"gate", "up", "down"}, gemv=self.kernels.gemv)
        self.thresholds = th
        self._graph = None
        self.attach_adapter()

    def _dense_projections(self) -> None:
        """Dense projections and MLPs everywhere (undoes `sparsify`): nn.Linear, or the GEMV
        reading every row under gemv.dense."""
        from sparsedecode.projection.cats_runtime import uncats_
        from sparsedecode.projection.sparse_linear import dense_projections_

        uncats_(self.model)
        dense_projections_(self.model, self.kernels.gemv)
        self.attach_adapter()

    def attach_adapter(self) -> int:
        """Put the loaded adapter's factors on every adapted site that lacks them, where the engine
        runs its adapter apart (lora.merge=false; `projection.lora_attach`): after load and after
        each change of projection modules (`configure`, `sparsify`, `set_kernels`), so every layout
        runs base + adapter. A dense site becomes the GEMV that reads every row. Returns the sites
        attached now (0 where merged, or all hold theirs). The C step reads base weights only:
        cpu.step=true asked for is refused here, before any work."""
        if not self._apart():
            return 0
        if self.kernels_asked.cpu.step:  # at load; set_kernels refuses it afterwards
            raise InputError(CPU_STEP_APART)
        from sparsedecode.projection.lora_attach import attach_lora_

        sites = [k for k in self.adapter.factors if not self._holds_adapter(k)]
        if not sites:
            return 0

        a = self.adapter
        attach_lora_(self.model, {k: (a.factors[k].A, a.factors[k].B) for k in sites},
                     {k: a.factors[k].scale for k in sites})
        self._graph = None
        return len(sites)

    def _holds_adapter(self, key: str) -> bool:
        """Whether the site at module path `key` holds its adapter already (a CATS MLP holds up's)."""
        from sparsedecode.projection.cats_runtime import CatsMLP
        from sparsedecode.projection.lora_site import LoraSite

        mod = self.model.get_submodule(key)
        if isinstance(mod, LoraSite):
            return mod.has_lora
        parent = self.model.get_submodule(key.rsplit(".", 1)[0])
        return isinstance(parent, CatsMLP) and key.endswith("up_proj") and parent.has_up_lora

    def _check_lora_kernels(self, kernels) -> None:
        """What `set_kernels` refuses of a loaded adapter: another lora.merge (fixed for the engine's
        life), and cpu.step=true while it runs apart."""
        if self.adapter is not None and kernels.lora.merge != self.kernels.lora.merge:
            raise InputError(f"lora.merge={str(kernels.lora.merge).lower()}: this engine loaded adapter "
                             f"{self.adapter.path} {'merged' if self.kernels.lora.merge else 'apart'}, for its life; "
                             "load the model again with the option")
        if self._apart() and kernels.cpu.step:
            raise InputError(CPU_STEP_APART)

    def _apart(self) -> bool:
        """Whether the engine runs a loaded adapter apart from the weights (lora.merge=false)."""
        return self.adapter is not None and not self.kernels.lora.merge

    def projection_runtime(self) -> str | None:
        """What runs the projection branch's one-token calls (`projection.sparse_linear.runtime`),
        for users and records; None without the projection branch."""
        from sparsedecode.projection.sparse_linear import runtime

        return None if self.thresholds is None else runtime(self.thresholds, self.device, self.dtype)

    def route(self, table) -> None:
        """Token routing (SATS paper §3.2): each decode step runs the dense MLP or the CATS
        path by a lookup of its token id in `table` (a calibrated `RoutingTable` or its file;
        None turns routing off). Needs CATS-style thresholds installed (`sparsify`); the
        table must match this model's vocabulary and tokenizer. Prefill stays dense.
        `routed_fraction` reads the share of decode steps routed sparse since then."""
        from sparsedecode.projection.cats_runtime import CatsMLP, Router
        from sparsedecode.projection.routing import routing_for

        if table is None:
            if self.router is not None:
                for layer in self.model.layers:
                    if isinstance(layer.mlp, CatsMLP):
                        layer.mlp.set_router(None)
                self.router = self.routing = None
                self._graph = None
            return
        table = routing_for(table, self)
        self.router = Router(table.sparse_of(), self._tok)
        for layer in self.model.layers:
            layer.mlp.set_router(self.router)
        self.routing = table
        self._graph = None

    def routed_fraction(self) -> float:
        """Decode steps routed to the sparse path over decode steps since `route` (or
        `reset_routed`); nan before any step or without routing. Reads a device counter."""
        return float("nan") if self.router is None else self.router.fraction()

    def routing_summary(self, table_file: str | None = None) -> dict | None:
        """What routing does, for records: the table's file, tau, target, its calibrated
        routed fraction and the fraction of decode steps routed sparse so far (None where
        there is none yet); None without routing."""
        if self.routing is None:
            return None
        steps = self.routed_fraction()
        return {"table": table_file, "tau": self.routing.tau, "target": self.routing.target,
                "calibrated_fraction": self.routing.routed,
                "decode_steps_sparse": None if steps != steps else round(steps, 4)}

    def reset_routed(self) -> None:
        """Zero the routed-step counter."""
        if self.router is not None:
            self.router.reset()

    def configure(self, config, *, thresholds=None, routing=None, progress: bool = False):
        """The one installer: make the decode step read what `config` (a `SparsityConfig` or its
        text, `sparsedecode.config`) names, and return the parsed config (`self.config`).

        The projection branch is installed now: `thresholds` (calibrated `Thresholds` for it) when
        given, else the config's thresholds file, else TEAL thresholds at its keep calibrated once
        on WikiText-2 validation and cached (`projection.calibrate.cached_teal`). Token routing
        likewise (`routing`, a `RoutingTable`, or the config's table file). The KV branch runs
        after each prompt's prefill (`tokens`). Under `keep_states` (the runtime gate) a layout of
        projection modules built once is swapped back by reference and its thresholds refilled
        in place, never rebuilt.

        An adapter (lora[DIR]) is loaded with the model and fixed for the engine's life (merged into
        the weights, or with lora.merge=false attached again to whatever sites this installs): a
        config without one runs the loaded one (and says so: `self.config` holds it), one naming
        another adapter is refused (load again with it)."""
        from sparsedecode.config import SparsityConfig
        from sparsedecode.projection.routing import RoutingTable
        from sparsedecode.projection.thresholds import Thresholds

        config = self._with_adapter(SparsityConfig.parse(config if config is not None else "dense"))
        if config.kv is not None:
            from sparsedecode.kv.select import get_selector

            get_selector(config.kv.method, **config.kv.params)  # an unknown selector or field fails here
        p, th, table = config.projection, None, None
        if p is not None and p == self.config.projection and thresholds is None and routing is None:
            th, table = self.thresholds, self.routing  # installed already: nothing to load or calibrate
        elif p is not None:
            th = thresholds if thresholds is not None else self._thresholds_of(p, progress)
            if not isinstance(th, Thresholds):
                th = Thresholds.load(th)
            if p.keep is not None and abs(th.keep - p.keep) > 1e-9:
                raise InputError(f"{config}: the thresholds given were calibrated at keep {th.keep:g}, "
                                 f"not {p.keep:g}")
            table = routing if routing is not None else p.routing
            if table is not None and not isinstance(table, RoutingTable):
                table = RoutingTable.load(table)
        elif thresholds is not None or routing is not None:
            raise InputError(f"{config} has no projection branch: thresholds and routing go with proj[...]")
        if p == self.config.projection and th is self.thresholds and table is self.routing:
            self.kv_config, self.config = config.kv, config  # the projection branch stays as installed
            return config
        if table is None:
            self.route(None)
        self._lay_out(th)
        if table is not None:
            self.route(table)
        self.kv_config = config.kv
        self.config = config
        return config

    def _with_adapter(self, config):
        """`config` with the loaded adapter's lora[DIR] part; another adapter is refused."""
        from sparsedecode.projection.lora import same_adapter

        loaded = None if self.adapter is None else str(self.adapter.path)
        if config.adapter is None:
            return config if loaded is None else config.with_(adapter=loaded)
        if loaded is None:
            raise InputError(f"{config}: an adapter is loaded with the model, and this "
                             f"engine loaded none; load with {option('adapter', config.adapter)} (or the "
                             "lora[...] part in the load's config)")
        if not same_adapter(config.adapter, loaded):
            raise InputError(f"{config}: this engine loaded adapter {loaded} and runs it for its life; "
                             f"load the model again with {option('adapter', config.adapter)}")
        return config.with_(adapter=loaded)

    def _thresholds_of(self, p, progress: bool):
        """Thresholds for a ProjectionConfig: its file, or cached TEAL at its keep."""
        from sparsedecode.projection.thresholds import Thresholds

        if p.file is not None:
            return Thresholds.load(p.file)
        from sparsedecode.projection.calibrate import cached_teal

        return cached_teal(self, p.keep, progress=progress)

    def _lay_out(self, th) -> None:
        """Projection modules for `th` (None: dense). Under keep_states a layout of the same sites
        built before is swapped back by reference and only its thresholds are refilled."""
        from sparsedecode.projection.sparse_linear import sparsify_
        from sparsedecode.projection.thresholds import ACT_SITE

        sites = frozenset(th.sites) if th is not None else frozenset()
        layouts = self._layouts
        if layouts is not None and ACT_SITE not in sites and sites in layouts:
            _restore(layouts[sites])
            if th is not None:  # the same sites: thresholds filled in place
                sparsify_(self.model, th.values, ff_only=not sites - {"gate", "up", "down"}, gemv=self.kernels.gemv)
            self.thresholds = th
            self.attach_adapter()
            self.invalidate_step()
            return
        if th is not None:
            self.sparsify(th)
        elif self.thresholds is not None:
            self._dense_projections()
            self.thresholds = None
            self._graph = None
        if layouts is not None and ACT_SITE not in sites:
            layouts[sites] = _snapshot(self.model)

    def keep_states(self, by: str) -> None:
        """Keep what each configuration builds (`by` says who asks, e.g. the runtime gate): one
        captured decode step per state of what the step reads, and each layout of projection
        modules, so switching configurations per request costs no rebuild and no recompile.
        The price is memory: dense and sparse projection weights both stay resident."""
        self.need_linear(by)  # the layouts swap nn.Linear and sparse modules
        self.keep_graphs = True
        if self._layouts is None:
            key = frozenset(self.thresholds.sites) if self.thresholds is not None else frozenset()
            self._layouts = {key: _snapshot(self.model)}

    # -- what harnesses ask of the cache --------------------------------------------------------
    def fill_random_(self, seed: int) -> None:
        """Fill every layer's cache keys and values with seeded normal values (a timing cell's
        fill at long context: what a step reads costs the same whatever the values)."""
        gen = torch.Generator(self.device).manual_seed(seed)
        with torch.no_grad():
            for layer in self.model.layers:
                layer.self_attn.cache.k.normal_(generator=gen)
                layer.self_attn.cache.v.normal_(generator=gen)

    @contextmanager
    def tracking_keep(self):
        """Count, in the sparse projections, the input channels each eager decode step reads;
        yields a function that returns the realized projection keep pooled over the steps run
        so far (App. A 'Timed reads'). Tracking is off again on exit, and the captured step is
        dropped (it never counts).

        Under CATS/SATS thresholds (the 'act' sites) the keep is that of the MLP's weight bytes,
        (1 + 2k)/3 for a kept fraction k of SiLU(gate) channels: gate is read whole, up and down
        only in kept channels (SATS §3.2); the attention projections stay dense and out of it."""
        from sparsedecode.projection.sparse_linear import realized_projection_keep, sparsify_
        from sparsedecode.projection.thresholds import ACT_SITE

        th = self.thresholds
        if th is None:
            raise InputError("tracking the realized projection keep needs the projection branch installed")
        if ACT_SITE in th.sites:
            with self._tracking_cats(th) as kept_of:
                yield kept_of
            return
        ff_only = not set(th.sites) - {"gate", "up", "down"}
        sparsify_(self.model, th.values, ff_only=ff_only, track=True, gemv=self.kernels.gemv)
        try:
            yield lambda: realized_projection_keep(self.model)
        finally:
            sparsify_(self.model, th.values, ff_only=ff_only, track=False, gemv=self.kernels.gemv)
            self.invalidate_step()

    @contextmanager
    def _tracking_cats(self, th):
        """`tracking_keep` for CATS/SATS MLPs: their counters start at zero here."""
        from sparsedecode.projection.cats_runtime import cats_

        mlps = cats_(self.model, th.values, track=True)
        for mlp in mlps:
            mlp.kept.zero_()
        self.invalidate_step()

        def keep() -> float:
            kept, total = (sum(m.kept[i].item() for m in mlps) for i in (0, 1))
            if not total:
                raise InputError("no tracked CATS decode calls: run decode steps inside tracking_keep first")
            return (1 + 2 * kept / total) / 3  # gate whole, up and down in kept channels

        try:
            yield keep
        finally:
            cats_(self.model, th.values, track=False)
            self.invalidate_step()


def _snapshot(model) -> list[tuple]:
    """(parent, attribute, module) of every projection site and fused launch of `model`."""
    from sparsedecode.projection.sparse_linear import FUSED

    out = [(parent, site, getattr(parent, site)) for _, site, parent in model.projection_sites()]
    for layer in model.layers:
        for parent in (layer.self_attn, layer.mlp):
            out += [(parent, name, getattr(parent, name)) for name in FUSED if hasattr(parent, name)]
    return out


def _restore(snapshot: list[tuple]) -> None:
    for parent, name, module in snapshot:
        setattr(parent, name, module)
