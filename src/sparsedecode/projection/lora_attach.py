"""LoRA adapters on a sparse model, unmerged, attached to its sites (SATS paper §4.2 'Fine-tuning Methods').

`attach_lora_(model, sites, scale)` puts an adapter on each named projection site: the site's
`SparseLinear` then adds s * B (A x_m) to its output, reading A only in the rows of kept input
channels in the one-token kernels (`kernels.lora_gemv`, `kernels.cpu_gemv.sparse_gemv_lora_cpu`).
A site that is still a plain nn.Linear becomes a `SparseLinear` that reads every row (READ_ALL),
the dense GEMV of `GemvOptions.dense`, so an adapter needs no merged copy of the weight. The
adapter loader calls it with the adapter's tensors; `detach_lora_` takes every adapter off again.

Site keys: the module path `layers.3.mlp.down_proj` (any prefix before `layers.`, as PEFT names
it, `base_model.model.model.layers.3.mlp.down_proj`, is dropped) or the thresholds key
`layers.3.down`. A CATS MLP's up projection (row-gathered by its kept SiLU(gate) channels) holds
its adapter on the `CatsMLP` (`attach_up_lora_`: the gather kernel adds it for the kept rows).
"""

from __future__ import annotations

import re

from torch import Tensor, nn

from sparsedecode.errors import InputError
from sparsedecode.projection.cats_runtime import CatsMLP
from sparsedecode.projection.lora_site import LoraConcat
from sparsedecode.projection.sparse_linear import READ_ALL, SITE_KEYS, SparseLinear, sparse_modules
from sparsedecode.projection.thresholds import MODULE_OF

_PATH = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:(?:self_attn|mlp)\.)?([a-z_]+)$")


def site_of(key: str) -> tuple[int, str]:
    """(layer, module name) of a site key: 'layers.3.mlp.down_proj', '...layers.3.down_proj' or
    'layers.3.down' -> (3, 'down_proj')."""
    m = _PATH.search(key)
    name = None if m is None else MODULE_OF.get(m.group(2), m.group(2))
    if name not in SITE_KEYS:
        raise InputError(f"adapter site '{key}' is not a projection of a layer: write layers.N.mlp.down_proj "
                         f"(or layers.N.down), the module one of {', '.join(SITE_KEYS)}")
    return int(m.group(1)), name


def attach_lora_(model, sites: dict[str, tuple[Tensor, Tensor]], scale: float | dict[str, float]) -> list:
    """Attach adapters to `model` (a `Transformer`, sparse or not): `sites` maps a site key to
    (A (r, in), B (out, r)); `scale` is alpha / r, one number or one per key. Every key is checked
    before any site changes. Returns the sites' modules in the order given (a CATS MLP's up: the
    `CatsMLP`, which holds it, `attach_up_lora_`). A decode step captured
    or compiled before this call keeps running without the adapters: capture again."""
    parents = {(i, name): parent for i, name, parent in model.projection_sites()}
    plan = []
    for key, pair in sites.items():
        i, name = site_of(key)
        if (i, name) not in parents:
            raise InputError(f"adapter site '{key}': the model has {len(model.layers)} layers")
        s = scale.get(key) if isinstance(scale, dict) else scale
        if s is None:
            raise InputError(f"no adapter scale for site '{key}'")
        parent = parents[i, name]
        mod = getattr(parent, name)
        if not isinstance(mod, (SparseLinear, nn.Linear)):
            raise InputError(f"adapter site '{key}' is a {type(mod).__name__}, which takes no adapter")
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise InputError(f"adapter site '{key}' wants (A, B); got {type(pair).__name__}")
        plan.append((i, parent, name, mod, pair, s))
    out = []
    for i, parent, name, mod, (a, b), s in plan:
        if isinstance(parent, CatsMLP) and name == "up_proj":  # row-gathered: the CATS kernel takes it
            parent.attach_up_lora_(a, b, s)
            out.append(parent)
            continue
        if not isinstance(mod, SparseLinear):  # a dense site: the GEMV that reads every row
            mod = SparseLinear.from_linear(mod, READ_ALL, site=f"layers.{i}.{SITE_KEYS[name]}",
                                           options=_sibling_options(model))
            setattr(parent, name, mod)
        mod.attach_lora_(a, b, s)
        out.append(mod)
    _refresh_concats(model)
    return out


def _refresh_concats(model) -> None:
    """Rebuild the side-by-side adapters of the fused launches (q|k|v, gate|up) from their sites'."""
    for mod in model.modules():
        if isinstance(mod, LoraConcat):
            mod.refresh_lora_()


def _sibling_options(model):
    """The GemvOptions of the model's sparse modules (None where there are none: the defaults)."""
    mods = sparse_modules(model)
    return mods[0].options if mods else None


def detach_lora_(model) -> int:
    """Take every adapter off `model`; returns how many sites held one. A site that became a
    SparseLinear for its adapter stays one (it computes the same base projection)."""
    n = 0
    for mod in sparse_modules(model):
        if mod.has_lora:
            mod.detach_lora_()
            n += 1
    for mlp in _cats_mlps(model):
        if mlp.has_up_lora:
            mlp.detach_up_lora_()
            n += 1
    _refresh_concats(model)
    return n


def lora_sites(model) -> list[str]:
    """The thresholds keys ('layers.3.down') of the sites that hold an adapter."""
    return ([mod.site for mod in sparse_modules(model) if mod.has_lora]
            + [mlp.site.rsplit(".", 1)[0] + ".up" for mlp in _cats_mlps(model) if mlp.has_up_lora])


def _cats_mlps(model) -> list[CatsMLP]:
    return [m for m in model.modules() if isinstance(m, CatsMLP)]


__all__ = ["attach_lora_", "detach_lora_", "lora_sites", "site_of"]
