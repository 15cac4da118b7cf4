"""Token routing (SATS §3.2): the scores against brute-force decoding, the decode step routed
dense / sparse against the dense and the CATS engines (bitwise on CPU), tau calibration on
SmolLM2, the table file and its tokenizer check, and the `route` CLI."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

import sparsedecode
from sparsedecode.cli import main
from sparsedecode.config import ProjectionConfig, SparsityConfig
from sparsedecode.errors import InputError
from sparsedecode.kernels.cpu_gemv import cpu_kernel
from sparsedecode.projection.routing import (
    RoutingTable,
    build_routing_table,
    calibrate_routing,
    routing_curve,
)
from sparsedecode.projection.thresholds import Thresholds

CFG = dict(
    model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
    max_position_embeddings=256, rope_theta=10000.0, eos_token_id=None,
)


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread on the shared 2-core machine (see tests/quality/test_retrieval.py)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class Tok:
    """A stand-in tokenizer: only its vocabulary matters to a routing table."""

    def __init__(self, n: int, salt: str = ""):
        self.vocab = {f"t{i}{salt}": i for i in range(n)}

    def get_vocab(self) -> dict:
        return dict(self.vocab)

    def __len__(self) -> int:
        return len(self.vocab)


def _tiny(**kw):
    eng = sparsedecode.load(dict(CFG), init="random", device="cpu", max_len=96, **kw)
    with torch.no_grad():
        eng.model.lm_head.weight.mul_(30.0)  # peaked logits: the sparse path moves the losses
    eng.tokenizer = Tok(100)
    return eng


def _cats(eng, t: float = 0.02) -> Thresholds:
    return Thresholds(values={f"layers.{i}.act": t for i in range(2)}, method="cats", keep=0.5,
                      model=eng.name, dims=eng.dims.to_dict(), keep_metric="act_keep")


CPU_UP_ROWS = cpu_kernel().entry("sd_gather_rows", torch.float32) is not None
IDS = torch.randint(0, 80, (300,), generator=torch.Generator().manual_seed(0))  # ids 80-99 unseen


@pytest.fixture(scope="module")
def table():
    eng = _tiny()
    return build_routing_table(eng, _cats(eng), IDS, window=64)


def _decode(eng, ids, n_prompt: int = 4):
    eng.reset()
    first = eng.prefill(ids[:n_prompt]).clone()
    return torch.stack([first] + [eng.decode_step(int(t)).clone() for t in ids[n_prompt:]])


# -- (e) the scores ------------------------------------------------------------------
def test_scores_are_mean_excess_loss_of_brute_force_decoding(table):
    """s(x) = mean of max(0, l_sparse - l_dense) over x's occurrences, with both losses
    recomputed one decode step at a time (the CATS runtime for the sparse one)."""
    eng = _tiny()

    def step_losses(e):
        out = []
        for s in range(0, IDS.numel(), 64):  # the table's windows, each from position 0
            e.reset()
            for j in range(s, min(s + 64, IDS.numel() - 1)):
                logits = e.decode_step(int(IDS[j]))
                out.append(float(F.cross_entropy(logits[None], IDS[j + 1 : j + 2])))
        return out

    dense = step_losses(eng)
    eng.sparsify(_cats(eng))
    sparse = step_losses(eng)
    sums, counts = {}, {}
    for x, ld, ls in zip(IDS[:-1].tolist(), dense, sparse, strict=True):
        sums[x] = sums.get(x, 0.0) + max(0.0, ls - ld)
        counts[x] = counts.get(x, 0) + 1
    assert sum(v > 0 for v in sums.values()) > 20  # the sparse path does hurt somewhere
    for x in range(100):
        if x in counts:
            assert int(table.count[x]) == counts[x]
            assert float(table.scores[x]) == pytest.approx(sums[x] / counts[x], rel=1e-3, abs=2e-5), x
        else:
            assert int(table.count[x]) == 0 and math.isnan(float(table.scores[x]))
    assert table.stats["positions"] == IDS.numel() - 1 and table.text["window"] == 64


# -- (a) the decode step -------------------------------------------------------------
def test_steps_routed_dense_are_the_dense_model_and_routed_sparse_the_cats_model(table):
    dense_eng, cats_eng, eng = _tiny(), _tiny(), _tiny()
    cats_eng.sparsify(_cats(cats_eng))
    eng.sparsify(_cats(eng))
    ids = IDS[:40]
    dense, sparse = _decode(dense_eng, ids), _decode(cats_eng, ids)
    scale = dense.abs().max().item()
    assert (dense[1:] - sparse[1:]).abs().max().item() > 1e-3 * scale  # the prefill is dense in both

    all_dense = calibrate_routing(table, eng, IDS, 0.0)  # tau at the lowest score, unseen dense
    assert all_dense.routed == 0.0 and not all_dense.sparse_of().any()
    eng.route(all_dense)
    # Every decode step's MLP is the original one, bitwise; the prefill runs down from the CATS
    # engine's transposed weight (SparseLinear), whose fp32 sums may round differently by BLAS
    # and CPU (bitwise equal on some machines, ~1e-7 relative on others), and the cache carries that.
    routed = _decode(eng, ids)
    assert (routed - dense).abs().max().item() <= 1e-6 * scale
    assert eng.routed_fraction() == 0.0

    all_sparse = calibrate_routing(dataclasses.replace(table, unseen="sparse"), eng, IDS, 1.0)
    assert all_sparse.routed == 1.0 and all_sparse.sparse_of().all()
    eng.route(all_sparse)
    assert torch.equal(_decode(eng, ids), sparse)  # bitwise: every MLP is the CATS one
    assert eng.routed_fraction() == 1.0

    eng.route(None)  # off again: every step sparse, as without routing
    assert eng.router is None and torch.equal(_decode(eng, ids), sparse)


def test_mixed_routing_picks_each_steps_mlp_by_its_token(table):
    """At tau for 50%, each decode step's MLP outputs equal, bitwise, the dense MLP's or the
    unrouted CATS MLP's on the same input, as the table says for the step's token (the dense
    ones to float32 rounding where the CPU kernel holds up row-major: `kernels.cpu_gemv`)."""
    dense_eng, cats_eng, eng = _tiny(), _tiny(), _tiny()
    cats_eng.sparsify(_cats(cats_eng))
    eng.sparsify(_cats(eng))
    half = calibrate_routing(table, eng, IDS, 0.5)
    assert abs(half.routed - 0.5) < 0.05
    eng.route(half)
    seen = []
    hooks = [layer.mlp.register_forward_hook(
        lambda mod, args, out, i=i: seen.append((i, args[0].clone(), out.clone())))
        for i, layer in enumerate(eng.model.layers)]
    ids = IDS[100:140]
    try:
        eng.reset()
        eng.prefill(ids[:4])
        seen.clear()
        for t in ids[4:]:
            eng.decode_step(int(t))
    finally:
        for h in hooks:
            h.remove()
    flags = half.sparse_of()[ids[4:]]
    assert 0 < int(flags.sum()) < flags.numel()
    assert eng.routed_fraction() == pytest.approx(float(flags.float().mean()))
    differ = 0
    with torch.inference_mode():
        for k, (i, x, y) in enumerate(seen):
            want = (cats_eng if flags[k // 2] else dense_eng).model.layers[i].mlp(x)
            other = (dense_eng if flags[k // 2] else cats_eng).model.layers[i].mlp(x)
            if flags[k // 2] or not CPU_UP_ROWS:
                assert torch.equal(y, want), (k, i)
            else:  # the CPU kernel keeps up row-major: the dense MLP's ops on another layout
                torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6, msg=f"step {k // 2} layer {i}")
            differ += not torch.equal(y, other)
    assert len(seen) == 2 * flags.numel() and differ > 0.9 * len(seen)  # the paths differ


def test_routed_step_traces_whole_under_compile(table):
    """The decode step with its token lookup and counter compiles as one graph
    (fullgraph=True, as on CUDA before capture) and decodes as the eager step: the same
    routing, logits to float32 rounding (the eager CPU step attends over the valid entries
    with SDPA, the traced one reads the masked split-K)."""
    eng, ref = _tiny(), _tiny()
    half = calibrate_routing(table, eng, IDS, 0.5)
    for e in (eng, ref):
        e.sparsify(_cats(e))
        e.route(half)
    eng._step_fn = torch.compile(eng._decode_forward, fullgraph=True, backend="aot_eager")
    ids = IDS[:24]
    torch.testing.assert_close(_decode(eng, ids), _decode(ref, ids), atol=1e-5, rtol=1e-5)
    assert eng.routed_fraction() == ref.routed_fraction()
    assert 0.0 < eng.routed_fraction() < 1.0


_KERNEL_PATH = """
import torch, torch.nn as nn, torch.nn.functional as F
from sparsedecode.projection.cats_runtime import CatsMLP, Router
torch.manual_seed(0)
mlp = nn.Module()
mlp.gate_proj, mlp.up_proj = nn.Linear(64, 96, bias=False), nn.Linear(64, 96, bias=False)
mlp.down_proj = nn.Linear(96, 64, bias=False)
mlp.requires_grad_(False)
w = {k: getattr(mlp, k).weight.clone() for k in ("gate_proj", "up_proj", "down_proj")}
x = torch.randn(1, 1, 64)
dense = F.linear(F.silu(F.linear(x, w["gate_proj"])) * F.linear(x, w["up_proj"]), w["down_proj"])
cats = CatsMLP(mlp, 0.05, track=True)
with torch.inference_mode():
    sparse = cats(x)
    keep = cats.realized_keep()
    tok = torch.zeros(1, 1, dtype=torch.long)
    router = Router(torch.tensor([True, False]), tok)
    cats.set_router(router)
    cats.kept.zero_()
    router.step()
    routed_sparse = cats(x)
    tok.fill_(1)
    router.step()
    routed_dense = cats(x)
