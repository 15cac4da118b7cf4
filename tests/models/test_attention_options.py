"""The split-K kernel's options held by each attention layer (`kernel_options`): set on every layer
by `set_attention_options_` and passed down to the attention call of a decode step, whichever path
it takes (the one-launch `rope_attention`, split_k over the cache, the window, the compact buffer).
That the kernel launches with what it is passed is tests/kernels/test_decode_attention.py's
`test_options_reach_the_kernel_under_interpreter`."""

from __future__ import annotations

import pytest
import torch

from sparsedecode.errors import InputError
from sparsedecode.kernels.options import AttentionOptions
from sparsedecode.kernels.rope_attention import rope_attention_ref
from sparsedecode.kernels.rope_cache import rope_cache_ref
from sparsedecode.models import decoder
from sparsedecode.models.decoder import ModelArgs, Transformer, init_random_, set_attention_options_

LAYERS = 3


def tiny() -> Transformer:
    args = ModelArgs(model_type="llama", dim=32, n_layers=LAYERS, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48,
                     vocab=50)
    model = Transformer(args)
    init_random_(model, std=0.2)
    model.setup_cache(40)
    return model


def test_set_attention_options_sets_every_layer():
    model = tiny()
    assert all(layer.self_attn.kernel_options == AttentionOptions() for layer in model.layers)
    opts = AttentionOptions(programs_per_sm=3, min_split_keys=None)
    assert set_attention_options_(model, opts) == LAYERS
    assert all(layer.self_attn.kernel_options is opts for layer in model.layers)
    with pytest.raises(InputError, match="AttentionOptions"):
        set_attention_options_(model, {"programs_per_sm": 3})
    assert all(layer.self_attn.kernel_options is opts for layer in model.layers)  # nothing set when refused


@pytest.mark.parametrize("one_launch", [False, True])
@pytest.mark.parametrize("read", ["cache", "window", "compact"])
def test_a_decode_step_passes_the_layer_options_down(read, one_launch, monkeypatch):
    """Each layer's call gets its layer's options. one_launch: the decoder runs as where the
    Triton kernels are usable, with their PyTorch references standing in for them."""
    model = tiny()
    opts = AttentionOptions(min_split_keys=256)
    set_attention_options_(model, opts)
    seen = []

    def spy(name, fn):
        def call(*args, options, **kw):
            seen.append((name, options))
            return fn(*args, options=options, **kw)
        monkeypatch.setattr(decoder, name, call)

    spy("decode_attention", decoder.decode_attention)
    spy("window_attention", decoder.window_attention)
    spy("rope_attention", rope_attention_ref)
    monkeypatch.setattr(decoder, "rope_cache_usable", lambda x: one_launch)
    monkeypatch.setattr(decoder, "rope_cache", rope_cache_ref)
    ids = torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids[:, :5], torch.arange(5), start=0)
        for layer in model.layers:
            cache = layer.self_attn.cache
            if read == "window":
                cache.read_window(2, 2)
            elif read == "compact":
                cache.read_compact(cache.k[:, :, :8].clone(), cache.v[:, :, :8].clone(), torch.tensor([0]))
        logits = model(ids[:, 5:], torch.tensor([5]))
    assert torch.isfinite(logits).all()
    name = "window_attention" if read == "window" else "rope_attention" if one_launch else "decode_attention"
    assert seen == [(name, opts)] * LAYERS


def test_the_one_launch_compact_step_is_the_compiled_steps_math(monkeypatch):
    """A decode step over compact buffers (a KV selection) through the one-launch path, with its
    reference standing in for the kernel, gives the logits, buffers and cache rows of the plain
    path (RoPE, both writes, split-K over the buffer): the slot is pos - offset, the angles pos's."""
    ids = torch.randint(0, 50, (1, 12), generator=torch.Generator().manual_seed(1))
    out = {}
    for one_launch in (False, True):
        model = tiny()
        with monkeypatch.context() as m:
            m.setattr(decoder, "rope_cache_usable", lambda x, one=one_launch: one)
            m.setattr(decoder, "rope_attention", rope_attention_ref)
            m.setattr(decoder, "rope_cache", rope_cache_ref)
            with torch.no_grad():
                model(ids[:, :11], torch.arange(11), start=0)
                offset = torch.tensor([5])
                bufs = []
                for layer in model.layers:  # keep positions 0, 2 and 5..10 in slots 0..5 (offset 5: slot 6 is next)
                    cache = layer.self_attn.cache
                    keep = torch.tensor([0, 2, 7, 8, 9, 10])
                    kb, vb = torch.zeros(1, 2, 9, 8), torch.zeros(1, 2, 9, 8)
                    kb[:, :, :6], vb[:, :, :6] = cache.k[:, :, keep], cache.v[:, :, keep]
                    cache.read_compact(kb, vb, offset)
                    bufs.append((kb, vb, cache))
                logits = model(ids[:, 11:], torch.tensor([11]))
        out[one_launch] = (logits, [(kb.clone(), vb.clone(), c.k.clone(), c.v.clone()) for kb, vb, c in bufs])
    torch.testing.assert_close(out[True][0], out[False][0])
    for got, want in zip(out[True][1], out[False][1], strict=True):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)
    assert out[True][1][0][0][:, :, 6].abs().sum() > 0  # the new entry landed at slot 11 - 5
