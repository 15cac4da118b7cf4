"""Kernel options as a campaign axis (`variants`), recorded whole in every cell, and the
transformers peer as a cell of its own (`impl = "transformers"`): the jobs the hand-written
device scripts did, as bench cell / campaign run."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli
from sparsedecode.errors import InputError
from sparsedecode.timing.campaign import cell_argv, parse_spec, plan
from sparsedecode.timing.cell import CellSpec
from sparsedecode.timing.cells import load_cells

TINY = dict(model_type="llama", hidden_size=96, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, vocab_size=100, max_position_embeddings=512,
            rope_theta=10000.0, eos_token_id=None)
TOP = ('name = "v"\nmodel = "{model}"\ninit = "random"\ndtype = "float32"\ndevice = "cpu"\nblocks = 2\n'
       'repeats = 2\nsteps = 3\nwarmup = 1\nfill = "random"\nobs = 16\n')


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def test_a_cell_keeps_its_kernel_options_in_canonical_form():
    assert CellSpec(model="m", context=64, kernels="attention.min_split_keys=128").kernels == ""  # the default
    c = CellSpec(model="m", context=64, kernels="attention.min_split_keys=none, gemv.pdl=false")
    assert c.kernels == "gemv.pdl=false,attention.min_split_keys=none"
    assert c.kernel_options.gemv.pdl is False and c.kernel_options.attention.min_split_keys is None
    with pytest.raises(InputError, match="unknown kernel option 'gemv.tiles'"):
        CellSpec(model="m", context=64, kernels="gemv.tiles=4")


def test_variants_are_groups_of_their_own_interleaved_block_by_block(tiny):
    spec = parse_spec(TOP.format(model=tiny) + '[[grid]]\ngroup = "step"\ncontexts = [64]\n'
                      'modes = ["dense", "proj0.5"]\nvariants = ["default", "gemv.pdl=false"]\n')
    cells = plan(spec)
    assert {(c.group, c.kernels) for c in cells} == {("step", ""), ("step.gemv.pdl-false", "gemv.pdl=false")}
    assert len(cells) == 2 * 2 * 2  # variants x modes x blocks
    assert [c.block for c in cells] == [0, 0, 0, 0, 1, 1, 1, 1]
    argv = cell_argv(next(c for c in cells if c.kernels), "out.json")
    assert argv[argv.index("--kernels") + 1] == "gemv.pdl=false"
    assert "--kernels" not in cell_argv(next(c for c in cells if not c.kernels), "out.json")


@pytest.mark.parametrize("grid,match", [
    ('variants = ["gemv.pdl=false", "gemv.pdl=false"]', "twice"),
    ('variants = ["gemv.pdl=maybe"]', "variants: gemv.pdl=maybe: write true or false"),
    ('variants = [3]', "variants entry 3"),
    ('impl = "vllm"', "impl 'vllm'"),
    ('impl = "transformers"', "the transformers peer times the dense step"),
])
def test_bad_variants_and_peers_are_refused(tiny, grid, match):
    with pytest.raises(InputError, match=match):
        parse_spec(TOP.format(model=tiny) + f'[[grid]]\ngroup = "g"\ncontexts = [64]\nmodes = ["dense", "proj0.5"]\n{grid}\n')


def test_the_transformers_peer_is_a_cell_the_reports_read(tmp_path, capsys):
    out = tmp_path / "cells" / "peer" / "dense_64_b0.json"
    r = run_cli(capsys, "bench", "cell", "--impl", "transformers", "--model", "smollm2-135m", "--init", "random",
                "--fill", "random", "--context", "64", "--warmup", "1", "--repeats", "2", "--steps", "2",
                "--device", "cpu", "--group", "peer", "--out", str(out))
    assert r.returncode == 0, r.stderr
    rec = json.loads(out.read_text())
    assert rec["impl"] == "transformers" and rec["cache"] == "StaticCache" and rec["label"] == "CPU transformers"
    assert rec["dense_step"] == "transformers forward" and "dense step: transformers forward" in r.stdout
    (cell,) = load_cells(tmp_path).cells
    assert cell.mode == "dense" and cell.context == 64 and cell.ms_per_token == pytest.approx(rec["ms_per_token"])


@pytest.mark.parametrize("args,match", [
    (["--mode", "proj0.5", "--fill", "random"], "dense step only"),
    (["--fill", "prefill"], "fill = 'random'"),
    (["--fill", "random", "--kernels", "gemv.pdl=false"], "takes none"),
])
def test_the_peer_refuses_what_it_cannot_time(capsys, args, match):
    r = run_cli(capsys, "bench", "cell", "--impl", "transformers", "--model", "smollm2-135m", "--init", "random",
                "--context", "64", "--device", "cpu", *args)
    assert r.returncode == 2 and match in r.stderr and "Traceback" not in r.stderr


def test_the_graph_peer_refuses_a_cpu_device(capsys):
    r = run_cli(capsys, "bench", "cell", "--impl", "graph", "--model", "smollm2-135m", "--init", "random",
                "--fill", "random", "--context", "64", "--device", "cpu")
    assert r.returncode == 2 and "CUDA graph" in r.stderr and "Traceback" not in r.stderr


def _naive_step(dims, weights, theta, eps, slots):
    """The hand-written step written out head by head: keys repeated for GQA, softmax by hand."""
    import torch

    emb, head, norm, layers = weights
    hd, g = dims.head_dim, dims.n_heads // dims.n_kv_heads
    ang = (slots - 1) / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])

    def rms(x, w):
        return x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * w

    def rope(x):
        return x * cos + torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1) * sin

    x = emb[1].double()
    for wq, wk, wv, wo, wg, wu, wd, n1, n2, kc, vc in (tuple(t.double() for t in layer) for layer in layers):
        a = rms(x, n1)
        q = rope((wq @ a).view(dims.n_heads, hd))
        k, v = rope((wk @ a).view(-1, hd)), (wv @ a).view(-1, hd)
        keys, vals = kc[0].clone(), vc[0].clone()  # (kvh, slots, hd); the new token at the last slot
        keys[:, -1], vals[:, -1] = k, v
        outs = []
        for i in range(dims.n_heads):
            s = keys[i // g] @ q[i] / hd ** 0.5
            outs.append(torch.softmax(s, 0) @ vals[i // g])
        x = x + wo @ torch.cat(outs)
        a = rms(x, n2)
        x = x + wd @ (torch.nn.functional.silu(wg @ a) * (wu @ a))
    return head.double() @ rms(x, norm.double())


@pytest.mark.parametrize("attend", ["grouped", "gqa"])
def test_the_graph_peers_step_is_grouped_query_attention_written_out(attend):
    """The peer's SDPA forms (query groups as the query length; enable_gqa) against the step head
    by head, on odd dims (2 layers, 3 query heads per KV head, 7 slots)."""
    import torch

    from sparsedecode.account.dims import ModelDims
    from sparsedecode.timing.peer import graph_forward

    dims = ModelDims(name="odd", n_layers=2, d=48, d_ff=80, n_heads=6, n_kv_heads=2, head_dim=8, vocab=37)
    cfg = {"rope_theta": 10000.0, "rms_norm_eps": 1e-5}
    forward, weights = graph_forward(dims, cfg, 7, torch.float32, torch.device("cpu"), seed=3, attend=attend)
    before = [layer[9].clone() for layer in weights[3]]
    got = forward()[0].double()
    want = _naive_step(dims, weights, 10000.0, 1e-5, 7)  # it sets the last slot itself
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got - want).abs().max()
    assert not torch.equal(weights[3][0][9][:, :, -1], before[0][:, :, -1])  # the step wrote its key
