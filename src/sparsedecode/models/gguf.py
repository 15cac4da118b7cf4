"""GGUF checkpoints: a fast header read, then dequantization through transformers.

transformers (5.x) reads GGUF with `load_gguf_checkpoint`, which dequantizes
every tensor with the `gguf` package and renames it to the Hugging Face
layout, undoing llama.cpp's q/k row permutation for Llama-family files, so the
weights land in the rotate_half RoPE convention of `models/rope.py`. It needs a
model (on the meta device here) to learn the name map, and that model needs
the architecture and layer count, which `read_header` takes from the file's
key-value section without parsing the large tokenizer arrays (a full
`GGUFReader` pass over a 151K-token vocabulary takes seconds).
"""

from __future__ import annotations

import struct
from pathlib import Path

import torch

from sparsedecode.errors import InputError
from sparsedecode.models.args import SUPPORTED_TYPES

# llama.cpp architecture names the engine runs (mistral GGUFs say 'llama').
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def read_header(path: str | Path) -> dict:
    """The scalar key-values of a GGUF file (arrays are skipped), e.g. 'general.architecture'."""
    out: dict = {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise InputError(f"{path} is not a GGUF file (bad magic); pass a .gguf or a HF folder")
        version, _n_tensors, n_kv = struct.unpack("<IQQ", f.read(20))
        if version < 2:
            raise InputError(f"{path}: GGUF version {version} is too old; re-export it with llama.cpp")
        for _ in range(n_kv):
            key = _read_str(f)
            (vtype,) = struct.unpack("<I", f.read(4))
            if vtype == _ARRAY:
                _skip_array(f)
            else:
                out[key] = _read_value(f, vtype)
    return out


def _read_str(f) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8", errors="replace")


def _read_value(f, vtype: int):
    if vtype == _STRING:
        return _read_str(f)
    fmt = _SCALAR[vtype]
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def _skip_array(f) -> None:
    etype, count = struct.unpack("<IQ", f.read(12))
    if etype == _STRING:
        for _ in range(count):
            (n,) = struct.unpack("<Q", f.read(8))
            f.seek(n, 1)
    elif etype == _ARRAY:
        for _ in range(count):
            _skip_array(f)
    else:
        f.seek(count * struct.calcsize(_SCALAR[etype]), 1)


def gguf_model_type(header: dict, path) -> str:
    """HF model_type of a GGUF file, or an InputError naming its architecture."""
    arch = str(header.get("general.architecture", "?"))
    if arch not in SUPPORTED_ARCHS:
        raise InputError(
            f"{Path(path).name}: GGUF architecture '{arch}' is not supported; the engine runs "
            f"GGUF files of architecture {', '.join(SUPPORTED_ARCHS)} "
            f"(HF model types {', '.join(SUPPORTED_TYPES)})"
        )
    if arch == "llama" and "mistral" in str(header.get("general.name", "")).lower():
        return "mistral"
    return arch


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[dict, dict]:
    """(HF config dict, HF-named state dict on CPU in `dtype`) of a supported GGUF file."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    header = read_header(path)
    model_type = gguf_model_type(header, path)
    arch = header["general.architecture"]
    n_layers = int(header[f"{arch}.block_count"])
    # A meta model with the real layer count is all the name map needs; biases and
    # q/k norms exist in every HF model of these types, so the map is complete.
    stub = AutoConfig.for_model(
        model_type, num_hidden_layers=n_layers, hidden_size=64, intermediate_size=64,
        num_attention_heads=1, num_key_value_heads=1, vocab_size=8, tie_word_embeddings=False,
    )
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(stub)
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=meta, torch_dtype=dtype)
    config = dict(parsed["config"])
    config["model_type"] = model_type
    config.setdefault("_name_or_path", header.get("general.name") or Path(path).stem)
    tensors = {k: torch.as_tensor(v) for k, v in parsed["tensors"].items()}
    return config, tensors


__all__ = ["SUPPORTED_ARCHS", "gguf_model_type", "load_gguf", "read_header"]
