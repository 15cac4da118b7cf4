"""u_B, the union of kept channels a batched sparse projection reads (projection/union.py, `bench
union`; issue 44 item 4, ByteCross App. F): the windows, the union table against hand counts, the
recorded masks against the sparse engine's own count of kept channels, and the command."""

from __future__ import annotations

import json

import pytest
import torch

import sparsedecode
from sparsedecode.errors import InputError
from sparsedecode.kernels.options import KernelOptions
from sparsedecode.projection.sparse_linear import site_key
from sparsedecode.projection.thresholds import Thresholds
from sparsedecode.projection.union import record_masks, union_table, window_starts

CFG = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=100, max_position_embeddings=256, rope_theta=10000.0, eos_token_id=None)
LINEAR = KernelOptions.parse("gemv.dense=false")


def test_windows_are_spread_evenly_and_never_overlap():
    starts = window_starts(1000, 4, 100)
    assert starts == [0, 300, 600, 900] and all(b - a >= 100 for a, b in zip(starts, starts[1:], strict=False))
    assert window_starts(50, 1, 50) == [0]
    with pytest.raises(InputError, match="need 500 tokens; the text has 499"):
        window_starts(499, 5, 100)


def test_union_table_against_hand_counts():
    """Two sites, four sequences, two steps: B = 1 is the mean keep, B = 2 and 4 the unions of
    consecutive sequences, weighted by the sites' weight sizes."""
    a = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0]],  # sequence 0, steps 0 and 1
                      [[0, 1, 0, 0], [1, 1, 0, 0]],
                      [[0, 0, 1, 0], [0, 0, 1, 1]],
                      [[0, 0, 0, 1], [0, 0, 1, 1]]], dtype=torch.bool)  # (S, steps, K)
    b = torch.ones(4, 2, 2, dtype=torch.bool)  # a site every sequence keeps whole
    masks = {"layers.0.q": a, "layers.0.down": b}
    rows = {r["batch"]: r for r in union_table(masks, {"layers.0.q": 3, "layers.0.down": 1}, [1, 2, 4])}
    # site q: B=1 keeps (1/4 + 2/4)/2 = 3/8 on average; B=2 unions {0,1}: (2/4 + 2/4)/2, {2,3}: same -> 1/2;
    # B=4: (4/4 + 4/4)/2 = 1
    assert rows[1]["union"] == pytest.approx((3 * 3 / 8 + 1) / 4)
    assert rows[2]["union"] == pytest.approx((3 * 1 / 2 + 1) / 4) and rows[2]["groups"] == 2
    assert rows[4]["union"] == pytest.approx(1.0) and rows[4]["groups"] == 1
    assert rows[2]["by_input"] == {"qkv": pytest.approx(0.5), "ffn_hidden": pytest.approx(1.0)}
    assert rows[1]["group_min"] <= rows[1]["union"] <= rows[1]["group_max"]
    with pytest.raises(InputError, match="a batch of 5 needs 1 to 4"):
        union_table(masks, {"layers.0.q": 3, "layers.0.down": 1}, [5])


def _thresholds(eng, t: float) -> dict[str, float]:
    return {site_key(i, s): t for i, s, _ in eng.model.projection_sites()}


