"""The CPU decode step as one C call (kernels/cpu_step.c, engine/cpu_step.py; issue 46 item 2)
against the PyTorch step it replaces: the same logits and tokens at keep 1.0 on odd shapes (GQA
groups, head widths, q/k/v biases, Qwen3's q/k norms, untied heads), in float32, bfloat16 and
float16; TEAL thresholds read as the PyTorch step reads them (one step from the same cache, the
same kept channels per site); a KV selection's compact buffer; a threshold set in place; and the
refusals, in words, of what it cannot run."""

from __future__ import annotations

import pytest
import torch

import sparsedecode
from sparsedecode.errors import InputError
from sparsedecode.kernels.cpu_step import step_entry
from sparsedecode.kernels.options import KernelOptions
from sparsedecode.projection.thresholds import Thresholds

pytestmark = pytest.mark.skipif(step_entry(torch.float32) is None, reason="no C compiler: the C step is not built")

LLAMA = dict(model_type="llama", hidden_size=96, intermediate_size=136, num_hidden_layers=3,
             num_attention_heads=6, num_key_value_heads=2, vocab_size=101, max_position_embeddings=1024,
             rope_theta=10000.0, eos_token_id=None, tie_word_embeddings=True)
SHAPES = {
    "llama-gqa3": LLAMA,
    "llama-mha-untied": dict(LLAMA, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    "qwen2-bias-head40": dict(LLAMA, model_type="qwen2", hidden_size=120, num_attention_heads=3,
                              num_key_value_heads=1, intermediate_size=200),
    "qwen3-qk-norm": dict(LLAMA, model_type="qwen3", head_dim=32, num_attention_heads=4, num_key_value_heads=2),
}
OFF = KernelOptions.parse("cpu.step=false")
PROMPT = list(range(3, 90)) + list(range(5, 60))  # 142 tokens: every thread takes a share of the keys


def _pair(cfg, dtype="float32", max_len=400):
    kw = dict(init="random", device="cpu", dtype=dtype, max_len=max_len, quiet=True, seed=3)
    return sparsedecode.load(dict(cfg), **kw), sparsedecode.load(dict(cfg), kernels=OFF, **kw)


def _teacher_forced(c, ref, steps, tokens=None):
    """Both engines from the same prompt, fed the same tokens: the logits of every step."""
    out = []
    la, lb = c.prefill(PROMPT), ref.prefill(PROMPT)  # the prefill is PyTorch's in both
    assert c.dtype != ref.dtype or torch.equal(la, lb)
    tok = int(lb.argmax())
    for s in range(steps):
        t = tok if tokens is None else tokens[s]
        a, b = c.decode_step(t).clone(), ref.decode_step(t).clone()
        out.append((a, b))
        tok = int(b.argmax())
    return out


@pytest.mark.parametrize("name", SHAPES)
def test_the_c_step_gives_the_pytorch_steps_logits_at_keep_1(name):
    c, ref = _pair(SHAPES[name])
    assert (c.kernels.cpu.step, ref.kernels.cpu.step) == (True, False)
    for a, b in _teacher_forced(c, ref, 40):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)
        assert int(a.argmax()) == int(b.argmax())
    assert (c.step_runtime, ref.step_runtime) == ("C step", "eager")
    assert c.cpu_step_refusal is None


def test_greedy_tokens_equal_the_pytorch_step():
    c, ref = _pair(LLAMA)
    assert c.generate(PROMPT, 48, stop_ids=()).ids == ref.generate(PROMPT, 48, stop_ids=()).ids


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_weights_and_cache_against_float32_math_on_the_same_values(dtype):
    """The C step widens half weights and cache entries in registers and keeps float32 math; the
    reference is the float32 PyTorch step on the same (rounded) weights."""
    if step_entry(getattr(torch, dtype)) is None:
        pytest.skip(f"no {dtype} C step on this compiler")
    kw = dict(init="random", device="cpu", max_len=400, quiet=True, seed=3)
    c = sparsedecode.load(dict(LLAMA), dtype=dtype, **kw)
    ref = sparsedecode.load(dict(LLAMA), dtype="float32", kernels=OFF, **kw)
    with torch.no_grad():
        for (_, p), (_, q) in zip(c.model.named_parameters(), ref.model.named_parameters(), strict=True):
            q.copy_(p.float())
    for a, b in _teacher_forced(c, ref, 24):
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)
    assert c.step_runtime == "C step"


def _median_thresholds(eng) -> Thresholds:
    """Per site the median |input| of one PyTorch decode step (keep about 0.5 everywhere)."""
    seen = {}
    hooks = []
    for i, layer in enumerate(eng.model.layers):
        for s, mod in (("q", layer.self_attn.q_proj), ("k", layer.self_attn.k_proj), ("v", layer.self_attn.v_proj),
                       ("o", layer.self_attn.o_proj), ("gate", layer.mlp.gate_proj), ("up", layer.mlp.up_proj),
                       ("down", layer.mlp.down_proj)):
            hooks.append(mod.register_forward_pre_hook(
                lambda m, a, k=f"layers.{i}.{s}": seen.__setitem__(k, float(a[0].abs().median()))))
    eng.prefill(PROMPT)
    eng.decode_step(7)
    for h in hooks:
        h.remove()
    eng.reset()
    return Thresholds(values=seen, method="teal", keep=0.5, model=eng.name, dims=eng.dims.to_dict())


def _tracked_counts(eng) -> list:
    from sparsedecode.projection.sparse_linear import sparse_modules

    return [m.kept_counts() for m in sparse_modules(eng.model)]


