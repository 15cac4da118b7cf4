"""An adapter run apart (kernels lora.merge=false; issue 45 item 3, SATS paper §4.2): the engine
attaches the factors to every adapted site after load and after every change of projection
modules, and decodes as the merged engine does, dense and under TEAL thresholds, across
configure calls; a CATS MLP with an unmerged up adapter is refused before anything changes; the
choice is fixed for the engine's life. Random adapters ('random:r16:all', the timing protocol's
stand-in on random weights) are seeded and shaped by the model, and campaign grids carry one."""

from __future__ import annotations

import pytest
import torch
from test_lora import IDS, _adapter, _engine

from sparsedecode.errors import InputError
from sparsedecode.kernels.options import KernelOptions
from sparsedecode.projection.calibrate import get_calibrator
from sparsedecode.projection.lora import LoraSpec, random_adapter, random_spec
from sparsedecode.projection.lora_attach import lora_sites
from sparsedecode.projection.sparse_linear import SparseLinear

APART = KernelOptions.parse("lora.merge=false")
SITES = 3 * 7  # TINY's layers x the seven projections


def _decode(eng, n=8):
    """Prefill IDS[:32] and decode n tokens teacher-forced: (prefill logits (32, V), decode (n, V))."""
    p = eng.prefill(IDS[:32], all_logits=True).clone()
    return p, torch.stack([eng.decode_step(IDS[t:t + 1]).clone() for t in range(32, 32 + n)])


def _close(got, want, what):
    """float32 sums in other orders (merged weight vs base + adapter; a GPU's kernels vs eager)."""
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= 1e-4 * max(scale, 1.0), f"{what}: off by {err:.3g} (logits up to {scale:.3g})"


def test_apart_decodes_as_merged_across_configure(tmp_path):
    path = _adapter(tmp_path, targets="all")
    merged, apart, base = _engine(adapter=path), _engine(adapter=path, kernels=APART), _engine()
    assert merged.kernels.lora.merge and not apart.kernels.lora.merge
    assert len(lora_sites(apart.model)) == SITES and not lora_sites(merged.model)
    th = get_calibrator("teal", keep=0.5).calibrate(base, torch.randint(0, 100, (512,)).tolist())
    th_file = th.save(tmp_path / "t.safetensors")
    for cfg in ("dense", f"proj[{th_file}]", "dense", f"proj[{th_file}]"):
        merged.configure(cfg)
        apart.configure(cfg)
        assert len(lora_sites(apart.model)) == SITES, f"after configure({cfg}) every site holds its adapter"
        (pm, dm), (pa, da) = _decode(merged), _decode(apart)
        _close(pa, pm, f"{cfg}: prefill apart vs merged")
        _close(da, dm, f"{cfg}: decode apart vs merged")
    base.configure(f"proj[{th_file}]")
    _, d0 = _decode(base)
    assert (d0 - da).abs().max().item() > 1e-3, "the adapter must change the sparse step (else the check is empty)"
    if apart.device.type == "cpu":  # the C step reads base weights only: the PyTorch step runs, and says why
        assert apart.step_runtime == "eager" and "unmerged LoRA adapter" in apart.cpu_step_refusal


def test_every_site_is_a_gemv_with_its_factors(tmp_path):
    apart = _engine(adapter=_adapter(tmp_path, targets="mlp"), kernels=APART)
    for layer in apart.model.layers:
        for name in ("gate_proj", "up_proj", "down_proj"):
            mod = getattr(layer.mlp, name)
            assert isinstance(mod, SparseLinear) and mod.has_lora and mod.lora_scale == 2.0
        assert not getattr(layer.self_attn.q_proj, "has_lora", False)  # not a target


def test_cats_with_an_up_adapter_apart_decodes_as_merged(tmp_path):
    """CATS with adapters on gate, up and down held apart: up's adapter rides on the CatsMLP (the
    row-gather adds it for the kept rows), and the model decodes as the merged one at the same
    thresholds, prefill and decode, through CATS and back to dense."""
    path = _adapter(tmp_path, targets="mlp")
    apart, merged = _engine(adapter=path, kernels=APART), _engine(adapter=path)
    th = get_calibrator("cats", keep=0.5).calibrate(_engine(), torch.randint(0, 100, (512,)).tolist())
    th_file = th.save(tmp_path / "c.safetensors")
    for cfg in (f"proj[{th_file}]", "dense", f"proj[{th_file}]"):
        apart.configure(cfg)
        merged.configure(cfg)
        assert len(lora_sites(apart.model)) == 3 * 3, f"after configure({cfg}) every MLP site holds its adapter"
        (pm, dm), (pa, da) = _decode(merged), _decode(apart)
        _close(pa, pm, f"{cfg}: prefill apart vs merged")
        _close(da, dm, f"{cfg}: decode apart vs merged")
    assert all(layer.mlp.has_up_lora for layer in apart.model.layers)
    assert apart.attach_adapter() == 0, "every site holds its adapter: nothing to attach again"