def test_masks_are_what_the_sparse_step_keeps_and_threshold_zero_decodes_as_dense():
    """The masked decode's masks count the channels the sparse engine keeps on the same tokens (its
    own tracked count), and at threshold 0 the masked decode is the dense one (every mask full
    but exact zeros)."""
    torch.manual_seed(0)
    eng = sparsedecode.load(dict(CFG), init="random", device="cpu", max_len=64, kernels=LINEAR)
    ids = torch.randint(0, 100, (3, 20), generator=torch.Generator().manual_seed(1)).tolist()
    masks = record_masks(eng, _thresholds(eng, 0.0), ids, steps=3)
    widths = {site_key(i, s): getattr(p, s).in_features for i, s, p in eng.model.projection_sites()}
    assert {k: tuple(m.shape) for k, m in masks.items()} == {k: (3, 3, w) for k, w in widths.items()}
    assert all(m.float().mean() > 0.99 for m in masks.values())

    t = 0.4
    masks = record_masks(eng, _thresholds(eng, t), ids[:1], steps=4)
    # the same decode through the sparse engine: its tokens from the masked one's greedy choices
    sparse = sparsedecode.load(dict(CFG), init="random", device="cpu", max_len=64, kernels=LINEAR)
    sparse.model.load_state_dict(eng.model.state_dict())
    th = Thresholds(values=_thresholds(eng, t), method="teal", keep=0.5, model=eng.name, dims=eng.dims.to_dict())
    sparse.sparsify(th)
    with sparse.tracking_keep():
        sparse.reset()
        tok = int(sparse.prefill(torch.tensor(ids[0])).argmax())
        for s in range(4):
            sparse.seek(20 + s, tok)
            tok = int(sparse.eager_step().reshape(-1).argmax())
        from sparsedecode.projection.sparse_linear import sparse_modules

        counted = {m.site: m.kept_counts()[0] for m in sparse_modules(sparse.model)}
    assert counted == {k: float(m.sum()) for k, m in masks.items()}


def test_record_masks_refuses_what_it_cannot_measure():
    eng = sparsedecode.load(dict(CFG), init="random", device="cpu", max_len=64, kernels=LINEAR)
    th = _thresholds(eng, 0.1)
    with pytest.raises(InputError, match="no threshold for layers.0.down"):
        record_masks(eng, {k: v for k, v in th.items() if k != "layers.0.down"}, [[1, 2, 3]], steps=1)
    eng.sparsify(Thresholds(values=th, method="teal", keep=0.5, model=eng.name, dims=eng.dims.to_dict()))
    with pytest.raises(InputError, match="dense nn.Linear projections"):
        record_masks(eng, th, [[1, 2, 3]], steps=1)


def test_bench_union_bad_input_is_refused_before_loading(capsys):
    from conftest import run_cli

    for args, msg in (([], "give one of --proj-keep"),
                      (["--proj-keep", "0.5", "--thresholds", "x.safetensors"], "give one of --proj-keep"),
                      (["--proj-keep", "0.5", "--batches", "1,two"], "write batch sizes as integers"),
                      (["--proj-keep", "0.5", "--sequences", "4", "--batches", "1,8"], "each batch size must be 1 to")):
        r = run_cli(capsys, "bench", "union", "--model", "no-such-model", *args)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


def test_bench_union_on_the_embedded_model(capsys, tmp_path, embedded_engine):
    """Two short windows of smollm2-135m with a uniform thresholds file: a record whose B = 1 union
    is the masks' keep and whose B = 2 union is at least it."""
    from conftest import run_cli

    eng = embedded_engine("smollm2-135m")
    th = Thresholds(values=_thresholds(eng, 0.05), method="teal", keep=0.5, model=eng.name, dims=eng.dims.to_dict())
    path = th.save(tmp_path / "th.safetensors")
    out = tmp_path / "u.json"
    r = run_cli(capsys, "bench", "union", "--model", "smollm2-135m", "--thresholds", str(path), "--sequences", "2",
                "--context", "48", "--steps", "2", "--batches", "1,2", "--device", "cpu", "--dtype", "float32",
                "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    rec = json.loads(out.read_text())
    assert rec == json.loads(r.stdout) and rec["kind"] == "union_bench" and rec["window_starts"][0] == 0
    u1, u2 = (row["union"] for row in rec["results"])
    assert 0.0 < u1 <= u2 <= 1.0 and set(rec["results"][0]["by_input"]) == {"qkv", "o", "ffn_in", "ffn_hidden"}
    r = run_cli(capsys, "bench", "union", "--model", "smollm2-135m", "--thresholds", str(path), "--sequences", "2",
                "--context", "48", "--steps", "2", "--batches", "1", "--out", str(out))
    assert r.returncode == 2 and "never overwritten" in r.stderr