def test_teal_thresholds_keep_the_channels_the_pytorch_step_keeps():
    c, ref = _pair(LLAMA)
    th = _median_thresholds(ref)
    runs = []
    for e in (c, ref):
        e.sparsify(th)
        with e.tracking_keep() as keep_of:
            e.prefill(PROMPT)
            logits = e.decode_step(11).clone()
            runs.append((keep_of(), _tracked_counts(e), logits))
            e.reset()
    (ka, ca, a), (kb, cb, b) = runs
    assert ca == cb and 0.3 < ka < 0.7 and ka == kb  # every site kept the same channels, about half
    torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)
    assert c.step_runtime == "C step"
    # a threshold set in place reaches the next step of the same plan: every site kept (keep 1)
    for e in (c, ref):
        e.sparsify(Thresholds(values={k: 0.0 for k in th.values}, method="teal", keep=1.0, model=e.name,
                              dims=e.dims.to_dict()))
    for a, b in _teacher_forced(c, ref, 8):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


def test_a_kv_selection_reads_its_compact_buffer():
    c, ref = _pair(LLAMA, max_len=480)
    long = PROMPT * 3  # 426 tokens: SnapKV at keep 0.3 holds its sinks and observation window
    for e in (c, ref):
        e.configure("sel0.3")
    want = ref.generate(long, 24, stop_ids=())
    got = c.generate(long, 24, stop_ids=())
    assert got.ids == want.ids and c.kv is not None and c.kv.budget < len(long)
    assert c.step_runtime == "C step"
    plan = c._cpu_plan[1]
    for layer, desc in zip(c.model.layers, plan.layers, strict=True):  # the step reads the compact buffer
        assert desc.k_comp == layer.self_attn.cache.compact[0].data_ptr() and desc.t_comp < len(long)


def test_what_the_c_step_cannot_run_falls_back_in_words_or_is_refused():
    c, _ = _pair(LLAMA)
    hook = c.model.layers[1].mlp.down_proj.register_forward_pre_hook(lambda m, a: None)
    c.generate(PROMPT, 3, stop_ids=())
    assert c.step_runtime == "eager" and "forward hook" in c.cpu_step_refusal
    hook.remove()
    c.generate(PROMPT, 3, stop_ids=())
    assert c.step_runtime == "C step"
    masked = sparsedecode.load(dict(LLAMA), init="random", device="cpu", max_len=400, quiet=True,
                               attention="sdpa_masked")
    masked.generate(PROMPT, 3, stop_ids=())
    assert masked.step_runtime == "eager" and "sdpa_masked" in masked.cpu_step_refusal
    asked = sparsedecode.load(dict(LLAMA), init="random", device="cpu", max_len=400, quiet=True,
                              attention="sdpa_masked", kernels=KernelOptions.parse("cpu.step=true"))
    with pytest.raises(InputError, match="cpu.step=true.*sdpa_masked"):
        asked.generate(PROMPT, 3, stop_ids=())
    with pytest.raises(InputError, match="cpu.step=true runs the decode step of a CPU engine of batch 1"):
        sparsedecode.load(dict(LLAMA), init="random", device="cpu", max_len=400, quiet=True, batch=2,
                          kernels=KernelOptions.parse("cpu.step=true"))
    batch = sparsedecode.load(dict(LLAMA), init="random", device="cpu", max_len=400, quiet=True, batch=2)
    assert batch.kernels.cpu.step is False  # resolved off: a batch runs its own step


def test_without_a_built_c_step_the_default_is_off_and_asking_for_it_is_refused(monkeypatch):
    import sparsedecode.kernels.cpu_step as ks

    monkeypatch.setattr(ks, "step_entry", lambda dtype: None)  # as on a CPU without a C compiler
    off = sparsedecode.load(dict(LLAMA), init="random", device="cpu", max_len=400, quiet=True)
    assert off.kernels.cpu.step is False
    off.generate(PROMPT, 3, stop_ids=())
    assert off.step_runtime == "eager" and off.cpu_step_refusal is None
    with pytest.raises(InputError, match="cpu.step=true, and there is no torch.float32 C step"):
        sparsedecode.load(dict(LLAMA), init="random", device="cpu", max_len=400, quiet=True,
                          kernels=KernelOptions.parse("cpu.step=true"))


def test_a_position_past_the_cache_is_refused():
    from sparsedecode.engine.cpu_step import CpuStep

    c, _ = _pair(LLAMA, max_len=200)
    step = CpuStep(c.model)
    with pytest.raises(InputError, match="position 200 is outside"):
        step(5, 200)


def test_an_unmerged_adapter_runs_the_pytorch_step_with_it_not_the_c_step_without_it():
    """The C step reads the base weights only: with an adapter attached to a site (projection.lora_attach)
    the step falls back in words, and its logits are the PyTorch step's with the adapter."""
    from sparsedecode.projection.lora_attach import attach_lora_, detach_lora_

    c, ref = _pair(LLAMA)
    _teacher_forced(c, ref, 1)
    assert c.step_runtime == "C step"  # a plan made before the adapter came: it must not be reused
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(4, LLAMA["intermediate_size"], generator=gen) * 0.1  # (r, in) of down
    b = torch.randn(LLAMA["hidden_size"], 4, generator=gen) * 0.1  # (out, r)
    for eng in (c, ref):
        attach_lora_(eng.model, {"layers.1.down": (a, b)}, 2.0)
    (x, y), = _teacher_forced(c, ref, 1)
    assert c.step_runtime == "eager" and "unmerged LoRA adapter" in c.cpu_step_refusal
    torch.testing.assert_close(x, y)
    for eng in (c, ref):
        detach_lora_(eng.model)
    (x, _), = _teacher_forced(c, ref, 1)
    assert c.step_runtime == "C step", c.cpu_step_refusal
