"""SparseLinear at the seven projection sites of a tiny random engine (ByteCross §3.2, §4.1).

On CPU the sparse path is the C kernel (kernels.cpu_gemv: it computes the masked product), so
these tests pin the math and the bookkeeping: threshold 0 decodes as dense, positive thresholds
change decode but never prefill, densify_ restores the dense model exactly, and the realized
keep equals the parameter-weighted fraction of |x| above threshold computed from
the sites' inputs independently.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sparsedecode
from interpreted import run_interpreted
from sparsedecode.errors import InputError
from sparsedecode.kernels.options import GemvOptions, KernelOptions
from sparsedecode.projection.sparse_linear import (
    SITE_KEYS,
    SparseConcat,
    SparseLinear,
    densify_,
    projection_call_bytes,
    realized_projection_keep,
    set_gemv_options_,
    site_key,
    sparse_modules,
    sparsify_,
)

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=100, max_position_embeddings=256,
            rope_theta=10000.0, eos_token_id=None)
PROMPT = [1, 5, 7, 9, 11, 2, 40]
DECODE = [3, 4, 5, 60, 17]
CUDA = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def tiny_engine(device="cpu", dtype=None, kernels=None):
    """A random tiny engine whose dense step is nn.Linear (the reference these tests sparsify) unless
    `kernels` says otherwise."""
    kernels = KernelOptions(gemv=GemvOptions(dense=False)) if kernels is None else kernels
    return sparsedecode.load(dict(TINY), init="random", device=device, dtype=dtype, max_len=64, kernels=kernels)


def run(engine):
    """(prefill logits (L, V), decode logits (steps, V)) from an empty cache, greedy-free."""
    engine.reset()
    prefill = engine.prefill(PROMPT, all_logits=True).clone()
    decode = torch.stack([engine.decode_step(t).clone() for t in DECODE])
    return prefill, decode


def all_keys(n_layers: int, value) -> dict:
    return {site_key(i, s): value for i in range(n_layers) for s in SITE_KEYS}


def site_inputs(engine, modules) -> dict:
    """Run `run(engine)` recording every one-token input of each module: name -> list of (K,)."""
    seen, hooks = {}, []
    for name, mod in modules.items():
        def hook(_, args, name=name):
            x = args[0]
            if x.shape[:-1].numel() == 1:
                seen.setdefault(name, []).append(x.detach().reshape(-1).clone())
        hooks.append(mod.register_forward_pre_hook(hook))
    try:
        run(engine)
    finally:
        for h in hooks:
            h.remove()
    return seen


def site_modules(model) -> dict:
    return {site_key(i, s): getattr(p, s) for i, s, p in model.projection_sites()}


@pytest.fixture
def engine():
    return tiny_engine()


def test_threshold_zero_decodes_as_dense_and_densify_restores_exactly(engine):
    dense_p, dense_d = run(engine)
    mods = sparsify_(engine.model, all_keys(2, 0.0), track=True)
    assert len(mods) == 14 and all(isinstance(m, SparseLinear) for m in sparse_modules(engine.model))
    p, d = run(engine)
    # Same values; only the transposed layout changes the fp32 summation order of some sites.
    scale = dense_d.abs().max().item()
    assert (d - dense_d).abs().max().item() <= 1e-6 * scale, "threshold 0 must decode as dense"
    assert torch.equal(d.argmax(-1), dense_d.argmax(-1))
    assert (p - dense_p).abs().max().item() <= 1e-6 * scale
    assert realized_projection_keep(engine.model) == pytest.approx(1.0)  # random inputs: no exact zeros
    assert densify_(engine.model) == 14
    assert not sparse_modules(engine.model)
    p2, d2 = run(engine)
    assert torch.equal(p2, dense_p) and torch.equal(d2, dense_d), "densify_ must restore the dense model"


def test_thresholds_change_decode_not_prefill_and_keep_is_realized(engine):
    dense_p, dense_d = run(engine)
    inputs = site_inputs(engine, site_modules(engine.model))
    thresholds = {k: float(torch.stack(v).abs().quantile(0.5)) for k, v in inputs.items()}  # ~50%, no ties
    sparsify_(engine.model, all_keys(2, 0.0))
    zero_p, _ = run(engine)
    sparsify_(engine.model, thresholds, track=True)
    for m in sparse_modules(engine.model):
        m.reset_keep()
    mods = site_modules(engine.model)
    seen = site_inputs(engine, mods)  # one run, tracked and hooked at once
    # Independently: fraction of |x| > t per site, weighted by the site's parameters.
    num = den = 0.0
    for key, xs in seen.items():
        frac = (torch.stack(xs).abs() > thresholds[key]).double().mean().item()
        assert mods[key].realized_keep() == pytest.approx(frac, rel=1e-12), key
        params = mods[key].in_features * mods[key].out_features
        num, den = num + frac * params, den + params
    kept = num / den
    assert realized_projection_keep(engine.model) == pytest.approx(kept, rel=1e-12)
    # The same keeps per sparse GEMV launch of a layer (the decode benchmark's per-call byte times)
    calls = projection_call_bytes(engine.model)
    assert list(calls) == ["q|k|v", "o", "gate|up", "down"]
    members = {"q|k|v": ("q", "k", "v"), "o": ("o",), "gate|up": ("gate", "up"), "down": ("down",)}
    for call, names in members.items():
        mine = [m for k, m in mods.items() if k.rsplit(".", 1)[-1] in names]
        weights = [m.in_features * m.out_features * m.w_t.element_size() for m in mine]
        assert len(mine) == 2 * len(names) and calls[call]["dense"] == sum(weights), call
        assert calls[call]["read"] == pytest.approx(
            sum(w * m.realized_keep() for w, m in zip(weights, mine, strict=True)), rel=1e-12), call
    assert sum(c["read"] for c in calls.values()) / sum(c["dense"] for c in calls.values()) == pytest.approx(kept)
    p, d = run(engine)
    assert torch.equal(p, zero_p), "prefill must not depend on the thresholds"
    assert (d - dense_d).abs().max().item() > 1e-3, "positive thresholds must change decode logits"
    assert 0.3 < kept < 0.7


def test_ff_only_and_missing_or_bad_thresholds(engine):
    keys = {site_key(i, s): 0.01 for i in range(2) for s in ("gate_proj", "up_proj", "down_proj")}
    mods = sparsify_(engine.model, keys, ff_only=True)
    assert [m.site for m in mods] == [f"layers.{i}.{s}" for i in range(2) for s in ("gate", "up", "down")]
    attn = engine.model.layers[0].self_attn
    assert all(type(getattr(attn, s)) is nn.Linear for s in ("q_proj", "k_proj", "v_proj", "o_proj"))
    with pytest.raises(InputError, match="layers.0.q"):
        sparsify_(engine.model, keys)
    bad = all_keys(2, 0.1)
    del bad["layers.1.down"]
    with pytest.raises(InputError, match="layers.1.down"):
        sparsify_(engine.model, bad, ff_only=True)
    with pytest.raises(InputError, match=">= 0"):
        sparsify_(engine.model, all_keys(2, -1.0))
    with pytest.raises(InputError, match="unknown projection site"):
        site_key(0, "qkv_proj")
    with pytest.raises(InputError, match="no tracked sparse decode calls"):
        realized_projection_keep(engine.model)


@pytest.mark.parametrize("column_major", [False, True])
def test_from_linear_keeps_one_copy_and_the_linear_interface(column_major):
    torch.manual_seed(0)
    lin = nn.Linear(40, 24)
    if column_major:
        lin.weight = nn.Parameter(lin.weight.detach().t().contiguous().t())
    sp = SparseLinear.from_linear(lin, 0.0, site="layers.0.o")
    assert sp.w_t.shape == (40, 24) and sp.w_t.is_contiguous()
    assert (sp.w_t.data_ptr() == lin.weight.data_ptr()) == column_major  # no copy when already (in, out)
    assert (sp.in_features, sp.out_features) == (40, 24) and torch.equal(sp.weight, lin.weight)
    x = torch.randn(1, 1, 40)
    assert torch.allclose(sp(x), lin(x), atol=1e-6)
    xs = torch.randn(2, 3, 40)
    assert torch.equal(sp(xs), F.linear(xs, sp.w_t.t(), lin.bias))  # several tokens: dense
    sp.threshold.fill_(float("inf"))
    assert torch.equal(sp(x).reshape(-1), lin.bias.detach())  # every channel dropped: the bias
    back = sp.to_linear()
    assert torch.equal(back.weight, lin.weight) and back.weight.stride() == lin.weight.stride()


def test_dtype_cast_keeps_threshold_counts_and_workspace():
    sp = SparseLinear.from_linear(nn.Linear(16, 8), 0.25, track=True)
    sp.to(torch.bfloat16)
    assert sp.w_t.dtype == torch.bfloat16 and sp.bias.dtype == torch.bfloat16
    assert (sp.threshold.dtype, sp.kept.dtype, sp.ws_acc.dtype) == (torch.float32, torch.float64, torch.float32)
    x = torch.randn(1, 16).bfloat16()
    sp(x)
    assert sp.realized_keep() == pytest.approx((x.float().abs() > 0.25).float().mean().item())
    sites = [SparseLinear.from_linear(nn.Linear(16, n), 0.1) for n in (8, 4)]
    fused = SparseConcat(sites)
    fused.to(torch.bfloat16)  # the fused workspace stays fp32 too
    assert fused.w_t.dtype == torch.bfloat16 and fused.ws_acc.dtype == torch.float32


def test_gemv_options_are_held_by_every_sparse_module(engine):
    """sparsify_(gemv=) and set_gemv_options_ set the GemvOptions on every SparseLinear and
    SparseConcat; without gemv= new modules take the defaults and existing ones keep theirs."""
    n_layers = engine.model.args.n_layers
    mods = sparsify_(engine.model, all_keys(n_layers, 0.1), fuse=True)
    assert all(m.options == GemvOptions() for m in mods)
    opts = GemvOptions(pdl=False, programs_per_sm=4)
    fused = [layer.self_attn.qkv for layer in engine.model.layers] + [layer.mlp.gate_up for layer in engine.model.layers]
    assert set_gemv_options_(engine.model, opts) == 7 * n_layers + len(fused)
    assert all(m.options is opts for m in mods + fused)
    sparsify_(engine.model, all_keys(n_layers, 0.2))  # no gemv=: the modules keep theirs
    assert all(m.options is opts for m in sparse_modules(engine.model))
    again = GemvOptions(programs_per_sm=2)
    sparsify_(engine.model, all_keys(n_layers, 0.2), gemv=again)
    assert all(m.options is again for m in sparse_modules(engine.model) + fused)
    with pytest.raises(InputError, match="GemvOptions"):
        set_gemv_options_(engine.model, {"pdl": False})
    with pytest.raises(InputError, match="GemvOptions"):
        SparseLinear.from_linear(nn.Linear(8, 4), 0.1, options="pdl=false")


def _options_worker() -> None:
    """Under TRITON_INTERPRET=1: a SparseLinear's GemvOptions reach the custom op as plain values
    (programs_per_sm into default_config, whose split count it sets on a CUDA device), and the
    numbers equal the masked reference whatever the options."""
    import json

    from sparsedecode.kernels import common
    from sparsedecode.kernels import sparse_gemv as sg
    from sparsedecode.kernels.sparse_gemv import sparse_gemv_ref

    seen, rule = [], sg.default_config

    def spy(K, N, dtype, device, programs_per_sm=16):
        seen.append(programs_per_sm)
        return rule(K, N, dtype, device, programs_per_sm)

    sg.default_config = spy
    torch.manual_seed(0)
    lin = nn.Linear(301, 203)
    x = torch.randn(1, 301)
    outs = {}
    for opts in (GemvOptions(), GemvOptions(programs_per_sm=1), GemvOptions(pdl=False, programs_per_sm=3)):
        sp = SparseLinear.from_linear(lin, 0.4, options=opts)
        outs[str(opts)] = (sp(x), sp(x, residual=torch.ones(1, 203))[0])
    want = sparse_gemv_ref(x, sp.w_t, sp.threshold, sp.bias)
    sg.default_config = rule
    common.sm_count, common.device_name = (lambda index: 132), (lambda index: "NVIDIA H200")  # a mocked H200
    cuda = torch.device("cuda", 0)
    first, *rest = outs.values()
    print(json.dumps({
        "seen": sorted(set(seen)),
        "err": max((y - want).abs().max().item() for y, _ in outs.values()),
        "equal": all(torch.equal(a, b) for other in rest for a, b in zip(first, other, strict=True)),
        "splits": [rule(4096, 14336, torch.bfloat16, cuda, p)[2] for p in (16, 1)],
    }))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_gemv_options_reach_the_kernel_under_interpreter():
    r = run_interpreted(__file__, "_options_worker")
    assert r["seen"] == [1, 3, 16], r  # every module's programs_per_sm reached default_config
    assert r["err"] <= 1e-5 and r["equal"], r
    assert r["splits"][1] < r["splits"][0], r  # programs_per_sm=1: fewer splits on an H200-sized GPU


# ---- CUDA: the Triton kernel at the sites, compiled and captured by the engine -------------------


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU and triton")
@pytest.mark.usefixtures("fresh_dynamo")
def test_sparse_engine_on_cuda_matches_masked_reference():
    cpu = tiny_engine(dtype="float32")
    # nn.Linear at every site, as on the CPU, so the CPU engine's weights load one for one
    gpu = tiny_engine(device="cuda", dtype="float32", kernels=KernelOptions.parse("gemv.dense=false"))
    gpu.model.load_state_dict(cpu.model.state_dict())
    inputs = site_inputs(cpu, site_modules(cpu.model))
    thresholds = {k: float(torch.stack(v).abs().quantile(0.5)) for k, v in inputs.items()}
    for eng in (cpu, gpu):
        sparsify_(eng.model, thresholds, track=True)  # before the first decode step: captured sparse
    _, d_cpu = run(cpu)
    _, d_gpu = run(gpu)
    # Upstream fp32 rounding differs by device, so a channel next to its threshold may flip.
    assert (d_gpu.cpu() - d_cpu).abs().max().item() <= 2e-2 * d_cpu.abs().max().item()
    assert realized_projection_keep(gpu.model) == pytest.approx(realized_projection_keep(cpu.model), abs=0.02)


def _fused_worker() -> None:
    """Under TRITON_INTERPRET=1: q|k|v and gate|up as one segmented kernel launch each
    (SparseConcat), with the layers' RMSNorms and residual adds in the launches, down forming
    silu(gate) * up in its load as it adds the residual, against the unfused masked reference,
    site by site thresholds."""
    import json

    from sparsedecode.projection import sparse_linear

    glu_residual = []
    kernel = sparse_linear.sparse_gemv

    def counted(*args, **kw):  # the launches that form silu(gate) * up and add the residual
        glu_residual.append(kw.get("up") is not None and kw.get("residual") is not None)
        return kernel(*args, **kw)

    sparse_linear.sparse_gemv = counted

    ref, fused = tiny_engine(dtype="float32"), tiny_engine(dtype="float32")
    fused.model.load_state_dict(ref.model.state_dict())
    inputs = site_inputs(ref, site_modules(ref.model))
    thresholds = {k: float(torch.stack(v).abs().quantile(0.5)) for k, v in inputs.items()}
    sparsify_(ref.model, thresholds, track=True, fuse=False)
    sparsify_(fused.model, thresholds, track=True)  # fuse defaults on under the interpreter
    attached = [type(getattr(m, n)).__name__ for layer in fused.model.layers
                for m, n in ((layer.self_attn, "qkv"), (layer.mlp, "gate_up"))]
    shares = all(m.w_t.untyped_storage().data_ptr() == layer.self_attn.qkv.w_t.untyped_storage().data_ptr()
                 for layer in fused.model.layers
                 for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj))
    calls, normed, residual = [], [], []
    for layer in fused.model.layers:
        for mod in (layer.self_attn.qkv, layer.mlp.gate_up):
            mod.register_forward_hook(lambda *_: calls.append(1))
            mod.register_forward_hook(lambda m, a, kw, out: normed.append(kw.get("norm") is not None),
                                      with_kwargs=True)
        for mod in (layer.self_attn.o_proj, layer.mlp.down_proj):
            mod.register_forward_hook(lambda m, a, kw, out: residual.append(kw.get("residual") is not None),
                                      with_kwargs=True)
    p_ref, d_ref = run(ref)
    p_fused, d_fused = run(fused)
    keeps = (realized_projection_keep(ref.model), realized_projection_keep(fused.model))
    densify_(fused.model)
    unfused = [layer.self_attn.qkv is None and layer.mlp.gate_up is None
               for layer in fused.model.layers]
    densify_(ref.model)
    _, d_dense_ref = run(ref)
    _, d_dense_fused = run(fused)
    print(json.dumps({
        "attached": attached, "shares": shares, "fused_calls": len(calls), "unfused": all(unfused), "keeps": keeps,
        "normed_calls": sum(normed), "residual_calls": sum(residual), "glu_residual_calls": sum(glu_residual),
        "decode_err": (d_fused - d_ref).abs().max().item(), "scale": d_ref.abs().max().item(),
        "prefill_equal": torch.equal(p_fused, p_ref),
        "dense_after_densify": torch.equal(d_dense_ref, d_dense_fused),
    }))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_fused_layer_matches_unfused_under_interpreter():
    r = run_interpreted(__file__, "_fused_worker")
    assert r["attached"] == ["SparseConcat"] * 4 and r["shares"], r
    assert r["fused_calls"] == 2 * 2 * len(DECODE), "each decode step must run both fused launches per layer"
    # every decode launch of q|k|v and gate|up norms its input; o adds the residual through its
    # forward, down forms silu(gate) * up and adds the residual in one launch
    assert r["normed_calls"] == 2 * 2 * len(DECODE) and r["residual_calls"] == 2 * len(DECODE), r
    assert r["glu_residual_calls"] == 2 * len(DECODE), r
    assert r["decode_err"] <= 1e-5 * r["scale"], r
    assert r["keeps"][0] == pytest.approx(r["keeps"][1], rel=1e-12) and 0.3 < r["keeps"][0] < 0.7, r
    assert r["prefill_equal"] and r["unfused"] and r["dense_after_densify"], r
