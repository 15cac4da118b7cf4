"""Campaign specs: the TOML file of a timing campaign, parsed and checked (ByteCross App. A
'Timing', §4.2, App. E). The model and protocol at the top, one or more [[grid]] tables, each
a group of contexts x modes under one attention path; every error names the file and the
field. `timing.campaign` plans and runs the cells of a spec."""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from sparsedecode.account.units import parse_tokens
from sparsedecode.errors import InputError
from sparsedecode.timing.cell import (
    ATTENTION,
    FILLS,
    IMPLS,
    cell_config,
    check_method,
    kernels_text,
    model_window,
)
from sparsedecode.timing.neighbors import SHARED_GPU

DTYPES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16")
SPEC_FILE = "spec.toml"
_SAFE = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")

# key -> (types, default); a key without a default is required.
_TOP: dict[str, tuple[tuple[type, ...], object]] = {
    "name": ((str,), None),
    "model": ((str,), None),
    "init": ((str,), "pretrained"),
    "dtype": ((str,), "auto"),
    "device": ((str,), "auto"),
    "blocks": ((int,), None),
    "repeats": ((int,), 5),
    "steps": ((int,), 50),
    "warmup": ((int,), 5),
    "fill": ((str,), "prefill"),
    "compile_mode": ((str,), ""),
    "seed": ((int,), 0),
    "text": ((str,), ""),
    "calib_tokens": ((int, str), 2048),
    "obs": ((int,), 64),
    "profile": ((int,), 0),
    "shared_gpu": ((str,), "refuse"),
}
_GRID: dict[str, tuple[tuple[type, ...], object]] = {
    "group": ((str,), None),
    "contexts": ((list,), None),
    "modes": ((list,), None),
    "attention": ((str,), "split_k"),
    "variants": ((list,), [""]),
    "impl": ((str,), "ours"),
    "pairs": ((str,), "dense"),
    "batch": ((int,), 1),
    "adapter": ((str,), ""),
    "method": ((str,), "teal"),
}


@dataclass(frozen=True)
class Grid:
    """One [[grid]] table: a group of contexts x modes under one attention path, timed under
    each of its kernel variants ('' = the default options; else `--kernels` text, e.g.
    'lora.merge=false'), each step decoding `batch` sequences (`timing.batch_cell`; 1: the
    single-sequence protocol), with `adapter` loaded in every cell ('' = none; issue 45) and its
    proj<keep> cells calibrated by `method` (teal; cats or sats: SATS §3.1, dense modes stay dense)."""

    group: str
    contexts: tuple[int, ...]
    modes: tuple[str, ...]
    attention: str = "split_k"
    variants: tuple[str, ...] = ("",)
    impl: str = "ours"
    batch: int = 1
    adapter: str = ""  # a LoRA adapter every cell loads (a folder, or 'random:r16:all'); '' = none
    method: str = "teal"  # what calibrates the proj<keep> cells: teal, or cats/sats (`timing.cell.check_method`)


@dataclass(frozen=True)
class CampaignSpec:
    """A validated campaign spec (the TOML's top-level keys and its grids)."""

    name: str
    model: str
    blocks: int
    grids: tuple[Grid, ...]
    init: str = "pretrained"
    dtype: str = "auto"
    device: str = "auto"
    repeats: int = 5
    steps: int = 50
    warmup: int = 5
    fill: str = "prefill"
    compile_mode: str = ""
    seed: int = 0
    text: str = ""
    calib_tokens: int = 2048
    obs: int = 64
    profile: int = 0  # steps each cell of ours runs under torch.profiler after its timed ones
    shared_gpu: str = "refuse"  # a cell on a GPU that other processes hold: refuse, or allow (recorded)

    @property
    def generated(self) -> int:
        return self.warmup + self.repeats * self.steps

    def to_dict(self) -> dict:
        return asdict(self)


# -- the spec --------------------------------------------------------------------
def _toml():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise InputError(
                "reading a campaign spec on Python 3.10 needs the 'tomli' package: pip install tomli "
                "(Python 3.11+ has tomllib built in)"
            ) from None
    return tomllib


def load_spec(path: str | os.PathLike) -> CampaignSpec:
    """Read and validate a campaign TOML; every error names the file and the field."""
    from sparsedecode.textfile import read_text

    path = Path(path)
    return parse_spec(read_text(path, "campaign spec"), where=str(path))