def test_merge_is_fixed_once_an_adapter_is_loaded(tmp_path):
    apart = _engine(adapter=_adapter(tmp_path), kernels=APART)
    with pytest.raises(InputError, match="lora.merge=true: this engine loaded adapter .* apart"):
        apart.set_kernels(KernelOptions())
    apart.set_kernels(KernelOptions.parse("lora.merge=false,gemv.pdl=false"))  # other options still change
    plain = _engine()
    plain.set_kernels(APART)  # no adapter: nothing to keep apart
    with pytest.raises(InputError, match="cpu.step=true with lora.merge=false"):  # refused at load, before work
        _engine(adapter=_adapter(tmp_path, "c"), kernels=KernelOptions.parse("lora.merge=false,cpu.step=true"),
                device="cpu")
    on_cpu = _engine(adapter=_adapter(tmp_path, "d"), kernels=APART, device="cpu")
    with pytest.raises(InputError, match="cpu.step=true with lora.merge=false"):  # and afterwards
        on_cpu.set_kernels(KernelOptions.parse("lora.merge=false,cpu.step=true"))
    with pytest.raises(InputError, match="lora.merge=1: write true or false"):
        KernelOptions.parse("lora.merge=1")
    with pytest.raises(InputError, match="lora.merge must be true or false"):
        KernelOptions().with_(lora__merge=1)


def test_random_adapters_are_seeded_and_shaped_by_the_model():
    assert random_spec("random:r16:all") == LoraSpec(rank=16, alpha=32, targets="all")
    assert random_spec("random:r4:mlp").modules == ("gate_proj", "up_proj", "down_proj")
    assert random_spec("some/folder") is None
    for bad in ("random:16:all", "random:r16", "random:r16:qkv", "random:r0:all"):
        with pytest.raises(InputError, match=f"adapter '{bad}'"):
            random_spec(bad)
    dims = _engine().dims
    a, b = random_adapter("random:r4:all", dims, seed=1), random_adapter("random:r4:all", dims, seed=1)
    assert len(a.factors) == SITES and a.meta["model"] == dims.name
    f = a.factors["layers.2.mlp.down_proj"]
    assert f.A.shape == (4, dims.d_ff) and f.B.shape == (dims.d, 4) and f.scale == 2.0
    assert torch.equal(f.A, b.factors["layers.2.mlp.down_proj"].A)
    assert not torch.equal(f.A, random_adapter("random:r4:all", dims, seed=2).factors["layers.2.mlp.down_proj"].A)
    with pytest.raises(InputError, match="above"):
        random_adapter("random:r1000:all", dims)
    eng = _engine(adapter="random:r4:mlp", kernels=APART)
    assert str(eng.config) == "lora[random:r4:mlp]" and len(lora_sites(eng.model)) == 3 * 3
    assert eng.configure("lora[random:r4:mlp]").adapter == "random:r4:mlp"


def test_a_campaign_grid_carries_an_adapter_and_its_variants(tmp_path):
    from sparsedecode.timing.campaign import plan
    from sparsedecode.timing.spec import parse_spec

    text = ('name = "lora"\nmodel = "llama-3.1-8b"\ninit = "random"\nblocks = 1\n'
            '[[grid]]\ngroup = "base"\ncontexts = ["2K"]\nmodes = ["dense", "proj0.5"]\n'
            '[[grid]]\ngroup = "lora"\ncontexts = ["2K"]\nmodes = ["dense", "proj0.5"]\n'
            'adapter = "random:r16:all"\nvariants = ["", "lora.merge=false"]\n')
    cells = plan(parse_spec(text, "lora.toml"))
    got = sorted((c.group, c.mode, c.adapter, c.kernels) for c in cells)
    assert got == [("base", "dense", "", ""), ("base", "proj0.5", "", ""),
                   ("lora", "dense", "random:r16:all", ""), ("lora", "proj0.5", "random:r16:all", ""),
                   ("lora.lora.merge-false", "dense", "random:r16:all", "lora.merge=false"),
                   ("lora.lora.merge-false", "proj0.5", "random:r16:all", "lora.merge=false")]
    from sparsedecode.timing.campaign import cell_argv

    argv = cell_argv(next(c for c in cells if c.kernels), tmp_path / "r.json")  # the cell's process gets both
    assert argv[argv.index("--adapter") + 1] == "random:r16:all" and argv[argv.index("--kernels") + 1] == "lora.merge=false"
    assert "--adapter" not in cell_argv(next(c for c in cells if c.group == "base"), tmp_path / "r.json")
    with pytest.raises(InputError, match=r"\[\[grid\]\] 2 \('lora'\): adapter 'random:16'.*random:r<rank>"):
        parse_spec(text.replace("random:r16:all", "random:16"), "lora.toml")
    with pytest.raises(InputError, match=r"\[\[grid\]\] 2 \('lora'\): adapter .*not a folder"):
        parse_spec(text.replace("random:r16:all", str(tmp_path / "nope")), "lora.toml")

