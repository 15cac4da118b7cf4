"""LoRA adapters of sparse models: the file format, the checks against a base model, the merge.

The SATS paper fine-tunes a sparsified model with LoRA on a small text subset so that the
sparse path recovers quality (SATS §4 'Fine-tuned model performance', §4.2 'Fine-tuning
Methods', Tables 3, 4, 7); `quality.finetune` trains one with the thresholds applied as the
decode step applies them. Each adapted projection W (out, in) carries two factors, A (r, in)
and B (out, r), and the fine-tuned projection is W + s·B·A with s = alpha / r.

The engine runs an adapter merged (`merge_`): W + s·B·A is added into the base weights at
load, before the projection branch is installed, so every kernel (dense, TEAL's input-sparse
GEMV, CATS's row-gather up and sparse down, routed steps) runs unchanged on the fine-tuned
weights, and its mask semantics are those of training: the mask on x, then (W + s·B·A) x_masked
(docs/projection.md 'Fine-tuned sparse models'). `lora_factors` hands the factors out unmerged,
per site, for a kernel that applies them beside the base weight instead.

On disk an adapter is a folder in peft's layout, so peft loads it onto the Hugging Face model
of the same checkpoint: `adapter_config.json` (peft's LoraConfig fields) and
`adapter_model.safetensors`, keys `base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight`
and `...lora_B.weight`. The config adds a `sparsedecode` block: the base model's name and dims,
the thresholds it was trained under (file name, sha256, method, keep), rank, alpha, targets and
the training run (tokens, steps, seed, ...), so loading checks the base and records can say
what ran. Reading needs no peft.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from sparsedecode.errors import InputError, option
from sparsedecode.projection.thresholds import SHAPE_FIELDS

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
FORMAT = "sparsedecode-lora/1"
PEFT_PREFIX = "base_model.model.model."  # peft's prefix on a HF *ForCausalLM, whose decoder is `.model`
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
TARGETS = {"mlp": MLP, "all": ATTN + MLP}  # --targets: which projections carry factors
MAKE = "sparsedecode finetune"


@dataclass(frozen=True)
class LoraSpec:
    """The shape of an adapter: rank r, alpha (the merged delta is (alpha / r)·B·A) and the
    projections it adapts ('mlp': gate, up, down; 'all': the seven of every layer)."""

    rank: int = 16
    alpha: float = 32.0
    targets: str = "mlp"

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise InputError(f"{option('rank', self.rank)}: the LoRA rank must be a whole number >= 1")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) \
                or not math.isfinite(self.alpha) or self.alpha <= 0:
            raise InputError(f"{option('alpha', self.alpha)}: LoRA alpha must be a number > 0")
        if self.targets not in TARGETS:
            raise InputError(f"{option('targets', self.targets)}: LoRA targets are one of {', '.join(TARGETS)}")
        object.__setattr__(self, "alpha", float(self.alpha))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def modules(self) -> tuple[str, ...]:
        return TARGETS[self.targets]

    def check(self, dims) -> None:
        """Refuse a rank above what the targeted projections of a model of `dims` can hold: a
        rank-r adapter of an (out, in) projection is full rank from r = min(out, in) on, and its
        factors would only take memory (r = 100,000 on smollm2-135m asks for tens of GB)."""
        cap = min(min(projection_shape(dims, m)) for m in self.modules)
        if self.rank > cap:
            raise InputError(f"{option('rank', self.rank)} is above {cap}, the smallest width of the "
                             f"{self.targets} projections of {dims.name or 'this model'} (a LoRA of rank "
                             f">= min(out, in) is full rank): give a rank of at most {cap}")


@dataclass
class LoraFactor:
    """One adapted projection: A (r, in), B (out, r) and the scale s of s·B·A."""

    A: torch.Tensor
    B: torch.Tensor
    scale: float

    def delta(self) -> torch.Tensor:
        """s·B·A (out, in) in float32."""
        return self.scale * (self.B.float() @ self.A.float())


def site_of(layer: int, module: str) -> str:
    """The site key of a projection: 'layers.3.mlp.down_proj' for (3, 'down_proj')."""
    return f"layers.{layer}.{'mlp' if module in MLP else 'self_attn'}.{module}"


@dataclass
class Adapter:
    """An adapter read from its folder: `factors` per site key ('layers.3.mlp.down_proj'), the
    rank and alpha, and `meta`, the config's `sparsedecode` block ({} for a plain peft adapter)."""

    path: Path
    spec: LoraSpec
    factors: dict[str, LoraFactor]
    meta: dict

    @classmethod
    def load(cls, path: str | os.PathLike) -> Adapter:
        """Read a peft LoRA folder (`CONFIG_FILE` + `WEIGHTS_FILE`); anything else, or what this
        engine cannot merge (DoRA, per-module ranks, trained biases), is an InputError."""
        from sparsedecode.textfile import read_json

        path = Path(path)
        if not path.is_dir():
            raise InputError(f"adapter {path}: not a folder; an adapter is the folder `{MAKE} --out DIR` "
                             f"writes ({CONFIG_FILE} and {WEIGHTS_FILE})")
        cfg = read_json(path / CONFIG_FILE, "adapter config")
        if not isinstance(cfg, dict) or str(cfg.get("peft_type", "")).upper() != "LORA":
            raise InputError(f"{path / CONFIG_FILE}: not a LoRA adapter config (peft_type "
                             f"{cfg.get('peft_type') if isinstance(cfg, dict) else None!r}); make one with `{MAKE}`")
        for key, what in (("use_dora", "DoRA"), ("rank_pattern", "per-module ranks"),
                          ("alpha_pattern", "per-module alphas")):
            if cfg.get(key):
                raise InputError(f"{path / CONFIG_FILE}: {what} ({key}) cannot be merged here; "
                                 "use a plain LoRA adapter")
        if cfg.get("bias", "none") != "none":
            raise InputError(f"{path / CONFIG_FILE}: bias={cfg['bias']!r} trains biases, which this "
                             "engine does not merge; use bias='none'")
        meta = cfg.get("sparsedecode") or {}
        if not isinstance(meta, dict):
            raise InputError(f"{path / CONFIG_FILE}: the sparsedecode block is not a JSON object")
        rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise InputError(f"{path / CONFIG_FILE}: r is {rank!r}; a LoRA rank is a whole number >= 1")
        modules = sorted(set(_modules(cfg.get("target_modules"), path)))
        targets = next((k for k, v in TARGETS.items() if set(v) == set(modules)), None)
        try:
            spec = LoraSpec(rank=rank, alpha=alpha, targets=targets or "all")
        except InputError as err:
            raise InputError(f"{path / CONFIG_FILE}: {err}") from None
        scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
        factors = _read_factors(path / WEIGHTS_FILE, rank, scale)
        if targets is None:
            meta = {**meta, "target_modules": modules}
        return cls(path, spec, factors, meta)

    # -- checks against a base model ----------------------------------------------------------
    def check(self, dims) -> None:
        """Refuse an adapter made for another model: other dims or another base model (its
        `sparsedecode` block), or a factor whose shape does not fit the projection it names."""
        base = self.meta.get("model")
        saved = self.meta.get("dims") or {}
        diffs = [f"{f} {saved.get(f)} (adapter) vs {getattr(dims, f)} (model)"
                 for f in SHAPE_FIELDS if f in saved and saved.get(f) != getattr(dims, f)]
        if diffs:
            raise InputError(f"adapter {self.path} was trained on '{base}', whose dims differ from "
                             f"'{dims.name}': {'; '.join(diffs)}; load it with its base model, or fine-tune "
                             f"one for this model: {MAKE} --model {dims.name} ...")
        if base is not None and base != dims.name:
            raise InputError(f"adapter {self.path} was trained on '{base}', not '{dims.name}' (a LoRA delta "
                             f"belongs to the weights it was trained on); load '{base}', or fine-tune one for "
                             f"this model: {MAKE} --model {dims.name} ...")
        for key, f in self.factors.items():
            layer = int(key.split(".")[1])
            if layer >= dims.n_layers:
                raise InputError(f"adapter {self.path} adapts {key}, and '{dims.name}' has {dims.n_layers} "
                                 "layers; it was made for another model")
            out, inp = projection_shape(dims, key.rsplit(".", 1)[1])
            if tuple(f.A.shape) != (f.A.shape[0], inp) or tuple(f.B.shape) != (out, f.B.shape[1]):
                raise InputError(f"adapter {self.path}: {key} has A {tuple(f.A.shape)} and B {tuple(f.B.shape)}, "
                                 f"and '{dims.name}''s {key} is ({out}, {inp}) (out, in); it was made for "
                                 "another model")

    def summary(self) -> dict:
        """What records carry about the adapter: its folder, shape and training block."""
        return {"path": str(self.path), "rank": self.spec.rank, "alpha": self.spec.alpha,
                "targets": self.spec.targets, "sites": len(self.factors), **{
                    k: v for k, v in self.meta.items() if k not in ("rank", "alpha", "targets")}}


