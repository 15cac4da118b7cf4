"""Perplexity protocols with paired bootstrap intervals (ByteCross App. A, App. H; issue 7):
dense chunked PPL of smollm2-135m against transformers, the decode protocol against a full
forward and under keep-1.0 and sparse configurations, the bootstrap's known answers, the CLI
and its errors."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

import sparsedecode
from sparsedecode.cli import main
from sparsedecode.config import KVConfig, ProjectionConfig, SparsityConfig
from sparsedecode.errors import InputError
from sparsedecode.projection.thresholds import Thresholds
from sparsedecode.quality.bootstrap import aggregate_ppl, paired_bootstrap, ppl_interval
from sparsedecode.quality.perplexity import (
    CHUNK,
    DENSE,
    _prefill_chunk,
    chunked_nll,
    decode_nll,
    decode_starts,
    evaluate,
    pooled_ppl,
)

SITES = "q k v o gate up down".split()
# max_len 704 holds the windows below (up to 640 tokens) and refuses 800
TINY = dict(model_type="llama", hidden_size=96, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, vocab_size=100, max_position_embeddings=1024,
            rope_theta=10000.0, eos_token_id=None)
WIDE = dict(TINY, max_position_embeddings=4096)  # holds the chunked protocol's 2,048 tokens


def _thresholds(eng, t: float, keep: float = 0.5) -> Thresholds:
    values = {f"layers.{i}.{s}": t for i in range(2) for s in SITES}
    return Thresholds(values=values, method="teal", keep=keep, model=eng.name, dims=eng.dims.to_dict())


def _peaked(eng):
    """q/k/v/o scaled up so attention is peaked and the attended entries change the logits
    (as tests/kv/test_engine_kv.py does: at init std 0.02 attention is near uniform)."""
    with torch.no_grad():
        for layer in eng.model.layers:
            for name, scale in (("q_proj", 12.0), ("k_proj", 12.0), ("v_proj", 20.0), ("o_proj", 20.0)):
                getattr(layer.self_attn, name).weight.mul_(scale)
    return eng


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: on two cores that another job keeps busy, every op of a
    two-thread forward waits for the descheduled thread (a smollm2 decode step took 730 ms
    against 67 ms on one thread, a tiny model's 47 ms against 1.5 ms)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny():
    eng = _peaked(sparsedecode.load(dict(TINY), init="random", device="cpu", dtype="float32", max_len=704))
    ids = torch.randint(0, 100, (3000,), generator=torch.Generator().manual_seed(0))
    return eng, ids


@pytest.fixture(scope="module")
def wide():
    eng = sparsedecode.load(dict(WIDE), init="random", device="cpu", dtype="float32", max_len=CHUNK)
    ids = torch.randint(0, 100, (2 * CHUNK + 1,), generator=torch.Generator().manual_seed(1))
    return eng, ids


# -- decode-position protocol ----------------------------------------------------
def test_decode_starts_are_evenly_spaced_and_deterministic():
    assert decode_starts(1000, 5, 199) == [0, 200, 400, 600, 800]  # span 1000 - 199 - 1 = 800
    assert decode_starts(1000, 1, 199) == [0]
    assert decode_starts(1000, 3, 998) == [0, 0, 1]
    with pytest.raises(InputError, match="need 1,000 tokens of text"):
        decode_starts(999, 2, 999)


def test_decode_dense_scores_the_targets_of_a_full_forward(tiny):
    eng, ids = tiny
    L, scored = 160, 32
    got = decode_nll(eng, ids, windows=3, length=L, scored=scored)
    assert got.starts == [0, (ids.numel() - L - 1) // 2, ids.numel() - L - 1]
    assert got.targets == [scored] * 3
    for s, nll in zip(got.starts, got.nll, strict=True):
        logits = eng.forward_logits(ids[s : s + L])  # (L, V)
        want = F.cross_entropy(logits[L - scored :].double(), ids[s + L - scored + 1 : s + L + 1],
                               reduction="sum").item()
        assert nll == pytest.approx(want, rel=1e-5), f"window at {s}"
    assert got.ppl == pytest.approx(math.exp(sum(got.nll) / (3 * scored)), rel=1e-12)


class _Bar:
    """Records what a progress bar is told: its total and every update."""

    def __init__(self, total, enabled, desc):
        self.total, self.enabled, self.desc, self.updates = total, enabled, desc, []
        BARS.append(self)

    def update(self, n):
        self.updates.append(n)

    def set_postfix_str(self, *a, **k):
        pass

    def close(self):
        pass


BARS: list[_Bar] = []


def test_the_progress_bar_counts_tokens_so_it_moves_within_a_window(tiny, wide, monkeypatch):
    """`eval ppl`'s bar (issue 48): counted in tokens, so a long window moves it step by step and
    its ETA holds from the first window; it ends at its total."""
    from sparsedecode.quality import perplexity

    monkeypatch.setattr(perplexity, "_token_bar", _Bar)
    BARS.clear()
    decode_nll(tiny[0], tiny[1], windows=2, length=160, scored=32, progress=True)
    chunked_nll(wide[0], wide[1], chunks=1, progress=True)
    dec, chk = BARS
    assert dec.enabled and dec.total == 2 * 160 == sum(dec.updates)
    assert dec.updates[:33] == [128] + [1] * 32  # the prefill, then each decode step
    assert chk.total == CHUNK == sum(chk.updates) and chk.updates[0] == DENSE and len(chk.updates) > 2


def _proj(eng, t: float):
    """(configuration, thresholds) of the projection branch at threshold t (keep 0.5 by name)."""
    th = _thresholds(eng, t)
    return SparsityConfig(ProjectionConfig(keep=th.keep)), th


def test_keep_one_is_dense_exactly(tiny):
    """The paper's protocol (512 scored tokens): projection keep 1.0 and KV keep 1.0, either
    KV method, give the dense NLLs bit for bit."""
    eng, ids = tiny
    dense = decode_nll(eng, ids, windows=2, length=640)
    assert dense.targets == [512, 512]
    for method in ("snapkv", "window"):
        cfg = SparsityConfig(ProjectionConfig(keep=1.0), KVConfig(method, 1.0))
        got = decode_nll(eng, ids, windows=2, length=640, config=cfg, thresholds=_thresholds(eng, 0.0, keep=1.0))
        assert got.nll == dense.nll, method


def test_resolve_projection_calibrates_nothing_at_keep_one_and_checks_the_keep(tiny, monkeypatch):
    """A keep of 1 turns the branch off without calibrating TEAL for it (the tiny engine has no
    tokenizer, and cached_teal is made to fail); thresholds given for another keep are refused."""
    import sparsedecode.projection.calibrate as calibrate
    from sparsedecode.quality.perplexity import resolve_projection

    eng, _ = tiny

    def refuse(*a, **kw):
        raise AssertionError("calibrated at keep 1")

    monkeypatch.setattr(calibrate, "cached_teal", refuse)
    assert resolve_projection(eng, ProjectionConfig(keep=1.0)) is None
    assert resolve_projection(eng, None) is None
    th = _thresholds(eng, 0.05)
    assert resolve_projection(eng, ProjectionConfig(keep=0.5), th) is th
    with pytest.raises(InputError, match="calibrated at keep 0.5, not at the configuration's projection keep 0.3"):
        resolve_projection(eng, ProjectionConfig(keep=0.3), th)
    with pytest.raises(InputError, match="projection branch"):
        resolve_projection(eng, None, th)


def test_sparse_configurations_change_decode_ppl(tiny):
    eng, ids = tiny
    run = lambda cfg=None, th=None: decode_nll(eng, ids, windows=2, length=160, config=cfg, thresholds=th,  # noqa: E731
                                               scored=32).nll
    dense = run()
    sel = run(SparsityConfig(kv=KVConfig("snapkv", 0.5, {"window": 16})))
    win = run(SparsityConfig(kv=KVConfig("window", 0.5, {"window": 16})))
    proj = run(*_proj(eng, 0.05))
    for name, nll in (("snapkv", sel), ("window", win), ("projection", proj)):
        assert all(abs(a - b) > 1e-6 * abs(b) for a, b in zip(nll, dense, strict=True)), name
    assert sel != pytest.approx(win, rel=1e-6)
    # the projection branch on, nothing dropped: the sparse (masked) decode path agrees with dense
    assert run(*_proj(eng, 0.0)) == pytest.approx(dense, rel=1e-6)
    assert run() == dense  # and the engine returns to dense


def test_prefill_never_ends_in_a_one_token_chunk():
    for n in (1, 511, 512, 513, 1025, 5121, 512 * 511 + 1):
        c = _prefill_chunk(n)
        assert n <= c or n % c != 1, n
    assert _prefill_chunk(1024) == 512


def test_decode_length_errors(tiny):
    eng, ids = tiny
    with pytest.raises(InputError, match=r"exceed the model window of 1,024 tokens; use length=1024"):
        decode_nll(eng, ids, length=2000, scored=32)
    with pytest.raises(InputError, match=r"need a cache of 800 tokens, the engine holds 704"):
        decode_nll(eng, ids, length=800, scored=32)
    with pytest.raises(InputError, match="must exceed the scored tokens"):
        decode_nll(eng, ids, length=512)
    with pytest.raises(InputError, match="need 161 tokens of text"):
        decode_nll(eng, ids[:100], length=160, scored=32)


# -- chunked protocol under a configuration --------------------------------------
def test_chunked_takes_a_projection_configuration(wide):
    eng, ids = wide
    table = _thresholds(eng, 0.05).values
    dense = evaluate(eng, ids, "chunked", chunks=2)
    assert dense.targets == [CHUNK - DENSE] * 2 and dense.starts == [0, CHUNK]
    assert dense.ppl == pytest.approx(pooled_ppl(dense.nll), rel=1e-12)
    cfg, th = _proj(eng, 0.05)
    sparse = evaluate(eng, ids, "chunked", cfg, thresholds=th, chunks=2)
    assert sparse.nll == chunked_nll(eng, ids, chunks=2, table=table)
    assert sparse.nll != pytest.approx(dense.nll, rel=1e-6)
    off = evaluate(eng, ids, "chunked", SparsityConfig(ProjectionConfig(keep=1.0)),
                   thresholds=_thresholds(eng, 0.05, keep=1.0), chunks=2)
    assert off.nll == dense.nll  # keep 1 turns the branch off


def test_chunked_refuses_kv_and_bad_input(wide):
    eng, ids = wide
    kv = SparsityConfig(kv=KVConfig("snapkv", 0.3))
    with pytest.raises(InputError, match="score KV selections with the decode protocol"):
        evaluate(eng, ids, "chunked", kv, chunks=2)
    with pytest.raises(InputError, match="decode protocol"):
        chunked_nll(eng, ids, chunks=2, config=kv)
    with pytest.raises(InputError, match="not both"):
        chunked_nll(eng, ids, chunks=2, table={}, config=SparsityConfig())
    with pytest.raises(InputError, match="needs 6,145 tokens, the text has 4,097"):
        evaluate(eng, ids, "chunked", chunks=3)
    with pytest.raises(InputError, match="unknown perplexity protocol 'sliding': use chunked or decode"):
        evaluate(eng, ids, "sliding")


# -- bootstrap --------------------------------------------------------------------
NLL_D = [310.0, 295.5, 402.25, 350.0, 280.0, 333.3, 390.1, 300.0]
NLL_C = [312.0, 299.0, 401.0, 356.5, 283.0, 338.0, 392.2, 301.0]


def test_bootstrap_is_reproducible_and_seeded():
    a = paired_bootstrap(NLL_D, NLL_C, 100, resamples=2000, seed=3)
    assert a == paired_bootstrap(NLL_D, NLL_C, [100] * 8, resamples=2000, seed=3)
    b = paired_bootstrap(NLL_D, NLL_C, 100, resamples=2000, seed=4)
    assert (b.delta.low, b.delta.high) != (a.delta.low, a.delta.high)
    assert a.delta.point == b.delta.point == pytest.approx(aggregate_ppl(NLL_C, 100) - aggregate_ppl(NLL_D, 100))
    for iv in (a.dense, a.config, a.delta):
        assert iv.low < iv.point < iv.high
    assert a.delta.low > 0  # seven of eight windows got worse: the interval excludes 0
    # one configuration's interval uses the same draws as the paired one
    assert ppl_interval(NLL_D, 100, resamples=2000, seed=3) == a.dense


def test_bootstrap_known_answers():
    same = paired_bootstrap(NLL_D, NLL_D, 100)
    assert same.delta.point == same.delta.low == same.delta.high == 0.0
    assert same.dense == same.config and same.resamples == 20000 and same.windows == 8
    # constant loss per target in every window: every resample has the same PPL
    flat = ppl_interval([2.0 * t for t in (10, 20, 30)], [10, 20, 30], resamples=500)
    assert flat.low == pytest.approx(math.exp(2.0)) and flat.high == pytest.approx(math.exp(2.0))
    # two windows: each of (w0, w0), mixed, (w1, w1) has probability >= 1/4, so the 95%
    # interval spans exactly the smallest and largest paired difference
    dense, conf = [100.0, 200.0], [110.0, 250.0]
    r = paired_bootstrap(dense, conf, 100, resamples=4000, seed=1)
    deltas = [math.exp(1.1) - math.exp(1.0), math.exp(1.8) - math.exp(1.5), math.exp(2.5) - math.exp(2.0)]
    assert r.delta.low == pytest.approx(min(deltas), rel=1e-12)
    assert r.delta.high == pytest.approx(max(deltas), rel=1e-12)  # unpaired draws would reach e^2.5 - e^1


def test_bootstrap_bad_input():
    with pytest.raises(InputError, match="8 dense windows but 2 configuration windows"):
        paired_bootstrap(NLL_D, NLL_C[:2], 100)
    with pytest.raises(InputError, match="resamples must be an integer >= 1"):
        paired_bootstrap(NLL_D, NLL_C, 100, resamples=0)
    with pytest.raises(InputError, match=r"level must lie in \(0, 1\)"):
        ppl_interval(NLL_D, 100, level=1.5)
    with pytest.raises(InputError, match="at least one scored target"):
        ppl_interval(NLL_D, [100] * 7 + [0])
    with pytest.raises(InputError, match="no windows"):
        ppl_interval([], 100)


# -- CLI --------------------------------------------------------------------------
def _cli(capsys, *args) -> tuple[int, str, str]:
    try:
        main(["eval", "ppl", *args])
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def no_load(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("bad input must fail before a model loads")

    monkeypatch.setattr(sparsedecode, "load", refuse)


def test_cli_refuses_bad_input_before_loading(capsys, no_load, tmp_path):
    code, _, err = _cli(capsys, "--protocol", "sliding")
    assert code == 2 and "unknown perplexity protocol 'sliding'" in err
    code, _, err = _cli(capsys, "--protocol", "chunked", "--kv", "snapkv", "--kv-keep", "0.3")
    assert code == 2 and "with the decode protocol (--protocol decode)" in err
    code, _, err = _cli(capsys, "--kv", "snapkv")
    assert code == 2 and "needs both --kv METHOD and --kv-keep K" in err
    code, _, err = _cli(capsys, "--protocol", "decode", "--kv", "snapkv", "--kv-keep", "0.3", "--kv-param", "sinks=x")
    assert code == 2 and "sinks must be an integer" in err
    code, _, err = _cli(capsys, "--protocol", "decode", "--length", "256", "--scored", "512")
    assert code == 2 and "--length 256 must exceed --scored 512" in err
    (tmp_path / "r.json").write_text("{}")
    code, _, err = _cli(capsys, "--out", str(tmp_path / "r.json"))
    assert code == 2 and "never overwritten" in err


def test_cli_length_beyond_the_model_window(capsys, monkeypatch, tmp_path):
    real = sparsedecode.load
    monkeypatch.setattr(sparsedecode, "load", lambda ref, **kw: real(
        dict(TINY), init="random", device="cpu", max_len=kw["max_len"]))
    text = tmp_path / "t.txt"
    text.write_text("some text\n")
    code, _, err = _cli(capsys, "--protocol", "decode", "--length", "2000", "--text-file", str(text))
    assert code == 2, err
    assert "needs a cache of 2,000 tokens" in err and "model window of 1024" in err
    assert err.rstrip().endswith("use a shorter --length")


@pytest.mark.slow
def test_cli_decode_record_rebuilds_its_intervals(capsys, monkeypatch, tmp_path, embedded_engine, wikitext_test):
    eng = embedded_engine("smollm2-135m")  # cache of 1,024 tokens: windows of 96 fit
    monkeypatch.setattr(sparsedecode, "load", lambda ref, **kw: eng)
    out = tmp_path / "sel.json"
    short = ("--protocol", "decode", "--windows", "2", "--length", "96", "--scored", "8", "--obs", "16",
             "--resamples", "500")
    code, stdout, err = _cli(capsys, *short, "--kv", "window", "--kv-keep", "0.5", "--out", str(out), "--json")
    assert code == 0, err
    rec = json.loads(out.read_text())
    assert rec["kind"] == "ppl_eval" and json.loads(stdout)["bootstrap"] == rec["bootstrap"]
    assert rec["config"]["mode"] == "window" and "env" in rec and "timestamp" in rec
    d, c = rec["dense"], rec["configured"]
    assert len(d["nll"]) == len(c["nll"]) == 2 and d["targets"] == [8, 8] and d["starts"] == c["starts"]
    assert d["nll"] != c["nll"]
    again = paired_bootstrap(d["nll"], c["nll"], d["targets"], resamples=500, seed=0)
    assert again.to_dict() == rec["bootstrap"]
    assert rec["bootstrap"]["delta"]["point"] == pytest.approx(c["ppl"] - d["ppl"], rel=1e-12)
    # keep 1 is dense: one run, ΔPPL 0 with a degenerate interval, printed
    code, stdout, err = _cli(capsys, *short, "--kv", "snapkv", "--kv-keep", "1")
    assert code == 0, err
    lines = {line.split("  ")[0]: line.split() for line in stdout.splitlines()}
    assert lines["ΔPPL"][1:] == ["+0.0000", "95%", "[+0.0000,", "+0.0000]"]
    assert lines["dense PPL"][2] == f"{d['ppl']:.4f}"


# -- acceptance: dense chunked PPL against transformers ----------------------------
@pytest.mark.slow
def test_dense_chunked_ppl_of_smollm2_matches_transformers(wikitext_test):
    """Chunks of the protocol: ours through the engine (dense prefill of 1,024 positions,
    then the scored 1,024 as a second prefill), transformers with one forward per chunk
    of its own model built from the same GGUF, scoring the same targets. The acceptance
    run takes 16 chunks (SPARSEDECODE_PPL_CHUNKS=16, about 5-8 min on 2 cores). It runs
    only when that variable is set: CI's 20-minute budget cannot hold it, and
    tests/models/test_decoder_vs_hf.py already checks our logits against transformers."""
    if "SPARSEDECODE_PPL_CHUNKS" not in os.environ:
        pytest.skip("set SPARSEDECODE_PPL_CHUNKS=16 to run the 16-chunk agreement with transformers")
    from transformers import AutoModelForCausalLM

    from sparsedecode.corpus import wikitext_ids

    chunks = int(os.environ.get("SPARSEDECODE_PPL_CHUNKS", "1"))
    eng = sparsedecode.load("smollm2-135m", device="cpu", dtype="float32", max_len=CHUNK, quiet=True)
    ids = torch.tensor(wikitext_ids(eng.tokenizer, "test"))
    ours = pooled_ppl(chunked_nll(eng, ids, chunks=chunks))
    src = eng.source_path
    del eng
    hf = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32).eval()
    total = 0.0
    with torch.inference_mode():
        for k in range(chunks):
            c = ids[k * CHUNK : (k + 1) * CHUNK + 1]  # (2049,)
            logits = hf(c[None, :CHUNK], use_cache=False, logits_to_keep=CHUNK - DENSE).logits[0]  # (1024, V)
            total += F.cross_entropy(logits.double(), c[DENSE + 1 :], reduction="sum").item()
    ref = math.exp(total / (chunks * (CHUNK - DENSE)))
    assert abs(ours / ref - 1) < 0.005, f"ours {ours:.4f} vs transformers {ref:.4f}"
    assert 5 < ref < 100  # a real model on real text, not a degenerate run
