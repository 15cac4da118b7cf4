"""Model dimensions that set the bytes of a decode step (ByteCross §3.1).

`ModelDims` reads a Hugging Face config.json (a path, a dict, or a hub id when
the hub is reachable) or a name from the known-model table. The attention
shape is general: query heads x head_dim need not equal the hidden size, and
`head_dim` is read from the config when present (Qwen3, Gemma-style configs).

Sliding-window attention is priced as the window the model reads: a layer with a window of w
tokens reads min(n, w) cached tokens at context n. `windows` holds one window per layer (0 for a
layer that reads the whole cache), from `sliding_window` (Mistral-7B-v0.1: every layer), a
per-layer `layer_types` list (newer HF configs), Gemma 2/3's alternation, Qwen2's
`max_window_layers`, or a per-layer list in `sliding_window` itself.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import MISSING, asdict, dataclass
from pathlib import Path

from sparsedecode.account.known import KNOWN_MODELS, known_model
from sparsedecode.errors import InputError, option
from sparsedecode.validate import (
    require_bool,
    require_dict,
    require_field,
    require_number,
    require_str,
)

# Families whose decoder carries extra per-layer parameters we must count.
_QKV_BIAS = {"qwen2"}
_QK_NORM = {"qwen3"}
# Fields of a mixture-of-experts config (Mixtral, Qwen-MoE, DeepSeek-MoE): more than one expert.
DIM_LIMIT = 2**31 - 1  # a layer count, width or vocabulary past this is a typo, not a model
_EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")


@dataclass(frozen=True)
class ModelDims:
    """Per-layer shapes of a decoder-only transformer.

    d: hidden size; d_ff: feed-forward size; n_heads / n_kv_heads: query and
    KV heads; head_dim: d_h; vocab: vocabulary size.
    """

    name: str
    n_layers: int
    d: int
    d_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    model_type: str = "llama"
    windows: tuple[int, ...] = ()  # per layer: its attention window in tokens, 0 for full; () none slides

    def __post_init__(self):
        for f in ("n_layers", "d", "d_ff", "n_heads", "n_kv_heads", "head_dim", "vocab"):
            require_number(getattr(self, f), f, lo=1, hi=DIM_LIMIT, integer=True, where="model dims")
        if not isinstance(self.windows, list | tuple):
            raise InputError(f"model dims: windows must be a list of one window per layer, got {self.windows!r}")
        windows = tuple(require_number(w, f"windows[{i}]", lo=0, hi=DIM_LIMIT, integer=True, where="model dims")
                        for i, w in enumerate(self.windows))
        if windows and len(windows) != self.n_layers:
            raise InputError(f"model dims: windows lists {len(windows)} layers and the model has {self.n_layers}; "
                             "give one window per layer (0 for a layer that reads the whole cache)")
        object.__setattr__(self, "windows", windows if any(windows) else ())
        if self.n_heads % self.n_kv_heads:
            raise InputError(
                f"model dims: {self.n_heads} query heads are not a multiple of "
                f"{self.n_kv_heads} KV heads; check num_key_value_heads"
            )

    # -- parameter counts of one layer ------------------------------------
    @property
    def q_width(self) -> int:
        """Output width of the query projection, n_heads * head_dim."""
        return self.n_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Output width of the key (or value) projection, n_kv_heads * head_dim."""
        return self.n_kv_heads * self.head_dim

    @property
    def mlp_params(self) -> int:
        """gate, up and down: 3 * d * d_ff (Eq. 2)."""
        return 3 * self.d * self.d_ff

    @property
    def attn_params(self) -> int:
        """q, k, v and o weights (Eq. 3 in its general form)."""
        return 2 * self.d * self.q_width + 2 * self.d * self.kv_width

    @property
    def proj_params(self) -> int:
        """P: the seven projections of one layer (§3.3)."""
        return self.mlp_params + self.attn_params

    @property
    def kv_elems_per_token(self) -> int:
        """Keys and values one layer stores per token: 2 * h_kv * d_h (Eq. 4)."""
        return 2 * self.kv_width

    def kv_tokens(self, n: float) -> float:
        """Cached tokens all layers together read at context n: n per layer, at most its window."""
        if not self.windows:
            return self.n_layers * n
        return sum(min(n, w) if w else n for w in self.windows)

    @property
    def other_params(self) -> int:
        """Read every step and never sparsified: LM head, one embedding row,
        all norm weights, and the projection biases where the model has them."""
        per_layer = 2 * self.d
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        if self.qkv_bias:
            per_layer += self.q_width + 2 * self.kv_width
        if self.o_bias:
            per_layer += self.d
        if self.mlp_bias:
            per_layer += 2 * self.d_ff + self.d
        return self.vocab * self.d + self.d + self.n_layers * per_layer + self.d

    def to_dict(self) -> dict:
        """JSON-ready: `windows` as a list, and left out when no layer slides (as in records written
        before windows existed), so a dict read back from JSON equals the one written."""
        d = asdict(self)
        if d["windows"]:
            d["windows"] = list(d["windows"])
        else:
            del d["windows"]
        return d

    # -- construction ----------------------------------------------------
    @classmethod
    def from_config(cls, config: dict, name: str | None = None) -> ModelDims:
        """Dims from the fields of a HF config.json; a missing field is named."""
        if not isinstance(config, dict):
            raise InputError(f"config must be a JSON object, got {type(config).__name__}")
        if "text_config" in config and "hidden_size" not in config:
            config = config["text_config"]

        def count(key: str, value):
            return config_number({key: value}, key, None)

        def need(key: str) -> int:
            if config.get(key) is None:
                raise InputError(
                    f"config is missing '{key}'; add it to config.json (a decoder-only "
                    "Llama/Mistral/Qwen2/Qwen3 config has hidden_size, intermediate_size, "
                    "num_hidden_layers, num_attention_heads and vocab_size)"
                )
            return count(key, config[key])

        experts = {k: config.get(k) for k in _EXPERT_FIELDS if config.get(k) not in (None, 0, 1)}
        if experts:
            raise InputError(
                "config describes a mixture of experts (" + ", ".join(f"{k}={v}" for k, v in experts.items())
                + "): a decode step reads only the experts its token is routed to, and the account and "
                "the engine price and run dense MLPs; mixture-of-experts models are not supported")
        d = need("hidden_size")
        n_heads = need("num_attention_heads")
        # HF's own default: no num_key_value_heads means multi-head attention (0 is refused, not defaulted).
        n_kv = n_heads if config.get("num_key_value_heads") is None else need("num_key_value_heads")
        head_dim = config.get("head_dim")
        if head_dim is not None:
            head_dim = count("head_dim", head_dim)
        if head_dim is None:
            if d % n_heads:
                raise InputError(
                    f"config has no 'head_dim' and hidden_size {d} is not divisible by "
                    f"num_attention_heads {n_heads}; add head_dim to config.json"
                )
            head_dim = d // n_heads
        model_type = str(config.get("model_type", "llama"))
        attention_bias = bool(config.get("attention_bias", False))
        n_layers = need("num_hidden_layers")
        return cls(
            name=name or str(config.get("_name_or_path") or model_type),
            n_layers=n_layers,
            d=d,
            d_ff=need("intermediate_size"),
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            vocab=need("vocab_size"),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=model_type in _QKV_BIAS or attention_bias,
            # Llama/Mistral/Qwen3 put `attention_bias` on o_proj too; Qwen2 never does.
            o_bias=attention_bias and model_type not in _QKV_BIAS,
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=model_type in _QK_NORM,
            model_type=model_type,
            windows=config_windows(config, n_layers, model_type),
        )

    @classmethod
    def known(cls, name: str) -> ModelDims:
        """Dims of a model in the known-model table."""
        m = known_model(name)
        return cls.from_config(m.config, name=m.name)


