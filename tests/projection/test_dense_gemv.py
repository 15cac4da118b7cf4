"""gemv.dense: the dense sites of a decode step run the sparse GEMV reading every row (issue 26),
against the same engine with nn.Linear projections; refused where the kernel does not run."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from test_sparse_linear import DECODE, TINY, run, site_inputs, site_modules

import sparsedecode
from interpreted import run_interpreted
from sparsedecode.errors import InputError
from sparsedecode.kernels.options import CpuOptions, GemvOptions, KernelOptions
from sparsedecode.projection.thresholds import Thresholds, site_key

# The PyTorch step, whose per-site calls these tests count (the C step that runs the whole step in
# one call where it can, cpu.step, is tested against it in tests/engine/test_cpu_step.py)
DENSE = KernelOptions(gemv=GemvOptions(dense=True), cpu=CpuOptions(step=False))
LINEAR = KernelOptions(gemv=GemvOptions(dense=False), cpu=CpuOptions(step=False))  # the nn.Linear step: the reference


def _worker() -> None:
    """Under TRITON_INTERPRET=1: dense logits through the GEMV against nn.Linear; an MLP-only
    file on top fills the MLP thresholds in place (the attention sites keep their layout and
    read every row); turning the option off brings nn.Linear back."""
    import json

    from sparsedecode.projection.sparse_linear import READ_ALL, SparseLinear
    from sparsedecode.projection.thresholds import Thresholds

    plain = sparsedecode.load(dict(TINY), init="random", device="cpu", max_len=64, kernels=LINEAR)
    eng = sparsedecode.load(dict(TINY), init="random", device="cpu", max_len=64, kernels=DENSE)
    eng.model.load_state_dict(plain.model.state_dict(), strict=False)
    mods = site_modules(eng.model)
    all_gemv = all(isinstance(m, SparseLinear) and m.threshold.item() == READ_ALL for m in mods.values())
    _, want = run(plain)
    _, got = run(eng)
    dense_err = (got - want).abs().max().item() / want.abs().max().item()

    inputs = site_inputs(plain, site_modules(plain.model))
    ff = {k: float(torch.stack(v).abs().quantile(0.5)) for k, v in inputs.items() if k.split(".")[-1] in ("gate", "up", "down")}
    th = Thresholds(values=ff, method="teal", keep=0.5, model=eng.name, dims=eng.dims.to_dict())
    q_before = mods["layers.0.q"].w_t.data_ptr()
    plain.sparsify(th)
    eng.sparsify(th)
    after = site_modules(eng.model)
    _, want_ff = run(plain)
    _, got_ff = run(eng)
    ff_err = (got_ff - want_ff).abs().max().item() / want_ff.abs().max().item()
    eng.set_kernels(LINEAR)
    back = site_modules(eng.model)
    print(json.dumps({
        "all_gemv": all_gemv, "dense_err": dense_err, "ff_err": ff_err,
        "q_in_place": after["layers.0.q"].w_t.data_ptr() == q_before,
        "q_reads_all": after["layers.0.q"].threshold.item() == READ_ALL,
        "down_threshold": after["layers.0.down"].threshold.item(), "down_wanted": ff["layers.0.down"],
        "linear_mlp_after_off": type(back["layers.0.q"]).__name__, "kernels": eng.kernels.gemv.dense,
        "still_sparse": type(back["layers.0.down"]).__name__,
    }))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_dense_sites_through_the_gemv_decode_as_linear_under_interpreter():
    r = run_interpreted(__file__, "_worker")
    assert r["all_gemv"] and r["dense_err"] <= 1e-5, r
    assert r["ff_err"] <= 1e-5 and r["q_in_place"] and r["q_reads_all"], r
    assert r["down_threshold"] == pytest.approx(r["down_wanted"]), r
    assert r["linear_mlp_after_off"] == "Linear" and r["still_sparse"] == "SparseLinear" and not r["kernels"], r


def test_dense_gemv_on_cpu_runs_the_c_kernel_and_decodes_as_linear(monkeypatch):
    """Issue 46 item 2: on a CPU where `kernels.cpu_gemv` is built, gemv.dense=true runs every
    projection through it reading every row, q|k|v and gate|up as one call each (SparseConcat),
    and decodes what nn.Linear decodes (float32)."""
    import sparsedecode.projection.sparse_linear as sl
    from sparsedecode.projection.sparse_linear import READ_ALL, SparseConcat, SparseLinear, cpu_rows

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not cpu_rows(torch.zeros(1, 1)):
        pytest.skip("the CPU kernel could not be built here (no C compiler)")
    plain = sparsedecode.load(dict(TINY), init="random", device="cpu", max_len=64, kernels=LINEAR)
    eng = sparsedecode.load(dict(TINY), init="random", device="cpu", max_len=64, kernels=DENSE)
    eng.model.load_state_dict(plain.model.state_dict(), strict=False)
    mods = site_modules(eng.model)
    assert all(isinstance(m, SparseLinear) and m.threshold.item() == READ_ALL for m in mods.values())
    layer = eng.model.layers[0]
    assert isinstance(layer.self_attn.qkv, SparseConcat) and isinstance(layer.mlp.gate_up, SparseConcat)
    widths = []
    real = sl.sparse_gemv_cpu
    monkeypatch.setattr(sl, "sparse_gemv_cpu", lambda x, w_t, *a, **k: (widths.append(w_t.shape[1]), real(x, w_t, *a, **k))[1])
    _, want = run(plain)  # decode logits, each step fed the same token
    _, got = run(eng)
    fused = {sum(layer.self_attn.qkv.widths), sum(layer.mlp.gate_up.widths)}
    assert widths and fused <= set(widths) and len(widths) == 4 * TINY["num_hidden_layers"] * len(DECODE)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_dense_gemv_is_refused_where_no_kernel_runs(monkeypatch):
    import sparsedecode.projection.sparse_linear as sl

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(sl, "cpu_rows", lambda w_t: False)  # as on a CPU without a C compiler
    with pytest.raises(InputError, match="gemv.dense=true .* no torch.float32 kernel .* drop gemv.dense=true"):
        sparsedecode.load(dict(TINY), init="random", device="cpu", max_len=64, kernels=DENSE)
    assert KernelOptions.parse("gemv.dense=true,cpu.step=false") == DENSE
    with pytest.raises(InputError, match="gemv.dense must be true, false or none"):
        GemvOptions(dense=1)
    assert KernelOptions.parse("gemv.dense=none") == KernelOptions() and KernelOptions().gemv.dense is None
    eng = sparsedecode.load(dict(TINY), init="random", device="cpu", max_len=64)
    assert eng.kernels.gemv.dense is False and eng.kernels_asked.gemv.dense is None  # the default, off here
    monkeypatch.undo()  # the kernel back: the default turns it on on the CPU
    if sl.cpu_rows(torch.zeros(1, 1)):
        assert sparsedecode.load(dict(TINY), init="random", device="cpu", max_len=64).kernels.gemv.dense is True


def _teal(eng, t=0.02) -> Thresholds:
    values = {site_key(i, s): t for i in range(eng.dims.n_layers) for s in ("gate", "up", "down")}
    return Thresholds(values=values, method="teal", keep=0.5, model=eng.name, dims=eng.dims.to_dict())


def _cats(eng, t=0.05) -> Thresholds:
    values = {site_key(i, "act"): t for i in range(eng.dims.n_layers)}
    return Thresholds(values=values, method="cats", keep=0.5, model=eng.name, dims=eng.dims.to_dict())


def test_dense_gemv_asked_for_is_refused_beside_cats(monkeypatch):
    """CATS runs the dense MLP's nn.Linear modules beside its path: gemv.dense=true asked for is
    refused there (where the kernel runs: the interpreter), naming the fix."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    eng = sparsedecode.load(dict(TINY), init="random", device="cpu", max_len=64, kernels=DENSE)
    assert eng.kernels.gemv.dense is True
    with pytest.raises(InputError, match="CATS thresholds run the dense nn.Linear .* drop gemv.dense=true"):
        eng.sparsify(_cats(eng))
    assert eng.linear_needed_by is None and eng.kernels.gemv.dense is True  # refused: the engine as it was


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="needs a CUDA GPU and triton")
def test_the_default_on_cuda_runs_the_gemv_and_yields_to_cats():
    from sparsedecode.projection.sparse_linear import SparseLinear

    eng = sparsedecode.load(dict(TINY), init="random", device="cuda", dtype="bfloat16", max_len=64)
    q = lambda: eng.model.layers[0].self_attn.q_proj  # noqa: E731
    assert eng.kernels.gemv.dense is True and isinstance(q(), SparseLinear)  # the default on CUDA
    eng.sparsify(_cats(eng))
    assert eng.kernels.gemv.dense is False and type(q()).__name__ == "Linear" and eng.linear_needed_by
    eng.sparsify(_teal(eng))  # no CATS any more: the default turns the GEMV back on
    assert eng.kernels.gemv.dense is True and isinstance(q(), SparseLinear) and eng.linear_needed_by is None
    eng.set_kernels(KernelOptions.parse("gemv.dense=false"))  # asked for: F.linear
    assert eng.kernels.gemv.dense is False and type(q()).__name__ == "Linear"