def projection_shape(dims, module: str) -> tuple[int, int]:
    """(out, in) of a projection of a model of `dims`."""
    return {"q_proj": (dims.q_width, dims.d), "k_proj": (dims.kv_width, dims.d), "v_proj": (dims.kv_width, dims.d),
            "o_proj": (dims.d, dims.q_width), "gate_proj": (dims.d_ff, dims.d), "up_proj": (dims.d_ff, dims.d),
            "down_proj": (dims.d, dims.d_ff)}[module]


def _modules(value, path: Path) -> list[str]:
    mods = [value] if isinstance(value, str) else value
    if not isinstance(mods, list) or not mods or any(m not in TARGETS["all"] for m in mods):
        raise InputError(f"{path / CONFIG_FILE}: target_modules {value!r} must name projections among "
                         f"{', '.join(TARGETS['all'])}")
    return mods


def _read_factors(file: Path, rank: int, scale: float) -> dict[str, LoraFactor]:
    """{site key: LoraFactor} of peft's safetensors keys (module path + '.lora_A.weight' /
    '.lora_B.weight', the PEFT_PREFIX optional)."""
    from safetensors import safe_open

    if not file.is_file():
        raise InputError(f"no adapter weights at {file}; make an adapter with `{MAKE}`")
    try:
        with safe_open(str(file), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except Exception as e:  # a corrupt or foreign file
        raise InputError(f"{file} is not a safetensors file ({type(e).__name__}); make an adapter with `{MAKE}`") from None
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        site, _, which = key.removeprefix(PEFT_PREFIX).removesuffix(".weight").rpartition(".")
        parts = site.split(".")
        ok = (which in ("lora_A", "lora_B") and len(parts) == 4 and parts[0] == "layers" and parts[1].isdigit()
              and site == site_of(int(parts[1]), parts[3]) and parts[3] in TARGETS["all"])
        if not ok:
            raise InputError(f"{file}: key {key!r} is not a LoRA factor of a projection "
                             f"({PEFT_PREFIX}layers.N.mlp.down_proj.lora_A.weight); make an adapter with `{MAKE}`")
        halves.setdefault(site, {})[which] = t
    out = {}
    for site, h in sorted(halves.items(), key=lambda kv: (int(kv[0].split(".")[1]), kv[0])):
        if set(h) != {"lora_A", "lora_B"}:
            raise InputError(f"{file}: {site} has {', '.join(sorted(h))} only; a LoRA factor needs lora_A and lora_B")
        A, B = h["lora_A"], h["lora_B"]
        if A.dim() != 2 or B.dim() != 2 or A.shape[0] != rank or B.shape[1] != rank:
            raise InputError(f"{file}: {site} has A {tuple(A.shape)} and B {tuple(B.shape)}, not (r, in) and "
                             f"(out, r) with r = {rank} (the config's r)")
        out[site] = LoraFactor(A, B, scale)
    if not out:
        raise InputError(f"{file} holds no LoRA factors; make an adapter with `{MAKE}`")
    return out


def save_adapter(path: str | os.PathLike, spec: LoraSpec, factors: dict[str, LoraFactor], meta: dict,
                 base: str | None = None) -> Path:
    """Write an adapter folder in peft's layout (module doc): the weights, then the config, each
    to a temp name renamed into place. `meta` is the `sparsedecode` block; `base`, the HF id
    of the base checkpoint (peft's base_model_name_or_path)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for site, f in factors.items():
        tensors[f"{PEFT_PREFIX}{site}.lora_A.weight"] = f.A.detach().float().contiguous().cpu()
        tensors[f"{PEFT_PREFIX}{site}.lora_B.weight"] = f.B.detach().float().contiguous().cpu()
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": spec.rank, "lora_alpha": spec.alpha, "target_modules": list(spec.modules),
        "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "use_dora": False,
        "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
        "sparsedecode": {"format": FORMAT, **meta},
    }
    _atomic(path / WEIGHTS_FILE, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    _atomic(path / CONFIG_FILE, lambda tmp: tmp.write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8"))
    return path


def _atomic(dest: Path, write) -> None:
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def adapter_of(value) -> Adapter:
    """An `Adapter`, or the one in folder `value` (a random adapter's name needs the model's dims:
    `random_adapter`)."""
    if isinstance(value, Adapter):
        return value
    if random_spec(value) is not None:
        raise InputError(f"adapter {value!r} is a random adapter, built for a model's dims when it loads "
                         "(sparsedecode.load(..., adapter=...)); it has no folder")
    return Adapter.load(value)


def same_adapter(a, b) -> bool:
    """Whether two adapters (folders, random names or `Adapter`s) are the same."""
    def where(x):
        text = str(getattr(x, "path", x))
        return text if random_spec(text) is not None else Path(text).expanduser().resolve()

    return where(a) == where(b)


# -- random adapters: the timing protocol's stand-in on random weights ------------------------------
RANDOM = "random:"
_RANDOM = re.compile(r"random:r(\d+):(mlp|all)")


def random_spec(value) -> LoraSpec | None:
    """The `LoraSpec` of a random adapter's name, 'random:r16:all' (rank 16 on the seven projections
    of every layer; ':mlp' for gate, up and down), alpha 2r; None for anything else (a folder).
    A name that starts 'random:' and does not parse is an InputError."""
    text = str(getattr(value, "path", value))
    if not text.startswith(RANDOM):
        return None
    m = _RANDOM.fullmatch(text)
    if m is None:
        raise InputError(f"adapter {text!r}: a random adapter is named random:r<rank>:<{'|'.join(TARGETS)}>, "
                         "e.g. random:r16:all")
    rank = int(m.group(1))
    if rank < 1:
        raise InputError(f"adapter {text!r}: the rank must be a whole number >= 1, e.g. random:r16:all")
    return LoraSpec(rank=rank, alpha=2.0 * rank, targets=m.group(2))


def check_adapter_ref(value: str) -> None:
    """Refuse, before any model loads, an adapter reference that cannot load: a random adapter's
    name that does not parse, or a folder that is not an adapter (`Adapter.load`)."""
    if random_spec(value) is None:
        Adapter.load(value)


def random_adapter(name: str, dims, seed: int = 0) -> Adapter:
    """A seeded adapter of the shape `name` ('random:r16:all', `random_spec`) for a model of `dims`:
    A ~ N(0, 1/in), B ~ N(0, 1e-4) in float32, scale alpha / r. The timing protocol's adapter on
    random weights (App. A: what a step reads costs the same whatever the values), as a random
    model stands in for a checkpoint; never a fine-tuned one."""
    spec = random_spec(name)
    if spec is None:
        raise InputError(f"adapter {name!r} is not a random adapter's name (random:r16:all)")
    spec.check(dims)
    gen = torch.Generator().manual_seed(seed)
    factors = {}
    for i in range(dims.n_layers):
        for m in spec.modules:
            out, inp = projection_shape(dims, m)
            a = torch.randn(spec.rank, inp, generator=gen) / math.sqrt(inp)
            b = torch.randn(out, spec.rank, generator=gen) * 1e-2
            factors[site_of(i, m)] = LoraFactor(a, b, spec.scale)
    meta = {"model": dims.name, "dims": dims.to_dict(), "random": {"seed": seed, "a_std": "1/sqrt(in)", "b_std": 1e-2}}
    return Adapter(Path(name), spec, factors, meta)


@torch.no_grad()
def merge_(model, adapter: Adapter, dims) -> None:
    """Add s·B·A into the weight of every adapted projection of `model` (the dense decoder, before
    any projection branch is installed), after `Adapter.check`. The delta is formed in float32
    and added in the weight's dtype; strides (a column-major CPU layout) are kept."""
    import torch.nn as nn

    adapter.check(dims)
    for key, f in adapter.factors.items():
        mod = model.get_submodule(key)
        if type(mod) is not nn.Linear:
            raise InputError(f"merging an adapter needs the dense projections; {key} is a {type(mod).__name__} "
                             "(merge at load, before the projection branch)")
        w = mod.weight
        w.add_(f.delta().to(device=w.device, dtype=w.dtype))


def lora_factors(adapter, dims=None) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """Per site key ('layers.3.mlp.down_proj'): (A (r, in), B (out, r), scale), the adapter's
    factors unmerged, for a kernel that adds s·B·(A x_masked) beside the base weight's sparse
    product. `adapter`: an `Adapter` or its folder; with `dims` (a model's `ModelDims`) it is
    checked against that model first."""
    adapter = adapter_of(adapter)
    if dims is not None:
        adapter.check(dims)
    return {k: (f.A, f.B, f.scale) for k, f in adapter.factors.items()}


__all__ = ["CONFIG_FILE", "RANDOM", "TARGETS", "WEIGHTS_FILE", "Adapter", "LoraFactor", "LoraSpec", "adapter_of",
           "check_adapter_ref",
           "lora_factors", "merge_", "projection_shape", "random_adapter", "random_spec", "same_adapter",
           "save_adapter", "site_of"]
