"""The one configuration type (issue 43): text round-trips, equality and hashing, the records'
mode strings, and refusals that say what to write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparsedecode import KVConfig, ProjectionConfig, SparsityConfig
from sparsedecode.errors import InputError

ROOT = Path(__file__).resolve().parents[1]

EVERY = [  # one of each configuration the engine runs
    SparsityConfig(),
    SparsityConfig(ProjectionConfig(keep=0.5)),
    SparsityConfig(ProjectionConfig(file="t.safetensors")),
    SparsityConfig(kv=KVConfig("snapkv", 0.3)),
    SparsityConfig(kv=KVConfig("window", 0.3)),
    SparsityConfig(kv=KVConfig("snapkv", 0.2, {"window": 32, "sinks": 4, "pool_kind": "max"})),
    SparsityConfig(ProjectionConfig(keep=0.5), KVConfig("snapkv", 0.3)),
    SparsityConfig(ProjectionConfig(keep=0.5), KVConfig("window", 0.3)),
    SparsityConfig(ProjectionConfig(file="dir/c+d.safetensors", routing="r.json")),
    SparsityConfig(ProjectionConfig(file="c.safetensors", routing="r.json"), KVConfig("snapkv", 0.25)),
    SparsityConfig(ProjectionConfig(keep=1.0), KVConfig("snapkv", 1.0)),
    SparsityConfig(ProjectionConfig(keep=0.7), adapter="adapters/lora-a"),
]


@pytest.mark.parametrize("c", EVERY, ids=str)
def test_text_round_trips_and_keys_dicts(c):
    assert SparsityConfig.parse(str(c)) == c
    assert hash(SparsityConfig.parse(str(c))) == hash(c)
    assert {c: 1}[SparsityConfig.parse(str(c))] == 1


@pytest.mark.parametrize("text,canonical,kind,cell", [
    ("dense", "dense", "dense", "dense"),
    ("proj0.50", "proj0.5", "proj", "proj50"),
    ("sel.3", "sel0.3", "sel", "sel30"),
    ("snapkv0.3", "sel0.3", "sel", "sel30"),
    ("window0.3", "window0.3", "window", "window30"),
    ("both0.5/0.3", "both0.5/0.3", "both", "p50_s30"),
    ("proj0.5+sel0.3", "both0.5/0.3", "both", "p50_s30"),
    ("sel0.3 + proj0.5", "both0.5/0.3", "both", "p50_s30"),
    ("proj0.5+window0.3", "proj0.5+window0.3", "proj+window", "proj0.5_window0.3"),
    ("sel0.3(window=32,sinks=4)", "sel0.3(sinks=4,window=32)", "sel", "sel0.3_sinks=4_window=32"),
    ("proj[c.st]+route[r.json]", "proj[c.st]+route[r.json]", "proj", "proj_c.st_route_r.json"),
])
def test_forms_their_canonical_text_kind_and_cell(text, canonical, kind, cell):
    c = SparsityConfig.parse(text)
    assert (str(c), c.kind, c.cell) == (canonical, kind, cell)


def test_record_fields_name_the_same_configuration_as_the_mode_string():
    assert SparsityConfig.from_fields("both", 0.5, 0.3) == SparsityConfig.parse("both0.5/0.3")
    assert SparsityConfig.from_fields("sel", 1.0, 0.3) == SparsityConfig.parse("sel0.3")
    assert SparsityConfig.from_fields("dense", 0.5, 0.3) == SparsityConfig()
    assert SparsityConfig.parse("proj[c.st]+route[r.json]").mode == "proj+route"


def test_every_committed_timing_records_mode_string_still_parses():
    """Old records keep loading: every mode_spec our timing cells wrote reads back unchanged."""
    seen = set()
    for f in (ROOT / "benchmarks/records").rglob("*.json"):
        try:
            rec = json.loads(f.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(rec, dict) and rec.get("kind") == "timing_cell" and rec.get("mode_spec"):
            seen.add(rec["mode_spec"])
    assert len(seen) >= 5, seen
    for spec in seen:
        assert str(SparsityConfig.parse(spec)) == spec


@pytest.mark.parametrize("text,match", [
    ("", "empty configuration"), ("sparse", "'sparse' is not one of"), ("proj", "is not one of dense"),
    ("both0.5", "is not one of"), ("proj1.5", "outside"), ("sel0", "outside"),
    ("proj0.5+proj0.3", "projection branch twice"), ("sel0.3+window0.2", "KV branch twice"),
    ("route[r.json]", "give the cats or sats thresholds file too"), ("proj0.5+route[r.json]", "not a keep"),
    ("sel0.3(window)", "not name=value"), ("proj0.5++sel0.3", "empty part"), ("dense0.5", "is not one of"),
])
def test_bad_text_says_what_to_write(text, match):
    with pytest.raises(InputError, match=match):
        SparsityConfig.parse(text)


def test_configurations_are_frozen_and_hold_no_objects():
    c = SparsityConfig.parse("sel0.3(window=32)")
    with pytest.raises(AttributeError):
        c.kv = None
    with pytest.raises(TypeError, match="read-only"):
        c.kv.params["window"] = 8
    with pytest.raises(InputError, match="ProjectionConfig"):
        SparsityConfig(projection=object())
    with pytest.raises(InputError, match="exactly one"):
        ProjectionConfig(keep=0.5, file="t.st")
