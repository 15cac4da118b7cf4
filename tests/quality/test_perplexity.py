"""Chunked perplexity: dense equals a full forward of each chunk, a configuration changes
only the scored half, and the table is rebuilt from records."""

import pytest
import torch
import torch.nn.functional as F

import sparsedecode
from sparsedecode.errors import InputError
from sparsedecode.quality.perplexity import CHUNK, DENSE, chunked_nll, pooled_ppl
from sparsedecode.records import stamp, write_record
from sparsedecode.report.ppl_table import load_ppl_records, ppl_table

CFG = dict(
    model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
    max_position_embeddings=4096, rope_theta=10000.0, eos_token_id=None,
)
SITES = "q k v o gate up down".split()


@pytest.fixture(scope="module")
def setup():
    eng = sparsedecode.load(dict(CFG), init="random", device="cpu", max_len=CHUNK)
    ids = torch.randint(0, 100, (2 * CHUNK + 1,), generator=torch.Generator().manual_seed(0))
    return eng, ids


def test_dense_chunked_nll_equals_full_forward(setup):
    eng, ids = setup
    got = chunked_nll(eng, ids, chunks=2)
    for k, nll in enumerate(got):
        c = ids[k * CHUNK : (k + 1) * CHUNK + 1]
        logits = eng.forward_logits(c[:CHUNK])  # (CHUNK, V)
        want = F.cross_entropy(logits[DENSE:].double(), c[DENSE + 1 :], reduction="sum").item()
        assert nll == pytest.approx(want, rel=1e-9)


def test_thresholds_change_the_scored_half_only(setup):
    eng, ids = setup
    dense = chunked_nll(eng, ids, chunks=2)
    zero = chunked_nll(eng, ids, chunks=2, table={f"layers.{i}.{s}": 0.0 for i in range(2) for s in SITES})
    assert zero == pytest.approx(dense, rel=1e-9)  # |x| > 0 keeps every nonzero channel
    sparse = chunked_nll(eng, ids, chunks=2, table={f"layers.{i}.{s}": 0.05 for i in range(2) for s in SITES})
    assert sparse != pytest.approx(dense, rel=1e-6)


def test_too_short_text_is_refused(setup):
    eng, ids = setup
    with pytest.raises(InputError, match="needs 6,145 tokens"):
        chunked_nll(eng, ids, chunks=3)


def test_table_from_records(tmp_path, setup):
    text = {"file": "x", "chunks": 2}
    for label, method, nll in (("dense", "dense", [2048.0, 2048.0]), ("teal 0.5", "teal", [3072.0, 3072.0])):
        write_record(tmp_path / f"{label}.json", stamp({
            "kind": "ppl_chunked", "label": label, "config": {"method": method}, "text": text,
            "nll_per_chunk": nll, "targets_per_chunk": 1024, "realized_keep": None if method == "dense" else 0.5,
            "runtime": "masked reference (CPU)"}, with_torch=False))
    table = ppl_table(load_ppl_records(tmp_path))
    lines = table.splitlines()
    assert lines[2].startswith("| dense |") and f"{pooled_ppl([2048.0, 2048.0]):.3f}" in lines[2]
    assert "| teal 0.5 | 0.500 |" in lines[3] and f"{pooled_ppl([3072.0] * 2) - pooled_ppl([2048.0] * 2):+.3f}" in lines[3]
