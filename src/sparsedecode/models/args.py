"""`ModelArgs`: the architecture of a supported decoder, read from a HF config dict.

One dataclass covers the four families the engine runs (ByteCross App. A lists
the paper's models): Llama 3.x (optionally with 'llama3' RoPE frequency
scaling), Mistral, Qwen2 (biases on q/k/v) and Qwen3 (RMSNorm on each query
and key head). Everything else (MoE, sliding-window layers, other RoPE
variants) is refused here with an error that names the field, so the decoder
never runs a model it would get wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sparsedecode.account.dims import ModelDims, config_number
from sparsedecode.errors import InputError, option

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelArgs:
    """Shapes and options of one decoder; `from_config` is the only constructor you need."""

    model_type: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position: int = 4096
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    windows: tuple[int, ...] = field(default=())  # per layer (0: full attention), as ModelDims.windows
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = field(default=())
    name: str = ""

    @property
    def rope_type(self) -> str:
        return (self.rope_scaling or {}).get("rope_type", "default")

    @classmethod
    def from_config(cls, cfg: dict, name: str | None = None) -> ModelArgs:
        """Args from config.json fields (transformers 4.x or 5.x spelling of RoPE)."""
        if "text_config" in cfg and "hidden_size" not in cfg:
            cfg = cfg["text_config"]
        dims = ModelDims.from_config(cfg, name=name)  # validates the shape fields
        mt = dims.model_type
        if mt not in SUPPORTED_TYPES:
            raise InputError(
                f"model_type '{mt}' is not supported; the engine runs {', '.join(SUPPORTED_TYPES)}"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise InputError(f"hidden_act '{act}' is not supported; the engine's MLP is SwiGLU (silu)")
        theta, scaling = _rope(cfg)
        window = cfg.get("sliding_window")
        if mt in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
            window = None  # Qwen configs carry a window they do not use
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            model_type=mt,
            dim=dims.d,
            n_layers=dims.n_layers,
            n_heads=dims.n_heads,
            n_kv_heads=dims.n_kv_heads,
            head_dim=dims.head_dim,
            d_ff=dims.d_ff,
            vocab=dims.vocab,
            norm_eps=config_number(cfg, "rms_norm_eps", 1e-5, float),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position=config_number(cfg, "max_position_embeddings", 4096, int),
            tie_embeddings=dims.tie_embeddings,
            qkv_bias=dims.qkv_bias,
            o_bias=dims.o_bias,
            mlp_bias=dims.mlp_bias,
            qk_norm=dims.qk_norm,
            sliding_window=config_number({"sliding_window": window}, "sliding_window", None, int) if window else None,
            windows=dims.windows,
            bos_id=cfg.get("bos_token_id"),
            eos_ids=tuple(int(e) for e in eos_ids),
            name=dims.name,
        )

    def dims(self) -> ModelDims:
        """The byte-account dims of this model."""
        return ModelDims(
            name=self.name or self.model_type,
            n_layers=self.n_layers,
            d=self.dim,
            d_ff=self.d_ff,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            vocab=self.vocab,
            tie_embeddings=self.tie_embeddings,
            qkv_bias=self.qkv_bias,
            o_bias=self.o_bias,
            mlp_bias=self.mlp_bias,
            qk_norm=self.qk_norm,
            model_type=self.model_type,
            windows=self.windows,
        )

    @property
    def window(self) -> int:
        """The longest cache the engine attends correctly: max_position_embeddings, or the
        sliding window where it is shorter (sliding-window attention is not implemented)."""
        return min(self.max_position, self.sliding_window or self.max_position)

    def check_length(self, max_len: int) -> None:
        """Refuse a cache the model cannot attend correctly."""
        if max_len > self.max_position:
            raise InputError(
                f"{option('max_len', max_len)} exceeds the model window of {self.max_position} tokens "
                f"(max_position_embeddings); pass {option('max_len', self.max_position)} or less"
            )
        if self.sliding_window is not None and max_len > self.sliding_window:
            raise InputError(
                f"this model uses sliding-window attention of {self.sliding_window} tokens, which "
                f"the engine does not implement; pass {option('max_len', self.sliding_window)} or less"
            )


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from `rope_theta`/`rope_scaling` (4.x) or `rope_parameters` (5.x)."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or params)
    theta = config_number({"rope_theta": params.get("rope_theta", cfg.get("rope_theta", scaling.get("rope_theta")))},
                    "rope_theta", 10000.0, float)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise InputError(
            f"RoPE type '{kind}' is not supported; the engine implements {', '.join(ROPE_TYPES)}"
        )
    if kind == "default":
        return theta, None
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    scaling["rope_type"] = kind
    return theta, scaling


__all__ = ["ROPE_TYPES", "SUPPORTED_TYPES", "ModelArgs"]
