"""The embedded GGUF defaults (from PyPI) against transformers on the same GGUF file, float32."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

# Prompts that make each model answer at length, so >= 32 greedy tokens are compared.
CHAT_PROMPTS = {
    "smollm2-135m": "Write a short story about a robot who learns to paint.",
    "qwen2.5-coder-0.5b": "Write a Python function that checks whether a number is prime, with comments.",
}


@pytest.fixture(scope="module", params=list(CHAT_PROMPTS))
def pair(request, embedded_engine):
    from transformers import AutoModelForCausalLM

    ours = embedded_engine(request.param)
    src = ours.source_path
    hf = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    yield request.param, ours, hf.eval()
    del hf


def test_source_is_the_cached_pypi_gguf(pair):
    from sparsedecode.account.known import known_model

    name, ours, _ = pair
    km = known_model(name)
    assert ours.source_path.suffix == ".gguf" and ours.source_path.is_file()
    if km.gguf_size is not None:
        assert ours.source_path.stat().st_size == km.gguf_size
    assert ours.dims.n_layers == km.config["num_hidden_layers"]
    assert ours.dims.d == km.config["hidden_size"]


def test_forward_logits_on_wikitext_match_hf(pair, wikitext_test):
    _, ours, hf = pair
    ids = ours.tokenizer(wikitext_test[:20000])["input_ids"][:512]
    assert len(ids) == 512
    got = ours.forward_logits(ids)  # (512, V)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    err = (got - ref).abs().max().item()
    assert err <= 1e-3 * ref.abs().max().item(), f"max |dlogit| {err:.3g} vs max |logit| {ref.abs().max():.3g}"


def test_greedy_chat_generation_matches_hf(pair):
    name, ours, hf = pair
    out = ours.generate(CHAT_PROMPTS[name], max_new_tokens=40, chat=True)
    prompt = torch.tensor([out.prompt_ids])
    with torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=40, do_sample=False)[0, prompt.shape[1]:].tolist()
    assert len(out.ids) >= 32, f"stopped after {len(out.ids)} tokens: {out.text!r}"
    n = min(len(out.ids), len(ref))
    assert out.ids[:n] == ref[:n], f"ours {out.text!r} vs hf {ours.tokenizer.decode(ref)!r}"
    assert out.text and out.text.strip()
