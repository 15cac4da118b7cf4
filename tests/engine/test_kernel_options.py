"""The engine owns the kernel options: `load(kernels=...)` and `Engine.set_kernels` reach every
attention layer and every sparse projection (those made later too), and a cell records them."""

from __future__ import annotations

import json

import pytest
import torch

import sparsedecode
from sparsedecode.errors import InputError
from sparsedecode.kernels.cpu_gemv import has_entry
from sparsedecode.kernels.options import GemvOptions, KernelOptions
from sparsedecode.projection.sparse_linear import sparse_modules
from sparsedecode.projection.thresholds import SITES, Thresholds

CFG = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=100, max_position_embeddings=256, rope_theta=10000.0, eos_token_id=None)
OPTS = KernelOptions.parse("gemv.pdl=false,gemv.programs_per_sm=4,attention.min_split_keys=none")
CPU_GEMV = has_entry("sd_gemv_rows", torch.float32)  # gemv.dense's default on the CPU: on where it was built
CPU_STEP = has_entry("sd_step", torch.float32)  # cpu.step's default on a CPU engine of batch 1: on where built


def _thresholds(eng, t: float) -> Thresholds:
    values = {f"layers.{i}.{s}": t for i in range(2) for s in SITES[:7]}
    return Thresholds(values=values, method="teal", keep=0.5, model=eng.name, dims=eng.dims.to_dict())


def _options(eng):
    attn = {layer.self_attn.kernel_options for layer in eng.model.layers}
    gemv = {m.options for m in sparse_modules(eng.model)}
    return attn, gemv


def test_load_and_set_kernels_reach_every_layer_and_later_projections():
    eng = sparsedecode.load(dict(CFG), init="random", device="cpu", max_len=64, kernels=OPTS)
    resolved = OPTS.with_(gemv__dense=CPU_GEMV, cpu__step=CPU_STEP)  # the defaults: on where the CPU kernel was built
    assert eng.kernels_asked == OPTS and eng.kernels == resolved and _options(eng)[0] == {OPTS.attention}
    eng.sparsify(_thresholds(eng, 0.02))  # sparse modules made after the options were set
    assert _options(eng) == ({OPTS.attention}, {resolved.gemv})
    eng.set_kernels(KernelOptions())
    assert _options(eng) == ({KernelOptions().attention}, {GemvOptions(dense=CPU_GEMV)})
    with pytest.raises(InputError, match="takes a KernelOptions"):
        eng.set_kernels({"gemv": {"pdl": False}})


def test_options_leave_the_numbers_of_the_reference_path_alone():
    ids = torch.randint(0, 100, (12,), generator=torch.Generator().manual_seed(0))
    out = []
    for opts in (KernelOptions(), OPTS):
        eng = sparsedecode.load(dict(CFG), init="random", device="cpu", max_len=64, kernels=opts)
        eng.sparsify(_thresholds(eng, 0.02))
        eng.prefill(ids[:-3])
        out.append(torch.stack([eng.decode_step(int(t)).clone() for t in ids[-3:]]))
    assert torch.equal(*out)  # CPU runs the references: launch options change nothing there


def test_a_cell_records_its_kernel_options_whole(tmp_path, capsys):
    from conftest import run_cli

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CFG))
    out = tmp_path / "cell.json"
    r = run_cli(capsys, "bench", "cell", "--model", str(cfg), "--init", "random", "--context", "32", "--mode",
                "proj0.5", "--warmup", "1", "--repeats", "1", "--steps", "2", "--device", "cpu", "--fill", "random",
                "--obs", "8", "--calib-tokens", "256", "--kernels", "gemv.pdl=false", "--out", str(out))
    assert r.returncode == 0, r.stderr
    rec = json.loads(out.read_text())
    # what ran, resolved: gemv.dense's default is on where the CPU kernel was built
    assert KernelOptions.from_dict(rec["kernels"]) == KernelOptions.parse(
        f"gemv.pdl=false,gemv.dense={str(CPU_GEMV).lower()},cpu.step={str(CPU_STEP).lower()}")
    assert rec["spec"]["kernels"] == "gemv.pdl=false"
    label = "our GEMV reading every row" if CPU_GEMV else "F.linear"
    assert rec["dense_step"] == label and f"dense step: {label}" in r.stdout
