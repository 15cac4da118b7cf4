"""Bad input gives one InputError that names the limit and the fix."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import sparsedecode
from sparsedecode.errors import InputError

TINY = dict(
    model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, vocab_size=50, max_position_embeddings=64,
    rope_theta=10000.0, eos_token_id=None,
)


@pytest.fixture(scope="module")
def tiny():
    return sparsedecode.load(dict(TINY), init="random", device="cpu", max_len=32)


def test_prompt_longer_than_cache_names_both_limits(tiny):
    with pytest.raises(InputError, match=r"40 tokens exceeds the allocated cache of 32 .*larger max_len= \(up to 64"):
        tiny.forward_logits(list(range(40)))
    with pytest.raises(InputError, match=r"plus 20 new tokens.*cache of 32"):
        tiny.generate(list(range(20)), max_new_tokens=20)


def test_prompt_longer_than_model_window():
    eng = sparsedecode.load(dict(TINY), init="random", device="cpu", max_len=64)
    with pytest.raises(InputError, match=r"70 tokens exceeds the model window of 64"):
        eng.forward_logits(list(range(70)))
    with pytest.raises(InputError, match=r"max_len=100 exceeds the model window of 64.*max_len=64 or less"):
        sparsedecode.load(dict(TINY), init="random", device="cpu", max_len=100)


def test_cache_full_during_decode(tiny):
    tiny.prefill(list(range(32)))
    with pytest.raises(InputError, match=r"cache of 32 tokens is full"):
        tiny.decode_step(1)


def test_unknown_model_suggests_close_match():
    with pytest.raises(InputError, match=r"unknown model 'smollm2-13m': did you mean 'smollm2-135m'"):
        sparsedecode.load("smollm2-13m")


def test_gguf_of_unsupported_architecture(tmp_path):
    import numpy as np

    GGUFWriter = pytest.importorskip("gguf", reason="writing a GGUF needs the gguf package").GGUFWriter

    path = tmp_path / "tiny-gpt2.gguf"
    w = GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(InputError, match=r"architecture 'gpt2' is not supported.*llama, qwen2, qwen3"):
        sparsedecode.load(str(path))


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "weights.gguf"
    bad.write_bytes(b"NOPE" + bytes(32))
    with pytest.raises(InputError, match=r"not a GGUF file"):
        sparsedecode.load(str(bad))


def test_unsupported_model_type_in_config():
    with pytest.raises(InputError, match=r"model_type 'gpt2' is not supported.*llama, mistral, qwen2, qwen3"):
        sparsedecode.load(dict(TINY, model_type="gpt2"), init="random", device="cpu")


def test_dtype_the_device_cannot_run():
    with pytest.raises(InputError, match=r"cpu cannot run dtype float8_e4m3fn.*dtype='float32'"):
        sparsedecode.load(dict(TINY), init="random", device="cpu", dtype=torch.float8_e4m3fn)
    with pytest.raises(InputError, match=r"unknown dtype 'float7'"):
        sparsedecode.load(dict(TINY), init="random", device="cpu", dtype="float7")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_requested_without_gpu():
    with pytest.raises(InputError, match=r"device 'cuda' is not available.*device='cpu'"):
        sparsedecode.load(dict(TINY), init="random", device="cuda")


def test_unknown_attention_backend():
    with pytest.raises(InputError, match=r"unknown attention backend 'flash'.*split_k"):
        sparsedecode.load(dict(TINY), init="random", device="cpu", attention="flash")


def test_text_prompt_without_tokenizer(tiny):
    with pytest.raises(InputError, match=r"without a tokenizer.*pass token ids"):
        tiny.generate("hello")


def test_bad_sampling_arguments(tiny):
    with pytest.raises(InputError, match=r"top_p= must be in"):
        tiny.generate([1, 2], max_new_tokens=2, temperature=1.0, top_p=0.0)
    with pytest.raises(InputError, match=r"temperature= must be a finite number >= 0"):
        tiny.generate([1, 2], max_new_tokens=2, temperature=-1.0)
    with pytest.raises(InputError, match=r"temperature= must be a finite number"):  # NaN compares false
        tiny.generate([1, 2], max_new_tokens=2, temperature=float("nan"))
    with pytest.raises(InputError, match=r"seed= must be a whole number in \[0, 2\^64 - 1\]"):
        tiny.generate([1, 2], max_new_tokens=2, temperature=1.0, seed=2**70)
    with pytest.raises(InputError, match=r"seed="):
        tiny.generate([1, 2], max_new_tokens=2, seed=-1)


def test_cli_turns_input_error_into_one_line():
    res = subprocess.run(
        [sys.executable, "-m", "sparsedecode", "generate", "--model", "llama-3.1-8bb", "--prompt", "hi"],
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: unknown model 'llama-3.1-8bb'")
    assert "did you mean 'llama-3.1-8b'" in lines[0]