print(torch.equal(routed_sparse, sparse), float((routed_dense - dense).abs().max()),
      float((sparse - dense).abs().max()), keep, cats.realized_keep(), router.fraction(),
      cats.down_dense is None)
"""


def test_routed_kernel_path_under_the_triton_interpreter():
    """The CUDA path (the row-gather kernel, run by the Triton interpreter): a sparse-routed
    step is the unrouted CATS step, a dense-routed one keeps every channel (the dense MLP
    up to fp32 summation order) and counts a keep of 1."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    res = subprocess.run([sys.executable, "-c", _KERNEL_PATH], capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    same, err_dense, gap, keep, keep_routed, frac, no_copy = res.stdout.split()
    assert same == "True" and no_copy == "True"  # the kernel path keeps no dense copy of down
    assert float(err_dense) < 1e-5 < float(gap)
    assert 0.0 < float(keep) < 1.0
    assert float(keep_routed) == pytest.approx((float(keep) + 1.0) / 2)  # one sparse, one dense step
    assert float(frac) == 0.5


def test_route_needs_cats_thresholds_and_a_calibrated_table(table, tmp_path):
    eng = _tiny()
    half = calibrate_routing(table, eng, IDS, 0.5)
    with pytest.raises(InputError, match="install CATS thresholds"):
        eng.route(half)
    teal = Thresholds(values={f"layers.{i}.{s}": 0.01 for i in range(2) for s in ("gate", "up", "down")},
                      method="teal", keep=0.5, model=eng.name, dims=eng.dims.to_dict())
    eng.sparsify(teal)
    with pytest.raises(InputError, match="CATS-style"):
        eng.route(half)
    eng = _tiny()
    eng.sparsify(_cats(eng))
    with pytest.raises(InputError, match="route calibrate"):
        eng.route(table)  # no tau yet
    with pytest.raises(InputError, match="thresholds file too"):
        SparsityConfig.parse("route[r.json]")
    th = _cats(eng)  # the configuration names the files; the objects go beside it, as calibrated
    cats_file, half_file = str(th.save(tmp_path / "cats.safetensors")), str(half.save(tmp_path / "half.safetensors"))
    routed = SparsityConfig(ProjectionConfig(file=cats_file, routing=half_file))
    assert eng.configure(routed, thresholds=th, routing=half).mode == "proj+route"
    assert eng.router is not None and eng.routing is half
    assert eng.configure(SparsityConfig(ProjectionConfig(file=cats_file)), thresholds=_cats(eng)).mode == "proj"
    assert eng.router is None and all(layer.mlp.router is None for layer in eng.model.layers)


