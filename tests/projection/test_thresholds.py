"""Thresholds files: round trip, validation against model dims, bad input."""

from __future__ import annotations

import pytest

from sparsedecode.account.dims import ModelDims
from sparsedecode.errors import InputError
from sparsedecode.projection.thresholds import Thresholds, parse_key, site_params, site_width

SMOL = ModelDims.known("smollm2-135m")
QWEN = ModelDims.known("qwen2.5-coder-0.5b")


def make(dims: ModelDims = SMOL, model: str | None = None) -> Thresholds:
    values = {f"layers.{i}.{s}": 0.125 * (i + 1) + j / 64
              for i in range(dims.n_layers) for j, s in enumerate(("q", "o", "down"))}
    values["layers.0.act"] = 0.75
    return Thresholds(values=values, method="teal", keep=0.5, model=model or dims.name,
                      dims=dims.to_dict(), keep_metric="param_keep",
                      calibration={"text": "wiki.valid.raw[:4096]", "tokens": 4096},
                      extras={"greedy": True, "step": 0.02})


def test_round_trip_keeps_values_and_header(tmp_path):
    th = make()
    path = th.save(tmp_path / "sub" / "t.safetensors")
    back = Thresholds.load(path)
    assert back.values == th.values  # all values are exact in float32
    assert back.header() == th.header()
    assert back.get(3, "o") == th.values["layers.3.o"]
    assert back.get(3, "k") is None  # no key: that site stays dense
    assert back.sites == ["q", "o", "down", "act"]


def test_validate_accepts_same_model_and_refuses_other_dims():
    th = make()
    assert th.validate(SMOL) is None
    with pytest.raises(InputError) as e:
        th.validate(QWEN)
    msg = str(e.value)
    assert "n_layers 30 (thresholds) vs 24 (model)" in msg
    assert "d 576 (thresholds) vs 896 (model)" in msg
    assert "d_ff 1536 (thresholds) vs 4864 (model)" in msg
    assert "sparsedecode calibrate --model qwen2.5-coder-0.5b" in msg


def test_other_checkpoint_with_same_dims_loads_with_a_note():
    th = make(model="SmolLM2-135M-base")
    with pytest.warns(UserWarning, match="SmolLM2-135M-base"):
        note = th.validate(SMOL)
    assert "smollm2-135m" in note and "same dims" in note


def test_keys_beyond_the_model_or_unknown_sites_are_refused():
    th = make()
    th.values["layers.30.q"] = 0.1
    with pytest.raises(InputError, match="layers.30.q"):
        th.validate(SMOL)
    with pytest.raises(InputError, match="not layers.N.SITE"):
        Thresholds(values={"layers.0.qk": 0.1}, method="teal", keep=0.5, model="m", dims={})
    with pytest.raises(InputError):
        parse_key("layer.0.q")


def test_loading_a_missing_or_foreign_file_says_how_to_fix(tmp_path):
    with pytest.raises(InputError, match="sparsedecode calibrate"):
        Thresholds.load(tmp_path / "none.safetensors")
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(InputError, match="is not a sparsedecode thresholds file"):
        Thresholds.load(tmp_path / "w.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(InputError, match="not a safetensors thresholds file"):
        Thresholds.load(tmp_path / "junk.safetensors")


def test_site_widths_and_parameter_counts():
    assert [site_width(QWEN, s) for s in ("q", "o", "gate", "down", "act")] == [896, 896, 896, 4864, 4864]
    assert site_params(SMOL, "k") == 576 * 3 * 64
    assert sum(site_params(SMOL, s) for s in ("q", "k", "v", "o", "gate", "up", "down")) == SMOL.proj_params


def test_cats_projection_keep_prices_up_and_down_by_the_act_keep():
    """SATS §3.2: q, k, v, o and gate read whole; up's rows and down's columns at the kept fraction of
    SiLU(gate) channels. act_keep_of_mlp inverts the MLP's own weight keep (what the counters give)."""
    from sparsedecode.projection.thresholds import act_keep_of_mlp, cats_projection_keep

    dims = ModelDims(name="m", d=8, d_ff=24, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4, vocab=10)
    attn, mlp_one = 8 * 8 + 2 * 8 * 4 + 8 * 8, 8 * 24  # q, k, v (one KV head of 4), o; one MLP matrix
    total = attn + 3 * mlp_one
    assert cats_projection_keep(dims, 1.0) == pytest.approx(1.0)
    assert cats_projection_keep(dims, 0.0) == pytest.approx((attn + mlp_one) / total)
    assert cats_projection_keep(dims, 0.25) == pytest.approx((attn + mlp_one + 2 * mlp_one * 0.25) / total)
    for k in (0.0, 0.3, 1.0):
        assert act_keep_of_mlp(dims, (1 + 2 * k) / 3) == pytest.approx(k)
