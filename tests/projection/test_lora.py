"""LoRA adapters merged at load (issue 45 item 2; SATS paper §4.2): the format round-trips, a zero
B leaves the base model's logits exactly, the merged model equals the unmerged computation
base(x_m) + s·B(A x_m) under TEAL and CATS masks (prefill under the masked reference, and the
real sparse decode step), and an adapter of another model, or another adapter than the loaded
one, is refused with the reason."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import sparsedecode
from shapes import tiny_llama
from sparsedecode.errors import InputError
from sparsedecode.projection.calibrate import get_calibrator, masks
from sparsedecode.projection.lora import (
    CONFIG_FILE,
    PEFT_PREFIX,
    WEIGHTS_FILE,
    Adapter,
    LoraFactor,
    LoraSpec,
    lora_factors,
    projection_shape,
    save_adapter,
    site_of,
)

TINY = tiny_llama(hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6)
OTHER = {**TINY, "intermediate_size": 128}


def _engine(model=TINY, **kw):
    return sparsedecode.load(dict(model), init="random", dtype="float32", max_len=128, seed=3, **kw)


def _factors(dims, spec: LoraSpec, seed: int, zero_b: bool = False) -> dict[str, LoraFactor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(dims.n_layers):
        for m in spec.modules:
            o, n = projection_shape(dims, m)
            A = torch.randn(spec.rank, n, generator=gen) * 0.3
            B = torch.zeros(o, spec.rank) if zero_b else torch.randn(o, spec.rank, generator=gen) * 0.3
            out[site_of(i, m)] = LoraFactor(A, B, spec.scale)
    return out


def _adapter(tmp_path, name="a", targets="all", zero_b=False, model=TINY, seed=0, meta=None):
    eng = _engine(model)
    spec = LoraSpec(rank=4, alpha=8, targets=targets)
    meta = {"model": eng.name, "dims": eng.dims.to_dict()} if meta is None else meta
    return save_adapter(tmp_path / name, spec, _factors(eng.dims, spec, seed, zero_b), meta)


IDS = torch.randint(0, 100, (48,), generator=torch.Generator().manual_seed(1))


def test_the_folder_is_peft_s_layout_and_round_trips(tmp_path):
    path = _adapter(tmp_path, targets="mlp")
    cfg = json.loads((path / CONFIG_FILE).read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8
    assert sorted(cfg["target_modules"]) == ["down_proj", "gate_proj", "up_proj"]
    from safetensors import safe_open

    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
        keys = set(f.keys())
    assert f"{PEFT_PREFIX}layers.2.mlp.down_proj.lora_A.weight" in keys and len(keys) == 3 * 3 * 2
    a = Adapter.load(path)
    assert a.spec == LoraSpec(rank=4, alpha=8, targets="mlp") and a.meta["model"] == "llama"
    got = lora_factors(path, _engine().dims)
    A, B, s = got["layers.1.mlp.up_proj"]
    assert A.shape == (4, 96) and B.shape == (160, 4) and s == 2.0


@pytest.mark.filterwarnings("ignore:Unexpected keyword arguments:UserWarning")  # our block: peft skips it
def test_peft_reads_the_config(tmp_path):
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig.from_pretrained(str(_adapter(tmp_path)))
    assert cfg.r == 4 and cfg.lora_alpha == 8


def test_a_zero_b_gives_the_base_model_exactly(tmp_path):
    base, merged = _engine(), _engine(adapter=_adapter(tmp_path, zero_b=True))
    assert torch.equal(base.prefill(IDS, all_logits=True), merged.prefill(IDS, all_logits=True))
    assert torch.equal(base.decode_step(IDS[:1]), merged.decode_step(IDS[:1]))


def test_an_adapter_changes_the_model(tmp_path):
    """The merge is not a no-op (so the equalities here can fail)."""
    base, merged = _engine(), _engine(adapter=_adapter(tmp_path))
    assert not torch.allclose(base.prefill(IDS, all_logits=True), merged.prefill(IDS, all_logits=True), atol=1e-3)


class Unmerged(nn.Module):
    """base(x) + s·B(A x): the LoRA computation with the factors apart (masks hook its input)."""

    def __init__(self, base: nn.Module, f: LoraFactor):
        super().__init__()
        self.base, self.A, self.B, self.s = base, f.A, f.B, f.scale

    def forward(self, x):
        return self.base(x) + self.s * ((x @ self.A.T) @ self.B.T)


def _unmerged(adapter_path):
    eng = _engine()
    eng.need_linear("the unmerged reference")  # nn.Linear at every site
    for key, f in Adapter.load(adapter_path).factors.items():
        parent, _, name = key.rpartition(".")
        p = eng.model.get_submodule(parent)
        setattr(p, name, Unmerged(getattr(p, name), f))
    return eng


@pytest.mark.parametrize("method", ["teal", "cats"])
def test_merged_equals_base_plus_lora_of_the_masked_input(tmp_path, method):
    """(W + sBA) x_m == W x_m + sB(A x_m) with the mask on x for TEAL sites (both paths see x_m)
    and on SiLU(gate) for CATS; the prefill runs under the masks (the masked reference)."""
    path = _adapter(tmp_path, targets="all")
    merged, ref = _engine(adapter=path), _unmerged(path)
    # seeded: a threshold a hair from a channel's value flips its mask between the two float orders
    calib = torch.randint(0, 100, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    th = get_calibrator(method, keep=0.5).calibrate(merged, calib)
    with masks(merged.model, th.values):
        got = merged.prefill(IDS, all_logits=True)
    with masks(ref.model, th.values):
        want = ref.prefill(IDS, all_logits=True)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    with torch.no_grad():  # the masks change the output: the check above is not the dense one
        assert not torch.allclose(got, ref.prefill(IDS, all_logits=True), atol=1e-3)


@pytest.mark.parametrize("method", ["teal", "cats"])
def test_the_sparse_decode_step_of_the_merged_model(tmp_path, method):
    """The real decode step (the CPU sparse kernels, or the masked reference) of a merged engine
    under thresholds equals the unmerged computation with the same masks, step after step."""
    path = _adapter(tmp_path, targets="all")
    merged, ref = _engine(adapter=path), _unmerged(path)
    th = get_calibrator(method, keep=0.5).calibrate(merged, torch.randint(0, 100, (512,)).tolist())
    th_file = th.save(tmp_path / "t.safetensors")
    merged.configure(f"proj[{th_file}]")
    merged.prefill(IDS[:32])
    ref.prefill(IDS[:32])
    for t in range(32, 40):
        got = merged.decode_step(IDS[t:t + 1])
        with masks(ref.model, th.values):
            want = ref.prefill(IDS[t:t + 1], start=t, all_logits=True)[0]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_an_adapter_of_other_dims_is_refused(tmp_path):
    path = _adapter(tmp_path, model=OTHER)
    with pytest.raises(InputError, match=r"dims differ.*d_ff 128 \(adapter\) vs 160 \(model\)"):
        _engine(adapter=path)


def test_factors_of_other_shapes_are_refused_without_a_block(tmp_path):
    """A plain peft adapter (no sparsedecode block) is still checked by its tensors' shapes."""
    path = _adapter(tmp_path, model=OTHER, meta={})
    with pytest.raises(InputError, match=r"layers\.0\.\w+\.\w+ has A .* it was made for another model"):
        _engine(adapter=path)