def dims_from_dict(d, where: str) -> ModelDims:
    """ModelDims from a file's 'dims' object: each field present, known and of its type (a
    missing one is named, never defaulted)."""
    d = require_dict(d, "dims", where=where)
    fields = ModelDims.__dataclass_fields__
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise InputError(f"{where}: field 'dims' has unknown fields {', '.join(unknown)} (expected "
                         f"{', '.join(fields)})")
    for k, f in fields.items():
        if f.default is MISSING and f.default_factory is MISSING:
            require_field(d, k, where=where, prefix="dims.")
        if k not in d:
            continue
        if f.type == "int":
            require_number(d[k], f"dims.{k}", lo=1, hi=DIM_LIMIT, integer=True, where=where)
        elif f.type == "bool":
            require_bool(d[k], f"dims.{k}", where=where)
    require_str(d["name"], "dims.name", where=where)
    try:
        return ModelDims(**d)
    except InputError as e:
        raise InputError(f"{where}: {e}") from None


def config_number(cfg: dict, key: str, default, kind: type = int):
    """cfg[key] as a positive `kind` (int or float), `default` when absent; InputError otherwise."""
    v = cfg.get(key)
    if v is None:
        return default
    ok = not isinstance(v, bool) and (isinstance(v, int) if kind is int else isinstance(v, int | float))
    if not ok or not math.isfinite(v) or v <= 0:
        raise InputError(f"config field '{key}' is {v!r}, expected a positive "
                         f"{'whole number' if kind is int else 'number'}; fix it in config.json")
    return kind(v)