def test_a_table_of_a_fine_tuned_model_asks_for_its_adapter(tmp_path):
    """SATS Table 7 routes a fine-tuned model: a table scored with an adapter records it, and an
    engine without that adapter is refused (a base model's table still routes a tuned one)."""
    tuned = _tiny(adapter="random:r2:mlp")
    tab = build_routing_table(tuned, _cats(tuned), IDS, window=64)
    assert tab.adapter == {"path": "random:r2:mlp", "rank": 2, "alpha": 4.0, "targets": "mlp"}
    back = RoutingTable.load(calibrate_routing(tab, tuned, IDS, 0.5).save(tmp_path / "t.safetensors"))
    assert back.adapter == tab.adapter
    tuned.sparsify(_cats(tuned))
    tuned.route(back)
    base = _tiny()
    base.sparsify(_cats(base))
    with pytest.raises(InputError, match=r"scored on 'llama' with adapter random:r2:mlp, and this engine runs no "
                                         r"adapter.*load with .*random:r2:mlp"):
        base.route(back)
    other = _tiny(adapter="random:r2:all")
    other.sparsify(_cats(other))
    with pytest.raises(InputError, match="runs adapter random:r2:all"):
        other.route(back)
    plain = calibrate_routing(build_routing_table(base, _cats(base), IDS, window=64), base, IDS, 0.5)
    assert plain.adapter is None
    tuned.route(plain)