def test_an_adapter_of_another_base_model_is_refused(tmp_path):
    eng = _engine()
    path = _adapter(tmp_path, meta={"model": "smollm2-135m", "dims": eng.dims.to_dict()})
    with pytest.raises(InputError, match="trained on 'smollm2-135m', not 'llama'"):
        _engine(adapter=path)


def test_the_adapter_is_fixed_for_the_engine_s_life(tmp_path):
    a, b = _adapter(tmp_path, "a"), _adapter(tmp_path, "b", seed=1)
    eng = _engine(adapter=a)
    assert str(eng.config) == f"lora[{a}]"
    assert eng.configure("dense").adapter == str(a)  # a config without one runs the loaded one
    assert eng.configure(f"lora[{a}]").adapter == str(a)
    with pytest.raises(InputError, match="loaded adapter .* for its life"):
        eng.configure(f"lora[{b}]")
    with pytest.raises(InputError, match="loaded none"):
        _engine().configure(f"lora[{a}]")
    assert _engine(config=f"lora[{b}]").adapter.path == b  # the load's config names it
    with pytest.raises(InputError, match="name different adapters"):
        _engine(adapter=a, config=f"lora[{b}]")


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.update(r=0), r"r is 0; a LoRA rank is a whole number >= 1"),
    (lambda c: c.update(peft_type="IA3"), "not a LoRA adapter config"),
    (lambda c: c.update(use_dora=True), "DoRA"),
    (lambda c: c.update(target_modules=["lm_head"]), "target_modules"),
])
def test_bad_adapter_configs_are_refused(tmp_path, edit, match):
    path = _adapter(tmp_path)
    cfg = json.loads((path / CONFIG_FILE).read_text())
    edit(cfg)
    (path / CONFIG_FILE).write_text(json.dumps(cfg))
    with pytest.raises(InputError, match=match):
        Adapter.load(path)


def test_a_missing_folder_is_refused(tmp_path):
    with pytest.raises(InputError, match="not a folder"):
        Adapter.load(tmp_path / "nope")


@pytest.mark.parametrize("rank", [0, -1])
def test_a_rank_below_one_is_refused(rank):
    with pytest.raises(InputError, match=r"rank.*>= 1"):
        LoraSpec(rank=rank)
