import json
import sys

import pytest

from sparsedecode import account as acc
from sparsedecode.errors import InputError


@pytest.mark.parametrize(
    "name, dims",
    [
        ("llama-3.1-8b", (32, 4096, 14336, 32, 8, 128, 128256)),
        ("llama-3.2-3b", (28, 3072, 8192, 24, 8, 128, 128256)),
        ("llama-3.1-70b", (80, 8192, 28672, 64, 8, 128, 128256)),
        ("qwen3-8b", (36, 4096, 12288, 32, 8, 128, 151936)),
        ("mistral-7b-v0.3", (32, 4096, 14336, 32, 8, 128, 32768)),
        ("smollm2-135m", (30, 576, 1536, 9, 3, 64, 49152)),
        ("qwen2.5-coder-0.5b", (24, 896, 4864, 14, 2, 64, 151936)),
    ],
)
def test_known_models_have_exact_dims(name, dims):
    d = acc.ModelDims.known(name)
    assert (d.n_layers, d.d, d.d_ff, d.n_heads, d.n_kv_heads, d.head_dim, d.vocab) == dims


def test_known_lookup_is_case_insensitive_and_accepts_hub_id():
    assert acc.ModelDims.known("Llama-3.1-8B").name == "llama-3.1-8b"
    assert acc.ModelDims.known("Qwen/Qwen3-8B").name == "qwen3-8b"


def test_misspelt_model_gets_a_close_match():
    with pytest.raises(InputError, match="did you mean 'qwen3-8b'"):
        acc.ModelDims.known("qwen-3-8b")


def test_config_from_path_folder_and_dict(tmp_path):
    cfg = dict(acc.KNOWN_MODELS["qwen3-8b"].config)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    a = acc.resolve_dims(config=str(tmp_path / "config.json"))
    b = acc.resolve_dims(config=str(tmp_path))
    c = acc.resolve_dims(config=cfg)
    assert (
        a.proj_params
        == b.proj_params
        == c.proj_params
        == acc.ModelDims.known("qwen3-8b").proj_params
    )
    assert a.qk_norm


def test_head_dim_defaults_to_hidden_over_heads_and_kv_heads_to_heads():
    d = acc.ModelDims.from_config(
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "vocab_size": 10,
        }
    )
    assert d.head_dim == 16 and d.n_kv_heads == 4


@pytest.mark.parametrize(
    "missing",
    ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"],
)
def test_missing_field_is_named(missing):
    cfg = dict(acc.KNOWN_MODELS["llama-3.1-8b"].config)
    del cfg[missing]
    with pytest.raises(InputError, match=f"missing '{missing}'"):
        acc.ModelDims.from_config(cfg)


def test_bad_json_and_missing_path(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        acc.resolve_dims(config=str(p))
    with pytest.raises(InputError, match="no config"):
        acc.resolve_dims(config=str(tmp_path / "nope.json"))


def test_account_imports_neither_torch_nor_numpy():
    import subprocess

    code = (
        "import sys, sparsedecode.account, sparsedecode.cli.account; "
        "bad=[m for m in sys.modules if m.split('.')[0] in ('torch','numpy')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize(
    "text, tokens",
    [
        ("32768", 32768),
        ("32K", 32768),
        ("32k", 32768),
        ("1.5K", 1536),
        ("1M", 1 << 20),
        (" 8K ", 8192),
    ],
)
def test_parse_tokens(text, tokens):
    assert acc.parse_tokens(text) == tokens


@pytest.mark.parametrize("text", ["32Q", "", "-1", "0", "0.3K", "K"])
def test_parse_tokens_refuses_malformed(text):
    with pytest.raises(InputError):
        acc.parse_tokens(text)


def test_other_bytes_count_every_bias_the_model_has():
    base = dict(acc.KNOWN_MODELS["llama-3.1-8b"].config)
    plain = acc.ModelDims.from_config(base)
    biased = acc.ModelDims.from_config({**base, "attention_bias": True, "mlp_bias": True})
    per_layer = (biased.q_width + 2 * biased.kv_width) + biased.d + (2 * biased.d_ff + biased.d)
    assert biased.other_params - plain.other_params == biased.n_layers * per_layer
    # Qwen2 carries q/k/v biases but none on o_proj
    qwen2 = acc.ModelDims.known("qwen2.5-coder-0.5b")
    assert qwen2.qkv_bias and not qwen2.o_bias