def parse_spec(text: str, where: str = "campaign spec") -> CampaignSpec:
    """A `CampaignSpec` from TOML text (see the module doc), validated up front: unknown
    keys, wrong types, empty lists, bad modes, grids without 'dense', duplicate groups,
    cells, contexts over the model window."""
    toml = _toml()
    try:
        raw = toml.loads(text)
    except toml.TOMLDecodeError as e:
        raise InputError(f"{where} is not valid TOML: {e}") from None
    top = _fields(raw, _TOP | {"grid": ((list,), None)}, where)
    grids_raw = top.pop("grid")
    if not grids_raw:
        raise InputError(f"{where}: 'grid' is empty: add at least one [[grid]] table")
    top["calib_tokens"] = parse_tokens(top["calib_tokens"], f"{where}: calib_tokens")
    for name, choices in (("init", ("pretrained", "random")), ("fill", FILLS), ("shared_gpu", SHARED_GPU)):
        if top[name] not in choices:
            raise InputError(f"{where}: {name} '{top[name]}' is not one of {', '.join(choices)}")
    if top["dtype"] not in DTYPES:
        raise InputError(f"{where}: dtype '{top['dtype']}' is not one of {', '.join(DTYPES)}")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", top["device"]):
        raise InputError(f"{where}: device '{top['device']}' is not auto, cpu, cuda or cuda:N")
    for name, low in (("blocks", 1), ("repeats", 1), ("steps", 1), ("warmup", 0), ("seed", 0), ("obs", 1)):
        if top[name] < low:
            raise InputError(f"{where}: {name} must be >= {low}, got {top[name]}")
    if not _safe(top["name"]):
        raise InputError(f"{where}: name '{top['name']}' may hold only letters, digits, '_', '.' and '-'")
    grids, groups = [], set()
    for i, g in enumerate(grids_raw, 1):
        gwhere = f"{where}: [[grid]] {i}"
        if not isinstance(g, dict):
            raise InputError(f"{gwhere} is not a table: write [[grid]] with group, contexts, modes")
        grid = _grid(_fields(g, _GRID, gwhere), gwhere)
        for group in (variant_group(grid.group, v) for v in grid.variants):
            if group in groups:
                raise InputError(f"{gwhere}: group '{group}' is used twice; each grid (and kernel variant) "
                                 "needs its own group")
            groups.add(group)
        grids.append(grid)
    spec = CampaignSpec(**top, grids=tuple(grids))
    name, window = model_window(spec.model, spec.init)
    for g in spec.grids:
        too_long = [n for n in g.contexts if window and n + spec.generated > window]
        if too_long:
            raise InputError(
                f"{where}: grid '{g.group}' contexts: context {max(too_long)} + {spec.generated} "
                f"generated tokens exceeds the {window}-token window of {name}; use at most "
                f"{window - spec.generated}"
            )
    return spec


def _fields(raw: dict, schema: dict, where: str) -> dict:
    unknown = sorted(set(raw) - set(schema))
    if unknown:
        raise InputError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; "
                         f"known keys: {', '.join(schema)}")
    out = {}
    for key, (types, default) in schema.items():
        if key not in raw:
            if default is None:
                raise InputError(f"{where}: missing key '{key}'")
            out[key] = default
            continue
        v = raw[key]
        if isinstance(v, bool) or not isinstance(v, types):
            want = " or ".join({int: "an integer", str: "a string", list: "a list"}[t] for t in types)
            raise InputError(f"{where}: '{key}' must be {want}, got {v!r}")
        out[key] = v
    return out