# -- (c) the file --------------------------------------------------------------------
def test_table_round_trips_and_is_refused_for_another_tokenizer(table, tmp_path):
    eng = _tiny()
    eng.sparsify(_cats(eng))
    half = calibrate_routing(table, eng, IDS, 0.5, text="ids[:300]")
    back = RoutingTable.load(half.save(tmp_path / "r.safetensors"))
    torch.testing.assert_close(back.scores, half.scores, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(back.count, half.count) and back.header() == half.header()
    assert back.header()["tokenizer"]["vocab"] == 100 and len(back.tokenizer["sha256"]) == 64
    assert torch.equal(back.sparse_of(), half.sparse_of())
    eng.route(tmp_path / "r.safetensors")  # a path works too

    eng.tokenizer = Tok(100, salt="x")  # same size, other tokens
    with pytest.raises(InputError, match=r"tokenizer of 100 tokens .* route build"):
        eng.route(back)
    with pytest.raises(InputError, match="tokenizer"):
        calibrate_routing(table, Tok(99), IDS, 0.5)
    eng.tokenizer = Tok(100)
    other = dataclasses.replace(back, tokenizer={**back.tokenizer, "sha256": "0" * 64})
    with pytest.raises(InputError, match="other tokens' scores"):
        eng.route(other)
    wide = dataclasses.replace(back, vocab=120, scores=torch.zeros(120), count=torch.ones(120, dtype=torch.long))
    with pytest.raises(InputError, match="120 entries .* vocabulary of 100"):
        eng.route(wide)
    (tmp_path / "bad.safetensors").write_bytes(b"not a table")
    with pytest.raises(InputError, match="not a safetensors routing table"):
        RoutingTable.load(tmp_path / "bad.safetensors")
    with pytest.raises(InputError, match="not a sparsedecode routing table"):
        RoutingTable.load(_cats(eng).save(tmp_path / "th.safetensors"))


def test_curve_is_the_routed_fraction_at_each_candidate(table):
    taus, fracs = routing_curve(table, IDS.flip(0))
    assert fracs == sorted(fracs) and fracs[0] == 0.0
    for tau, r in zip(taus[::7], fracs[::7], strict=True):
        assert table.routed_fraction(IDS.flip(0), tau) == pytest.approx(r)
    with pytest.raises(InputError, match=r"\[0, 1\]"):
        calibrate_routing(table, Tok(100), IDS, 1.5)


# -- (b) SmolLM2 ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol():
    """SmolLM2-135M, its CATS thresholds at keep 0.5, a table on 1,024 WikiText-2 validation
    tokens and the next 16K tokens as held-out text (about 54% of whose occurrences are of
    ids the table saw: the unseen rest routes dense)."""
    from sparsedecode.corpus import wikitext_ids
    from sparsedecode.projection.calibrate import get_calibrator

    torch.set_num_threads(1)
    eng = sparsedecode.load("smollm2-135m", device="cpu", dtype="float32", max_len=1024, quiet=True)
    ids = wikitext_ids(eng.tokenizer, "valid")
    th = get_calibrator("cats", keep=0.5, refine=0).calibrate(eng, ids[:256], text="valid[:256]")
    tab = build_routing_table(eng, th, ids[:1024], window=512)
    return eng, th, tab, ids[1024 : 1024 + 16384]


def test_tau_on_held_out_text_routes_the_target_fraction(smol):
    eng, _, tab, held = smol
    assert tab.tokenizer["vocab"] == len(eng.tokenizer) == eng.dims.vocab
    assert tab.stats["loss_sparse"] > tab.stats["loss_dense"]  # CATS at 0.5 costs quality
    for target in (0.5, 0.25):
        cal = calibrate_routing(tab, eng, held, target)
        assert abs(cal.routed - target) <= 0.03, (target, cal.routed)
        assert cal.routed_fraction(held) == pytest.approx(cal.routed)
        assert cal.held_out["tokens"] == len(held)


# -- the CLI ---------------------------------------------------------------------------
def _cli(capsys, *args):
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_route_cli_builds_calibrates_and_generates(smol, tmp_path, capsys, monkeypatch):
    """build -> calibrate -> generate --routing, in process, with the module's SmolLM2 (the
    commands' model loads are replaced by it)."""
    from sparsedecode.cli import route as route_cli

    eng, th, _, _ = smol

    def load(ref, thresholds=None, **kw):
        if thresholds is not None:
            eng.sparsify(thresholds)
        return eng

    monkeypatch.setattr(sparsedecode, "load", load)
    monkeypatch.setattr(route_cli, "_tokenizer", lambda model, quiet: eng.tokenizer)
    th_path = th.save(tmp_path / "cats.safetensors")
    table = tmp_path / "route.safetensors"
    code, out, err = _cli(capsys, "route", "build", "--thresholds", str(th_path), "--out", str(table),
                          "--tokens", "256", "--window", "512", "--json")
    assert code == 0, err
    built = json.loads(out)
    assert built["text"]["tokens"] == 256 and built["thresholds"]["file"] == str(th_path)
    assert built["tau"] is None
    code, out, err = _cli(capsys, "route", "calibrate", "--table", str(table), "--target", "0.5",
                          "--held-out-tokens", "4K", "--json")
    assert code == 0, err
    cal = json.loads(out)
    assert cal["held_out"]["source"].startswith("wiki.valid.raw[256:")
    assert RoutingTable.load(table).tau == cal["tau"]  # written into the table
    code, out, err = _cli(capsys, "generate", "-p", "The capital of France is", "-n", "6",
                          "--thresholds", str(th_path), "--routing", str(table), "--json")
    assert code == 0, err
    gen = json.loads(out)
    assert gen["routing"]["tau"] == cal["tau"] and len(gen["ids"]) == 6
    assert 0.0 <= gen["routing"]["decode_steps_sparse"] <= 1.0

    for args, msg in [
        (("route", "calibrate", "--table", str(tmp_path / "none.st")), "no routing table at"),
        (("route", "calibrate", "--table", str(table), "--target", "2"), "outside [0, 1]"),
        (("route", "build", "--thresholds", str(tmp_path / "none.st"), "--out", str(table)),
         "no thresholds file"),
        (("generate", "-p", "x", "--routing", str(table)), "give --thresholds FILE"),
    ]:
        code, out, err = _cli(capsys, *args)
        assert code == 2 and err.startswith("error: ") and msg in err and err.count("\n") == 1, err
