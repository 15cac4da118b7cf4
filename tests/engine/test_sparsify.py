"""The engine runs the projection branch from a thresholds file: keep-1.0 thresholds decode
exactly as dense, real thresholds change decode but not prefill, CATS files run the
gate -> mask -> sparse down path and match the masked reference, and thresholds of other
dims are refused with a clear error."""

import pytest
import torch

import sparsedecode
from sparsedecode.errors import InputError
from sparsedecode.kernels.options import GemvOptions, KernelOptions
from sparsedecode.projection.thresholds import SITES, Thresholds

CFG = dict(
    model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
    max_position_embeddings=256, rope_theta=10000.0, eos_token_id=None,
)
LINEAR = KernelOptions(gemv=GemvOptions(dense=False))


def _engine():
    """nn.Linear dense sites (gemv.dense=false): the layout these tests check sparsify against."""
    return sparsedecode.load(dict(CFG), init="random", device="cpu", max_len=64, kernels=LINEAR)


def _thresholds(eng, t: float, sites=SITES[:7]) -> Thresholds:
    values = {f"layers.{i}.{s}": t for i in range(2) for s in sites}
    return Thresholds(values=values, method="teal", keep=0.5, model=eng.name, dims=eng.dims.to_dict())


def _decode(eng, ids):
    eng.reset()
    eng.prefill(ids[:-3])
    return torch.stack([eng.decode_step(int(t)).clone() for t in ids[-3:]])


def test_zero_thresholds_decode_as_dense_and_real_ones_do_not(tmp_path):
    ids = torch.randint(0, 100, (12,), generator=torch.Generator().manual_seed(0))
    eng = _engine()
    dense = _decode(eng, ids)
    prefill = eng.forward_logits(ids)
    path = _thresholds(eng, 0.0).save(tmp_path / "t0.safetensors")
    eng.sparsify(path)
    torch.testing.assert_close(_decode(eng, ids), dense, rtol=1e-5, atol=1e-5)
    eng.sparsify(_thresholds(eng, 0.02))
    assert not torch.allclose(_decode(eng, ids), dense, atol=1e-5)
    torch.testing.assert_close(eng.forward_logits(ids), prefill, rtol=1e-5, atol=1e-5)


def test_load_takes_thresholds_and_ff_only_files(tmp_path):
    eng = _engine()
    path = _thresholds(eng, 0.02, sites=("gate", "up", "down")).save(tmp_path / "ff.safetensors")
    eng = sparsedecode.load(dict(CFG), init="random", device="cpu", max_len=64, config=f"proj[{path}]",
                            kernels=LINEAR)
    attn, mlp = eng.model.layers[0].self_attn, eng.model.layers[0].mlp
    assert type(attn.q_proj).__name__ == "Linear" and type(mlp.up_proj).__name__ == "SparseLinear"


def test_other_dims_and_cats_are_refused():
    eng = _engine()
    other = _thresholds(eng, 0.1)
    other.dims = {**other.dims, "d_ff": 128}
    with pytest.raises(InputError, match="d_ff"):
        eng.sparsify(other)
    with pytest.raises(InputError, match="not both"):
        eng.sparsify(_thresholds(eng, 0.1, sites=("act", "q")))


