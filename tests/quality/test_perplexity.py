"""Chunked perplexity: dense equals a full forward of each chunk, a configuration changes
only the scored half."""

import pytest
import torch
import torch.nn.functional as F

import sparsedecode
from sparsedecode.errors import InputError
from sparsedecode.quality.perplexity import CHUNK, DENSE, chunked_nll

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
