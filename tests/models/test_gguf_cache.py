"""The dequantized copy of a GGUF file: a second load reads it instead of dequantizing
again, and gives the same tensors and the same tokenizer."""

from __future__ import annotations

import pytest
import torch

from sparsedecode.models import load as load_mod


@pytest.mark.slow
def test_second_load_reads_the_converted_copy_with_identical_tensors_and_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setattr(load_mod, "converted_folder", lambda path: tmp_path / f"conv-{path.stem}")
    from sparsedecode.models import gguf

    calls = []
    g = torch.Generator().manual_seed(0)
    fake = ({"model_type": "llama", "hidden_size": 8},  # dequantizing is transformers' job (20 s);
            {"a.weight": torch.randn(3, 5, generator=g), "b.bias": torch.randn(7, generator=g)})

    def counted(path, *a, **k):  # what is cached is what load_gguf returned
        calls.append(path)
        return fake[0], {k: v.clone() for k, v in fake[1].items()}

    monkeypatch.setattr(gguf, "load_gguf", counted)  # load.py imports it at call time
    first = load_mod.resolve("smollm2-135m", quiet=True)
    assert len(calls) == 1 and (first.converted / load_mod.WEIGHTS).is_file()
    tensors = fake[1]
    tok = load_mod.load_tokenizer(first)  # converts, then saves the tokenizer beside the weights
    assert (first.converted / "tokenizer" / "tokenizer_config.json").is_file()

    second = load_mod.resolve("smollm2-135m", quiet=True)
    assert len(calls) == 1  # read from the copy, not dequantized again
    assert second.config == first.config and second.tensors is None  # read when the model is built
    copied = dict(load_mod._safetensors_items(second.converted))
    assert copied.keys() == tensors.keys() and all(torch.equal(copied[k], tensors[k]) for k in tensors)
    cached = load_mod.load_tokenizer(second)
    text = "The capital of France is Paris; 12,345 ünïcödé tokens.\n = = Heading = =\n"
    chat = [{"role": "user", "content": "hi"}]
    assert cached.encode(text) == tok.encode(text)
    assert cached.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
