"""`cached_teal` (issue 48): thresholds calibrated once per model, keep and text content, cached
under the sparsedecode cache; the first run says where and how to reuse them; `generate --text-file`
calibrates on that text, not on the shipped WikiText-2."""

from __future__ import annotations

import pytest

import sparsedecode
from conftest import run_cli
from sparsedecode.corpus import wikitext_path
from sparsedecode.projection import calibrate
from sparsedecode.projection.thresholds import Thresholds

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=49152, max_position_embeddings=1024,
            rope_theta=10000.0, eos_token_id=None)


@pytest.fixture(scope="module")
def tiny():
    """A random-init engine with smollm2-135m's tokenizer (the same vocabulary), fast to calibrate."""
    from sparsedecode.models.load import load_tokenizer, resolve

    eng = sparsedecode.load(dict(TINY), init="random", device="cpu", dtype="float32", max_len=256, compile=False)
    eng.tokenizer = load_tokenizer(resolve("smollm2-135m", quiet=True))  # calibration needs text
    return eng


@pytest.fixture
def texts(tmp_path, monkeypatch):
    """Two texts of other content under the same file name, and a copy of the first elsewhere."""
    monkeypatch.setenv("SPARSEDECODE_CACHE", str(tmp_path / "cache"))
    valid = wikitext_path("valid").read_text(encoding="utf-8")
    a, b, copy = tmp_path / "a/t.txt", tmp_path / "b/t.txt", tmp_path / "c/other.txt"
    for p, text in ((a, valid[:60_000]), (b, valid[60_000:120_000]), (copy, valid[:60_000])):
        p.parent.mkdir()
        p.write_text(text, encoding="utf-8")
    return a, b, copy


def test_the_cache_is_keyed_by_the_texts_content(tiny, texts, tmp_path, capsys, monkeypatch):
    a, b, copy = texts
    th_a = calibrate.cached_teal(tiny, 0.5, tokens=512, text_file=a, progress=True)
    err = capsys.readouterr().err
    (cached,) = (tmp_path / "cache/thresholds").iterdir()
    assert "calibrating TEAL thresholds for keep 0.5 on 512 tokens of t.txt, once" in err
    assert f"reuse them from {cached}" in err and "--thresholds FILE" in err
    assert Thresholds.load(cached).values == pytest.approx(th_a.values, rel=1e-6)

    th_b = calibrate.cached_teal(tiny, 0.5, tokens=512, text_file=b, progress=False)  # same name, other text
    assert len(list((tmp_path / "cache/thresholds").iterdir())) == 2
    assert th_b.values != th_a.values

    def refuse(*a, **k):
        raise AssertionError("calibrated again")

    monkeypatch.setattr(calibrate, "get_calibrator", refuse)
    again = calibrate.cached_teal(tiny, 0.5, tokens=512, text_file=copy, progress=True)  # same content
    assert again.values == pytest.approx(th_a.values, rel=1e-6) and capsys.readouterr().err == ""


def test_generate_calibrates_on_its_text_file(tiny, texts, tmp_path, capsys, monkeypatch):
    a, b, _ = texts
    monkeypatch.setattr(sparsedecode, "load", lambda *args, **kw: tiny)
    want = calibrate.cached_teal(tiny, 0.5, tokens=8192, text_file=b, progress=False)
    capsys.readouterr()
    res = run_cli(capsys, "generate", "--prompt", "The", "--proj-keep", "0.5", "--text-file", str(b),
                  "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "2")
    assert res.returncode == 0, res.stderr
    assert "calibrating" not in res.stderr  # b's thresholds were cached: reused, not calibrated on WikiText-2
    assert tiny.thresholds.values == pytest.approx(want.values, rel=1e-6)
    res = run_cli(capsys, "generate", "--prompt", "The", "--proj-keep", "0.5", "--text-file", str(a),
                  "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "2")
    assert res.returncode == 0, res.stderr
    assert "calibrating TEAL thresholds for keep 0.5 on 8,192 tokens of t.txt" in res.stderr
    assert tiny.thresholds.values != pytest.approx(want.values, rel=1e-6)
