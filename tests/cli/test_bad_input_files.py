"""Bad input files on the command line (issue 48, items 3-5): a gate table, a verdict, a trace,
a model config or a timing record that is wrong exits 2 with one line naming the file, the
field and the value, and never a traceback."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from conftest import run_cli
from sparsedecode.account import ModelDims
from sparsedecode.dispatch.prices import ConfigPrice, Curve, PriceTable, SelectCost

DIMS = ModelDims(name="m", n_layers=2, d=64, d_ff=128, n_heads=4, n_kv_heads=2, head_dim=16, vocab=100)


def gate_dict() -> dict:
    configs = {"dense": ConfigPrice("dense", Curve((512, 4096), (10.0, 12.0))),
               "sel0.3": ConfigPrice("sel0.3", Curve((512, 4096), (9.0, 9.5)), SelectCost("per_token", seconds_at_32k=0.1))}
    return PriceTable("m", DIMS, "CPU", "cpu", "float32", "split_k", "sparsedecode", ("x",), configs,
                      {"dense": {"admitted": True}, "sel0.3": {"admitted": True}}).to_dict()


def spoil(d: dict, keys: tuple, value) -> dict:
    d = copy.deepcopy(d)
    at = d
    for k in keys[:-1]:
        at = at[k]
    at[keys[-1]] = value
    return d


def one_line(r, *words):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    for w in words:
        assert w in r.stderr, r.stderr


GATES = [
    (("model",), None, "field 'model' is null"),
    (("configs", "dense", "curve", "ms"), [10.0, float("nan")], "NaN"),
    (("configs", "dense", "curve", "ms"), [10.0, True], "is true"),
    (("configs", "dense", "curve", "contexts"), [4096, 512], "must increase"),
    (("configs", "dense", "curve", "contexts"), [512, 2**63], str(2**63)),
    (("configs", "sel0.3", "select"), None, "not a free selection"),
    (("configs", "sel0.3", "sinks"), -4, "field 'sinks' is -4"),
    (("dims", "n_kv_heads"), 0, "field 'dims.n_kv_heads' is 0"),
    (("dims", "vocab"), "100", "field 'dims.vocab' is \"100\""),
    (("admissibility", "sel0.3", "admitted"), "false", "true or false"),
]


@pytest.mark.parametrize("keys, value, words", GATES, ids=[".".join(k) for k, _, _ in GATES])
def test_a_bad_gate_table(tmp_path, capsys, keys, value, words):
    f = tmp_path / "gate.json"
    f.write_text(json.dumps(spoil(gate_dict(), keys, value)))
    one_line(run_cli(capsys, "dispatch", "price", str(f)), str(f), words)


def test_a_gate_table_missing_its_dims_fields(tmp_path, capsys):
    d = gate_dict()
    del d["dims"]["head_dim"]
    f = tmp_path / "gate.json"
    f.write_text(json.dumps(d))
    one_line(run_cli(capsys, "dispatch", "price", str(f)), "field 'dims.head_dim' is missing")


@pytest.mark.parametrize("line, words", [
    ('{"prompt_tokens": 9223372036854775808, "answer_tokens": 8}', ["line 1", str(2**24)]),
    ('{"prompt_tokens": 100, "answer_tokens": 1000000000}', ["line 1", "1000000000", str(2**20)]),
    ('{"prompt_tokens": null, "answer_tokens": 8}', ["prompt_tokens' is null"]),
])
def test_a_trace_of_absurd_requests(tmp_path, capsys, line, words):
    g, t = tmp_path / "gate.json", tmp_path / "trace.jsonl"
    g.write_text(json.dumps(gate_dict()))
    t.write_text(line + "\n")
    one_line(run_cli(capsys, "dispatch", "price", str(g), "--mix", str(t)), str(t), *words)


def test_dispatch_check_refuses_an_absurd_request_before_loading(tmp_path, capsys):
    g = tmp_path / "gate.json"
    g.write_text(json.dumps(gate_dict()))
    one_line(run_cli(capsys, "dispatch", "check", str(g), "--model", "smollm2-135m", "--request", "2K:1073741824"),
             "--request 2K:1073741824", str(2**20))


@pytest.mark.parametrize("over, words", [
    ({"model": "other", "dims": None}, "judges other and the table prices m"),
    ({"dims": {**DIMS.to_dict(), "d": 128}}, "d 128 vs 64"),
    ({"admissible": "yes"}, "admissible' is \"yes\""),
    ({"config": {"kv": {"keep": 1.5, "method": "snapkv"}}}, "config.kv.keep' is 1.5"),
])
def test_a_bad_or_foreign_verdict(tmp_path, capsys, over, words):
    g, v = tmp_path / "gate.json", tmp_path / "verdict.json"
    g.write_text(json.dumps(gate_dict()))
    verdict = {"kind": "admissibility", "model": "m", "admissible": True, "reasons": [], "dims": DIMS.to_dict(),
               "config": {"kv": {"keep": 0.3, "method": "snapkv"}}, **over}
    v.write_text(json.dumps(verdict))
    one_line(run_cli(capsys, "dispatch", "price", str(g), "--admit", str(v)), f"--admit {v}", words)


@pytest.mark.parametrize("field, value, words", [
    ("num_key_value_heads", 0, "num_key_value_heads' is 0"),
    ("num_hidden_layers", -2, "num_hidden_layers' is -2"),
    ("head_dim", 0, "head_dim' is 0"),
    ("vocab_size", 0, "vocab_size' is 0"),
    ("sliding_window", 0, "sliding_window' is 0"),
    ("sliding_window", [4096], "lists 1 windows"),
])
def test_an_impossible_model_config(tmp_path, capsys, field, value, words):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "mistral", "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "vocab_size": 100, field: value}))
    one_line(run_cli(capsys, "account", "--config", str(cfg)), words)


@pytest.mark.parametrize("over, words", [
    ({"ms_per_token": float("nan")}, "'ms_per_token' is nan"),
    ({"ms_per_token": 0}, "'ms_per_token' is 0"),
    ({"tokens_per_sec": float("inf")}, "'tokens_per_sec' is inf"),
])
def test_a_spoiled_timing_record(tmp_path, capsys, over, words):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "timing"))
    from test_report import _write

    root = tmp_path / "camp"
    _write(root, "sweep", "dense", 2048, 0, 10.0)
    bad = _write(root, "sweep", "proj50", 2048, 0, 8.0, **over)
    for args in (("report", str(root), "--out", str(tmp_path / "rep")),
                 ("dispatch", "table", str(root), "--select-seconds", "0.2", "--out", str(tmp_path / "g.json"))):
        one_line(run_cli(capsys, *args), str(bad), words)
