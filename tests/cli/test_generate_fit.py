"""`generate` counts the prompt before the model loads (issue 48, item 1): without --max-len the
cache grows to the prompt plus its answer; a prompt past --max-len, or past the model's window, is
refused before any model loads, with the numbers and what to change."""

from __future__ import annotations

import pytest

from conftest import require_embedded, run_cli
from sparsedecode.engine.loader import cache_length
from sparsedecode.errors import InputError, cli_context
from sparsedecode.models.args import ModelArgs

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=100, max_position_embeddings=8192)


def test_cache_length_grows_to_the_prompt_or_refuses_with_the_numbers():
    args = ModelArgs.from_config(TINY, name="tiny")
    assert cache_length(args, 100, 28) == 4096  # the default: min(window, 4096)
    assert cache_length(args, 5000, 128) == 5128  # grown to the prompt plus its answer
    assert cache_length(args, 5000, 128, max_len=6000) == 6000  # a --max-len that fits is kept
    with pytest.raises(InputError, match=r"prompt \(9000 tokens\) plus max_new_tokens=10 needs a cache of "
                                         r"9010 tokens, more than the model window of 8192 tokens .*"
                                         r"shorten the prompt below 8192"):
        cache_length(args, 9000, 10)
    with pytest.raises(InputError, match=r"give max_new_tokens=3192 or less, or shorten"):
        cache_length(args, 5000, 4000)
    with pytest.raises(InputError, match=r"5010 tokens, more than max_len=4096; give max_len=5010 or more"):
        cache_length(args, 5000, 10, max_len=4096)
    with pytest.raises(InputError, match=r"max_len=9000 exceeds the model window of 8192"):
        cache_length(args, 10, 10, max_len=9000)
    with cli_context(), pytest.raises(InputError, match=r"more than --max-len 4096; give --max-len 5010 or more"):
        cache_length(args, 5000, 10, max_len=4096)


@pytest.fixture
def loads(monkeypatch):
    """What `sparsedecode.load` was asked for; the model itself is never built."""
    import sparsedecode

    calls = []

    def record(ref, **kw):
        calls.append((ref, kw))
        raise SystemExit(99)

    monkeypatch.setattr(sparsedecode, "load", record)
    return calls


def _prompt(tmp_path, words: int):
    require_embedded("smollm2-135m")
    f = tmp_path / "p.txt"
    f.write_text("word " * words)
    return str(f)


def test_a_long_prompt_grows_the_cache_and_the_checkpoint_is_resolved_once(tmp_path, capsys, loads):
    from sparsedecode.models.load import Checkpoint

    r = run_cli(capsys, "generate", "--prompt-file", _prompt(tmp_path, 5000), "--device", "cpu", "-n", "100")
    assert r.returncode == 99 and len(loads) == 1, r.stderr
    ref, kw = loads[0]
    assert isinstance(ref, Checkpoint) and ref.name == "smollm2-135m" and ref.tokenizer is not None
    assert kw["max_len"] == 5001 + 100  # 'word ' x 5000 is 5,001 tokens with SmolLM2's tokenizer


@pytest.mark.parametrize("argv, needle", [
    (["--max-len", "4096"], "the prompt (5001 tokens) plus --max-new-tokens 128 needs a cache of 5129 tokens, "
                            "more than --max-len 4096; give --max-len 5129 or more (the model window is 8192)"),
    (["-n", "4000"], "needs a cache of 9001 tokens, more than the model window of 8192 tokens (smollm2-135m); "
                     "give --max-new-tokens 3191 or less"),
    (["--max-len", "9000"], "--max-len 9000 exceeds the model window of 8192 tokens"),
])
def test_a_prompt_that_cannot_fit_is_refused_before_the_model_loads(tmp_path, capsys, loads, argv, needle):
    r = run_cli(capsys, "generate", "--prompt-file", _prompt(tmp_path, 5000), "--device", "cpu", *argv)
    assert r.returncode == 2 and not loads and "Traceback" not in r.stderr
    assert needle in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_prompt_past_the_window_is_refused_before_the_model_loads(tmp_path, capsys, loads):
    r = run_cli(capsys, "generate", "--prompt-file", _prompt(tmp_path, 9000), "--device", "cpu", "-n", "1")
    assert r.returncode == 2 and not loads
    assert "the prompt (9001 tokens) plus --max-new-tokens 1 needs a cache of 9002 tokens, more than the model " \
           "window of 8192 tokens (smollm2-135m); shorten the prompt below 8192 tokens" in r.stderr


def test_load_takes_a_resolved_checkpoint():
    import sparsedecode
    from sparsedecode.models.load import resolve

    ckpt = resolve({**TINY, "max_position_embeddings": 256}, init="random")
    eng = sparsedecode.load(ckpt, init="random", device="cpu", dtype="float32", quiet=True)
    assert eng.max_len == 256 and eng.args.n_layers == 2