def _grid(g: dict, where: str) -> Grid:
    if not _safe(g["group"]):
        raise InputError(f"{where}: group '{g['group']}' may hold only letters, digits, '_', '.' and '-' "
                         "(it names a folder)")
    where = f"{where} ('{g['group']}')"
    for key in ("contexts", "modes"):
        if not g[key]:
            raise InputError(f"{where}: '{key}' is empty: list at least one")
    contexts = []
    for c in g["contexts"]:
        if isinstance(c, bool) or not isinstance(c, int | str):
            raise InputError(f"{where}: contexts entry {c!r} is not a token count such as 2048 or '2K'")
        contexts.append(parse_tokens(c, f"{where}: contexts entry"))
    if len(set(contexts)) != len(contexts):
        raise InputError(f"{where}: contexts lists a context twice: {contexts}")
    modes, kinds, cells = [], [], {}
    for m in g["modes"]:
        if not isinstance(m, str):
            raise InputError(f"{where}: modes entry {m!r} is not a mode string such as 'sel0.3'")
        try:
            mode = cell_config(m)
        except InputError as e:
            raise InputError(f"{where}: modes: {e}") from None
        if mode.cell in cells:
            raise InputError(f"{where}: modes '{cells[mode.cell]}' and '{m}' are the same cell ({mode.cell})")
        cells[mode.cell] = m
        modes.append(str(mode))
        kinds.append(mode.kind)
    if g["pairs"] == "crossing":  # App. E: the crossing pairs proj with sel in each block, no dense cell
        if sorted(kinds) != ["proj", "sel"]:
            raise InputError(f"{where}: pairs = 'crossing' wants exactly one proj and one sel mode, got "
                             f"{', '.join(modes)}")
    elif g["pairs"] != "dense":
        raise InputError(f"{where}: pairs '{g['pairs']}' is not 'dense' or 'crossing'")
    elif "dense" not in modes:
        raise InputError(f"{where}: modes lacks 'dense'; speedups pair each cell with the dense cell "
                         "of the same group, block and context, so add 'dense' (or pairs = 'crossing' "
                         "for one proj and one sel mode)")
    if g["attention"] not in ATTENTION:
        raise InputError(f"{where}: attention '{g['attention']}' is not one of {', '.join(ATTENTION)}")
    variants = []
    for v in g["variants"] or [""]:
        if not isinstance(v, str):
            raise InputError(f"{where}: variants entry {v!r} is not kernel options such as 'gemv.pdl=false' "
                             "('' for the defaults)")
        try:
            v = kernels_text("" if v == "default" else v)
        except InputError as e:
            raise InputError(f"{where}: variants: {e}") from None
        if v in variants:
            raise InputError(f"{where}: variants lists the options '{v or 'default'}' twice")
        variants.append(v)
    if g["impl"] not in IMPLS:
        raise InputError(f"{where}: impl '{g['impl']}' is not one of {', '.join(IMPLS)}")
    if g["impl"] != "ours" and (modes != ["dense"] or variants != [""]):
        raise InputError(f"{where}: the {g['impl']} peer times the dense step under its own kernels: "
                         "give modes = ['dense'] and no variants")
    batch = g["batch"]
    if not 1 <= batch <= 4096:
        raise InputError(f"{where}: batch {batch} is not a number of sequences in [1, 4096]")
    if batch > 1:
        if g["impl"] != "ours" or g["attention"] != "split_k":
            raise InputError(f"{where}: batch {batch} times our own step under split_k attention (the batch "
                             "engine's); give impl 'ours' and attention 'split_k', or batch 1")
        if any(cell_config(m).kv_method == "window" for m in modes):
            raise InputError(f"{where}: window selection in a decode batch is not built; give sel<keep> (SnapKV) "
                             "modes, or batch 1")
    adapter = g["adapter"]
    if adapter:
        from sparsedecode.projection.lora import check_adapter_ref

        try:
            check_adapter_ref(adapter)
        except InputError as e:
            raise InputError(f"{where}: {e}") from None
        if g["impl"] != "ours":
            raise InputError(f"{where}: an adapter loads into our engine, not the {g['impl']} peer; drop it")
    method, proj = g["method"], [cell_config(m) for m in modes if cell_config(m).proj_method]
    try:
        for mode in proj or [cell_config("dense")]:
            check_method(method, mode, batch, g["impl"])
    except InputError as e:
        raise InputError(f"{where}: {e}") from None
    return Grid(g["group"], tuple(contexts), tuple(modes), g["attention"], tuple(variants), g["impl"], batch,
                adapter, method)


def variant_group(group: str, kernels: str) -> str:
    """The group of a grid's kernel variant: the grid's own for the defaults, else e.g.
    'step.gemv.pdl-false' for 'gemv.pdl=false' (a folder name)."""
    if not kernels:
        return group
    return group + "." + kernels.replace("=", "-").replace(",", "_")


def _safe(name: str) -> bool:
    return bool(name) and set(name) <= _SAFE and name not in (".", "..")


__all__ = ["DTYPES", "SPEC_FILE", "Grid", "CampaignSpec", "load_spec", "parse_spec"]