_SLIDING, _FULL = "sliding_attention", "full_attention"
_ALTERNATING = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6}  # every k-th layer full (HF's pattern default)


def config_windows(config: dict, n_layers: int, model_type: str) -> tuple[int, ...]:
    """The attention window of each layer (0: it reads the whole cache) from a HF config; ()
    when no layer slides. A window of 0, a negative one, or a per-layer list of the wrong
    length is refused, never read as 'no window'."""
    sw, types = config.get("sliding_window"), config.get("layer_types")
    if model_type.startswith(("qwen2", "qwen3")) and not config.get("use_sliding_window", False):
        return ()  # Qwen configs carry a window they do not use
    if isinstance(sw, list):  # one window per layer, null for a layer that reads the whole cache
        if len(sw) != n_layers:
            raise InputError(f"config field 'sliding_window' lists {len(sw)} windows and the model has "
                             f"{n_layers} layers; give one per layer (null for full attention)")
        return tuple(0 if w is None else config_number({f"sliding_window[{i}]": w}, f"sliding_window[{i}]", None)
                     for i, w in enumerate(sw))
    if types is not None:
        if not isinstance(types, list) or len(types) != n_layers or any(t not in (_SLIDING, _FULL) for t in types):
            raise InputError(f"config field 'layer_types' must list '{_SLIDING}' or '{_FULL}' for each of the "
                             f"{n_layers} layers, got {str(types)[:80]}")
        if _SLIDING in types and sw is None:
            raise InputError("config field 'layer_types' names sliding layers but 'sliding_window' is missing; "
                             "add the window to config.json")
    if sw is None:
        return ()
    w = config_number(config, "sliding_window", None)
    if types is not None:
        slides = [t == _SLIDING for t in types]
    elif model_type.startswith(("qwen2", "qwen3")):
        first = config.get("max_window_layers")  # the first layer that slides
        first = 0 if first is None or (type(first) is int and first == 0) else config_number(
            config, "max_window_layers", None)
        slides = [i >= first for i in range(n_layers)]
    elif model_type in _ALTERNATING:
        k = config_number(config, "sliding_window_pattern", _ALTERNATING[model_type])
        slides = [(i + 1) % k != 0 for i in range(n_layers)]
    else:  # Mistral-7B-v0.1: every layer slides
        slides = [True] * n_layers
    return tuple(w if s else 0 for s in slides)


def load_config(ref: str | os.PathLike | dict) -> tuple[dict, str]:
    """The config dict and a display name for a path, folder, dict or hub id."""
    if isinstance(ref, dict):
        return ref, str(ref.get("_name_or_path") or ref.get("model_type", "config"))
    p = Path(ref)
    if p.is_dir():
        p = p / "config.json"
    if p.is_file():
        from sparsedecode.textfile import read_json

        cfg = read_json(p, "config")
        if not isinstance(cfg, dict):
            raise InputError(f"config {p} holds a JSON {type(cfg).__name__}, expected an object; pass a HF config.json")
        return cfg, p.parent.name if p.name == "config.json" else p.stem
    ref = str(ref)
    if ref.count("/") == 1 and not ref.startswith((".", "/")) and not ref.endswith(".json"):
        return _hub_config(ref), ref
    raise InputError(f"no config at '{ref}': pass a config.json, a folder holding one, or a hub id")


def _hub_config(repo_id: str) -> dict:
    try:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(repo_id, "config.json")
    except Exception as e:  # offline, gated, or no such repo: all the same fix
        raise InputError(
            f"could not fetch config.json of '{repo_id}' from the hub ({type(e).__name__}); "
            f"pass {option('config', 'PATH', placeholder=True)} to a local config.json"
        ) from None
    return json.loads(Path(path).read_text())


def resolve_dims(
    model: str | None = None, config: str | os.PathLike | dict | None = None
) -> ModelDims:
    """Dims from exactly one of a known model name or a config reference."""
    if (model is None) == (config is None):
        raise InputError(f"give exactly one of {option('model', 'NAME', placeholder=True)} or "
                         f"{option('config', 'PATH', placeholder=True)}")
    if model is not None:
        return ModelDims.known(model)
    cfg, name = load_config(config)
    return ModelDims.from_config(cfg, name=name)


__all__ = ["KNOWN_MODELS", "ModelDims", "dims_from_dict", "load_config", "resolve_dims"]