def test_sparse_sites_fused_on_cpu_decode_as_the_sites_alone(monkeypatch):
    """TEAL thresholds differ per site (§3.2): on CPU q|k|v and gate|up run as one segmented call
    each (`sparse_gemv_segs_cpu`), decoding what the unfused sites decode, with the same realized
    keep counted per site."""
    import sparsedecode.projection.sparse_linear as sl
    from sparsedecode.projection.sparse_linear import (
        SparseConcat,
        cpu_rows,
        realized_projection_keep,
        sparsify_,
    )

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not cpu_rows(torch.zeros(1, 1)):
        pytest.skip("the CPU kernel could not be built here (no C compiler)")
    fused = sparsedecode.load(dict(TINY), init="random", device="cpu", max_len=64, kernels=LINEAR)
    alone = sparsedecode.load(dict(TINY), init="random", device="cpu", max_len=64, kernels=LINEAR)
    alone.model.load_state_dict(fused.model.state_dict(), strict=False)
    inputs = site_inputs(fused, site_modules(fused.model))
    keeps = (0.3, 0.5, 0.7)  # q, k, v (and gate, up, down) keep different fractions
    th = {k: float(torch.stack(v).abs().quantile(keeps[i % 3])) for i, (k, v) in enumerate(inputs.items())}
    sparsify_(fused.model, th, track=True)
    sparsify_(alone.model, th, track=True, fuse=False)
    assert isinstance(fused.model.layers[0].self_attn.qkv, SparseConcat) and alone.model.layers[0].self_attn.qkv is None
    calls = []
    real = sl.sparse_gemv_segs_cpu
    monkeypatch.setattr(sl, "sparse_gemv_segs_cpu", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    _, want = run(alone)
    assert not calls
    _, got = run(fused)
    assert len(calls) == 2 * TINY["num_hidden_layers"] * len(DECODE)  # q|k|v and gate|up of every layer, every step
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert realized_projection_keep(fused.model) == realized_projection_keep(alone.model) < 1