def test_cats_runtime_drops_channels_below_the_activation_threshold():
    from sparsedecode.projection.calibrate import masks

    ids = torch.randint(0, 100, (12,), generator=torch.Generator().manual_seed(1))
    eng = _engine()
    dense = _decode(eng, ids)
    table = {f"layers.{i}.act": 0.01 for i in range(2)}
    # what the masked hooks of the calibrators compute, one token at a time
    eng.reset()
    eng.prefill(ids[:-3])
    with masks(eng.model, table):
        want = torch.stack([eng.decode_step(int(t)).clone() for t in ids[-3:]])
    eng.sparsify(_thresholds(eng, 0.0, sites=("act",)))
    torch.testing.assert_close(_decode(eng, ids), dense, rtol=1e-5, atol=1e-5)  # nothing dropped
    eng.sparsify(Thresholds(values=table, method="cats", keep=0.5, model=eng.name,
                            dims=eng.dims.to_dict(), keep_metric="act_keep"))
    got = _decode(eng, ids)
    assert not torch.allclose(got, dense, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    mlp = eng.model.layers[0].mlp
    mlp.track = True
    _decode(eng, ids)
    assert 0.0 < mlp.realized_keep() < 1.0


def test_switching_files_and_back_to_dense_leaves_nothing_behind():
    """CATS then dense, CATS then TEAL, TEAL then CATS: each configuration decodes as it
    does on a fresh engine, and dense puts plain modules back everywhere."""
    from sparsedecode.config import ProjectionConfig, SparsityConfig
    from sparsedecode.projection.cats_runtime import CatsMLP
    from sparsedecode.projection.sparse_linear import SparseLinear

    ids = torch.randint(0, 100, (12,), generator=torch.Generator().manual_seed(2))
    cats = Thresholds(values={f"layers.{i}.act": 0.01 for i in range(2)}, method="cats", keep=0.5,
                      model=_engine().name, dims=_engine().dims.to_dict(), keep_metric="act_keep")
    teal = _thresholds(_engine(), 0.02)

    def fresh(th):
        e = _engine()
        if th is not None:
            e.sparsify(th)
        return _decode(e, ids)

    want = {"dense": fresh(None), "cats": fresh(cats), "teal": fresh(teal)}
    eng = _engine()
    for name, th in (("cats", cats), ("dense", None), ("cats", cats), ("teal", teal), ("cats", cats),
                     ("dense", None)):
        eng.configure(SparsityConfig(None if th is None else ProjectionConfig(keep=th.keep)), thresholds=th)
        torch.testing.assert_close(_decode(eng, ids), want[name], rtol=0, atol=0, msg=f"after -> {name}")
        mods = [m for layer in eng.model.layers for m in layer.modules()]
        assert any(isinstance(m, CatsMLP) for m in mods) == (name == "cats"), name
        assert any(isinstance(m, SparseLinear) for m in mods) == (name != "dense"), name  # CATS's down
    assert all(type(layer.mlp).__name__ == "FeedForward" for layer in eng.model.layers)


def test_a_file_with_the_installed_sites_updates_thresholds_in_place():
    """TEAL 0.02 then 0.05, CATS 0.01 then 0.03, and ff-only after all seven sites: each decodes
    as on a fresh engine; files with the installed sites keep the installed modules (no weight
    laid out again), a file with other sites lays the projections out again."""
    from sparsedecode.projection.cats_runtime import CatsMLP
    from sparsedecode.projection.sparse_linear import sparse_modules

    ids = torch.randint(0, 100, (12,), generator=torch.Generator().manual_seed(3))
    proto = _engine()

    def cats(t):
        return Thresholds(values={f"layers.{i}.act": t for i in range(2)}, method="cats", keep=0.5,
                          model=proto.name, dims=proto.dims.to_dict(), keep_metric="act_keep")

    def fresh(th):
        e = _engine()
        e.sparsify(th)
        return _decode(e, ids)

    eng = _engine()
    eng.sparsify(_thresholds(eng, 0.02))
    mods = sparse_modules(eng.model)
    eng.sparsify(_thresholds(eng, 0.05))
    assert all(a is b for a, b in zip(sparse_modules(eng.model), mods, strict=True)), "same sites: same modules"
    torch.testing.assert_close(_decode(eng, ids), fresh(_thresholds(eng, 0.05)), rtol=0, atol=0)
    ff = _thresholds(eng, 0.05, sites=("gate", "up", "down"))
    eng.sparsify(ff)  # other sites: q, k, v, o dense again
    assert len(sparse_modules(eng.model)) == 2 * 3
    torch.testing.assert_close(_decode(eng, ids), fresh(ff), rtol=0, atol=0)

    eng.sparsify(cats(0.01))
    mlps = [layer.mlp for layer in eng.model.layers]
    eng.sparsify(cats(0.03))
    assert [layer.mlp for layer in eng.model.layers] == mlps and all(isinstance(m, CatsMLP) for m in mlps)
    torch.testing.assert_close(_decode(eng, ids), fresh(cats(0.03)), rtol=0, atol=0)


def test_cpu_runtime_reads_kept_rows_and_counts_them():
    """On CPU the projection branch runs the C kernels (kernels.cpu_gemv), says so, and counts the
    realized keep as it runs; CATS thresholds run the row-gather up on CPU too."""
    from sparsedecode.kernels.cpu_gemv import cpu_kernel

    if cpu_kernel().lib is None:
        pytest.skip(f"CPU kernel not built: {cpu_kernel().reason}")
    ids = torch.randint(0, 100, (12,), generator=torch.Generator().manual_seed(1))
    eng = _engine()
    assert eng.projection_runtime() is None
    eng.sparsify(_thresholds(eng, 0.02))
    assert eng.projection_runtime() == "CPU sparse GEMV (kept rows only)"
    with eng.tracking_keep() as keep_of:
        _decode(eng, ids)
        keep = keep_of()
    assert 0.0 < keep < 1.0
    eng.sparsify(Thresholds(values={f"layers.{i}.act": 0.01 for i in range(2)}, method="cats", keep=0.5,
                            model=eng.name, dims=eng.dims.to_dict()))
    assert eng.projection_runtime() == "CPU row-gather up + sparse down (kept rows only)"


def test_tracking_keep_counts_cats_mlps_by_the_weight_bytes_they_read():
    """Under CATS thresholds tracking_keep reports the MLP's weight-byte keep, (1 + 2k)/3 for a
    kept fraction k of SiLU(gate) channels (gate read whole): every channel at threshold 0, gate
    alone at a threshold no activation reaches; the decode it tracks is the untracked one."""
    ids = torch.randint(0, 100, (12,), generator=torch.Generator().manual_seed(3))
    eng = _engine()

    def cats(t):
        return Thresholds(values={f"layers.{i}.act": t for i in range(2)}, method="cats", keep=0.5,
                          model=eng.name, dims=eng.dims.to_dict())

    for t, want in ((0.0, 1.0), (1e9, 1 / 3)):
        eng.sparsify(cats(t))
        with eng.tracking_keep() as keep_of:
            _decode(eng, ids)
            assert keep_of() == pytest.approx(want)
    eng.sparsify(cats(0.01))
    untracked = _decode(eng, ids)
    with eng.tracking_keep() as keep_of:
        tracked = _decode(eng, ids)
        assert 1 / 3 < keep_of() < 1.0
    assert not any(layer.mlp.track for layer in eng.model.layers)
    torch.testing.assert_close(tracked, untracked, rtol=0, atol=0)
    with pytest.raises(InputError, match="no tracked CATS decode calls"):
        with eng.tracking_keep() as keep_of:
            keep_of()
