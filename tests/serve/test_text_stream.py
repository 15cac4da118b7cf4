"""The server's incremental detokenizer: the text it builds token by token is the whole answer's
decode, and each token decodes only a short tail (linear host time in the answer's length)."""

from __future__ import annotations

import random

from conftest import require_embedded
from sparsedecode.serve.worker import TextStream

TEXT = ("The café's naïve señor wrote 漢字 and ひらがな, then 🙂🚀 — “quotes” and tabs\there; "
        "numbers 3.14159, code `x = y ** 2`, and a long tail of ordinary English words. ") * 6


class Counting:
    """A tokenizer whose decode records how many ids each call decoded."""

    def __init__(self, tok):
        self.tok, self.lengths = tok, []

    def decode(self, ids, **kw):
        self.lengths.append(len(ids))
        return self.tok.decode(ids, **kw)


def _tokenizer():
    from sparsedecode.models.load import load_tokenizer, resolve

    require_embedded("smollm2-135m")
    return load_tokenizer(resolve("smollm2-135m", quiet=True))


def test_the_stream_is_the_whole_decode_and_decodes_short_tails():
    tok = _tokenizer()
    ids = tok(TEXT)["input_ids"]
    counting = Counting(tok)
    stream = TextStream(counting)
    pieces = [stream.add(t) for t in ids]
    assert "".join(pieces) == stream.text == tok.decode(ids, skip_special_tokens=True)
    assert len(ids) > 300 and max(counting.lengths) <= 8, max(counting.lengths)  # never the whole answer
    assert any(p == "" for p in pieces)  # some token ended inside a multi-byte character


def test_random_ids_and_special_tokens_stream_to_the_same_text():
    tok = _tokenizer()
    rng = random.Random(0)
    special = sorted(set(tok.all_special_ids))
    for _ in range(5):
        ids = [rng.randrange(tok.vocab_size) if rng.random() > 0.05 else rng.choice(special) for _ in range(200)]
        stream = TextStream(tok)
        for t in ids:
            stream.add(t)
        full = tok.decode(ids, skip_special_tokens=True)
        assert stream.text == full.rstrip("\ufffd") or full.endswith("\ufffd") and full.startswith(stream.text)
