"""Chunked perplexity of a routed configuration (SATS paper §3.2): each scored position
applies the CATS thresholds only where its token id routes sparse. All-sparse routing
equals the CATS table, all-dense equals dense, and a mixed table equals a brute force
through the engine's routed decode step, one teacher-forced token at a time."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import sparsedecode
from sparsedecode.config import ProjectionConfig, SparsityConfig
from sparsedecode.corpus import text_ids, wikitext_path
from sparsedecode.projection.routing import RoutingTable, tokenizer_fingerprint
from sparsedecode.projection.thresholds import Thresholds
from sparsedecode.quality.perplexity import CHUNK, DENSE, chunked_nll, chunked_nll_many

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=4096,
            rope_theta=10000.0, eos_token_id=None)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from sparsedecode.models.load import load_tokenizer, resolve

    tok = load_tokenizer(resolve("smollm2-135m", quiet=True))
    eng = sparsedecode.load(dict(TINY), init="random", device="cpu", dtype="float32", max_len=CHUNK + 8,
                            compile=False)
    eng.tokenizer = tok  # only its fingerprint matters: tables are checked against it
    path = tmp_path_factory.mktemp("text") / "wiki.txt"
    path.write_text(wikitext_path("test").read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    ids = [t % 1000 for t in text_ids(tok, path)[: CHUNK + 1]]  # a small vocabulary: a fast LM head
    assert len(ids) == CHUNK + 1
    return eng, ids


def _cats(eng) -> Thresholds:
    return Thresholds(values={f"layers.{i}.act": 0.02 for i in range(2)}, method="cats", keep=0.5,
                      model=eng.name, dims=eng.dims.to_dict(), keep_metric="act_keep")


def _table(eng, tau: float) -> RoutingTable:
    V = eng.dims.vocab
    scores = torch.rand(V, generator=torch.Generator().manual_seed(0))
    return RoutingTable(scores=scores, count=torch.ones(V, dtype=torch.long), model=eng.name, vocab=V,
                        tokenizer=tokenizer_fingerprint(eng.tokenizer), thresholds={}, text={}, tau=tau)


def _named(tmp_path, th, table=None, name: str = "route") -> SparsityConfig:
    """The configuration naming CATS thresholds (and a routing table) by the files they are
    saved to, as a record names them; the objects go beside it, as Engine.configure takes them."""
    file = str(th.save(tmp_path / "cats.safetensors"))
    routing = None if table is None else str(table.save(tmp_path / f"{name}.safetensors"))
    return SparsityConfig(ProjectionConfig(file=file, routing=routing))


def test_routing_all_sparse_is_cats_all_dense_is_dense(setup, tmp_path):
    eng, ids = setup
    cats = _cats(eng).values
    dense, sparse, all_sparse, all_dense = chunked_nll_many(eng, ids, 1, [
        (None, None), (cats, None), (cats, _table(eng, math.inf).sparse_of()),
        (cats, _table(eng, -math.inf).sparse_of())])
    assert all_sparse == sparse and all_dense == dense and sparse != dense
    th = _cats(eng)
    assert chunked_nll(eng, ids, 1, config=_named(tmp_path, th), thresholds=th) == sparse


def test_mixed_routing_matches_the_routed_decode_step(setup, tmp_path):
    eng, ids = setup
    table = _table(eng, 0.5)
    th = _cats(eng)
    routed = _named(tmp_path, th, table)
    assert routed.mode == "proj+route"
    got = chunked_nll(eng, ids, 1, config=routed, thresholds=th, routing=table)[0]
    assert chunked_nll(eng, ids, 1, config=routed) == [got]  # the same from the files it names
    c = torch.as_tensor(ids)
    on = table.sparse_of()[c[DENSE:CHUNK]]
    assert 0.3 < float(on.float().mean()) < 0.7  # both paths taken
    eng.sparsify(_cats(eng))
    eng.route(table)
    try:
        eng.reset()
        eng.prefill(c[:DENSE])
        nll = 0.0
        for t, target in zip(c[DENSE:CHUNK].tolist(), c[DENSE + 1:].tolist(), strict=True):
            logits = eng.decode_step(t)
            nll += float(F.cross_entropy(logits.double()[None], torch.tensor([target])))
        assert abs(eng.routed_fraction() - float(on.float().mean())) < 1e-9
    finally:
        eng.configure(SparsityConfig())
        eng.reset()
    assert got == pytest.approx(nll, rel=1e-6)


def test_decode_protocol_runs_the_routing(setup, tmp_path):
    from sparsedecode.quality.perplexity import decode_nll

    eng, ids = setup
    args = dict(windows=1, length=560)
    try:
        dense = decode_nll(eng, ids, **args).nll
        th = _cats(eng)
        cats = decode_nll(eng, ids, config=_named(tmp_path, th), thresholds=th, **args).nll
        for tau, want in ((math.inf, cats), (-math.inf, dense)):
            th, table = _cats(eng), _table(eng, tau)
            routed = _named(tmp_path, th, table, f"tau{tau}")
            got = decode_nll(eng, ids, config=routed, thresholds=th, routing=table, **args).nll
            # all dense-routed: the original MLP's ops, on the row-major up the CPU kernel keeps
            # (kernels.cpu_gemv), so equal to the dense run to float32 rounding, not bitwise
            assert got == (want if tau == math.inf else pytest.approx(want, rel=1e-6))
            assert eng.config.mode == "proj+route"
        assert cats != dense
    finally:
        eng.configure(SparsityConfig())


def test_a_resumable_pass_continues_after_an_interruption(setup, tmp_path, monkeypatch):
    """`resumable_chunked_nll` saves each chunk: interrupted after chunk 1 of 2, the rerun computes
    chunk 2 only and gives what an uninterrupted pass gives; other names start over."""
    import json

    from sparsedecode.quality import perplexity

    eng, ids = setup
    two = ids + ids[1:]  # two chunks and the last target
    settings, names = [(None, None), (_cats(eng).values, None)], ["dense", "cats"]
    want = perplexity.resumable_chunked_nll(eng, two, 2, names, settings, tmp_path / "whole.json")
    real, calls = perplexity.chunked_nll_many, []

    def interrupted(*a, **k):
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(perplexity, "chunked_nll_many", interrupted)
    prog = tmp_path / "p.json"
    with pytest.raises(KeyboardInterrupt):
        perplexity.resumable_chunked_nll(eng, two, 2, names, settings, prog)
    assert {k: len(v) for k, v in json.loads(prog.read_text())["nll"].items()} == {"dense": 1, "cats": 1}

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    calls.clear()
    monkeypatch.setattr(perplexity, "chunked_nll_many", counted)
    assert perplexity.resumable_chunked_nll(eng, two, 2, names, settings, prog) == want and len(calls) == 1
    calls.clear()
    perplexity.resumable_chunked_nll(eng, two, 2, ["dense", "other"], settings, prog)
    assert len(calls) == 2  # another set of settings: nothing of the old file is reused
