"""The runtime gate (ByteCross §3.3): per request the admissible configuration of least predicted
cost, installed without rebuilding modules or recapturing kept graphs; every request decodes
exactly as an engine configured for it alone."""

from __future__ import annotations

import math
import random

import pytest
import torch

import sparsedecode
from conftest import require_embedded
from sparsedecode.config import KVConfig, SparsityConfig
from sparsedecode.dispatch.policies import request_ms
from sparsedecode.dispatch.prices import ConfigPrice, Curve, PriceTable, SelectCost, device_name
from sparsedecode.dispatch.runtime import RuntimeGate, load_gate
from sparsedecode.errors import InputError

TINY = dict(model_type="llama", hidden_size=96, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, vocab_size=100, max_position_embeddings=1024,
            rope_theta=10000.0, eos_token_id=None)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
WINDOW = 16


def engine(device: str):
    """A tiny random engine whose attention matters (q/k/v/o scaled up: peaked scores)."""
    eng = sparsedecode.load(dict(TINY), init="random", device=device, dtype="float32", max_len=640, quiet=True)
    with torch.no_grad():
        for layer in eng.model.layers:
            for name, scale in (("q_proj", 12.0), ("k_proj", 12.0), ("v_proj", 20.0), ("o_proj", 20.0)):
                getattr(layer.self_attn, name).weight.mul_(scale)
    return eng


def table(eng) -> PriceTable:
    """proj wins short prompts, both long ones; sel is never best; dense is the fallback."""
    sel = SelectCost("per_token", seconds_at_32k=0.5)
    c = lambda spec, a, b, s=None: ConfigPrice(spec, Curve((64, 512), (a, b)), s, window=WINDOW)  # noqa: E731
    configs = {"dense": c("dense", 10.0, 14.0), "proj0.5": c("proj0.5", 6.0, 10.0),
               "sel0.3": c("sel0.3", 9.9, 10.5, sel), "both0.5/0.3": c("both0.5/0.3", 6.2, 6.6, sel)}
    return PriceTable("tiny", eng.dims, device_name(eng.device), eng.device.type, "float32", "split_k",
                      "sparsedecode", ("test",), configs,
                      {s: {"admitted": True} for s in configs})


def test_the_gate_needs_admissibility_and_matching_dims():
    eng = engine("cpu")
    t = table(eng)
    with pytest.raises(InputError, match="admissibility"):
        RuntimeGate(eng, PriceTable(**{**t.__dict__, "admissibility": {}}))
    other = sparsedecode.load(dict(TINY, hidden_size=120), init="random", dtype="float32", max_len=64, quiet=True)
    with pytest.raises(InputError, match="timed on tiny and the engine runs"):
        RuntimeGate(other, t)


def test_choice_is_the_argmin_of_the_tables_costs_and_cheap():
    eng = engine("cpu")
    t = table(eng)
    gate = RuntimeGate(eng, t, calib_tokens=256)
    rng = random.Random(0)
    times = []
    for _ in range(20):
        p, a = rng.randint(1, 600), rng.randint(1, 300)
        got = gate.choose(p, a)
        times.append(got.choose_ms)
        want = {s: request_ms(t.configs[s], p, a) for s in t.specs
                if not t.configs[s].uses_kv or math.floor(t.configs[s].mode.kv_keep * p + 0.5) - a >= 4 + WINDOW}
        assert got.spec == min(want, key=want.get), (p, a, got.costs_ms)
    assert max(times) < 100.0  # ms: choosing prices a table, it never calibrates or compiles (seconds)
    assert gate.choose(30, 8).spec == "proj0.5"  # no KV budget at 30 tokens: priced out, no error
    assert gate.choose(500, 60).spec == "both0.5/0.3"


def _static(eng, spec, th):
    """A fresh engine configured for `spec` alone, as a user would without a gate."""
    config = SparsityConfig.parse(spec)
    if config.kv is not None:
        config = config.with_(kv=KVConfig("snapkv", 0.3, {"window": WINDOW, "sinks": 4}))
    eng.configure(config, thresholds=th if config.projection is not None else None)
    return eng


@pytest.mark.parametrize("device", DEVICES)
def test_every_request_decodes_as_its_configuration_alone(device, fresh_dynamo):
    """On CUDA this compiles 6 steps of one code object (3 kept by the gate, 2 references, 1
    plain), under torch._dynamo's recompile limit of 8 after the fixture's reset."""
    eng = engine(device)
    gate = RuntimeGate(eng, table(eng), calib_tokens=256)
    gen = torch.Generator().manual_seed(1)
    short = torch.randint(0, 100, (40,), generator=gen).tolist()
    long = torch.randint(0, 100, (520,), generator=gen).tolist()
    # short (proj), long (both), short again, then a dense-only request via install
    runs = []
    for ids, n in ((short, 12), (long, 40), (short, 12), (long, 40)):
        out = eng.generate(ids, max_new_tokens=n, gate=gate)
        runs.append((ids, n, out.choice.spec, out.ids, out))
    assert [r[2] for r in runs] == ["proj0.5", "both0.5/0.3", "proj0.5", "both0.5/0.3"]
    assert runs[1][4].kv_select_s > 0 and eng.kv is not None and eng.kv.budget < len(long)
    th = gate._thresholds[0.5]
    refs = {}
    for ids, n, spec, tokens, _ in runs:
        if spec not in refs:
            refs[spec] = _static(engine(device), spec, th)
        assert tokens == refs[spec].generate(ids, max_new_tokens=n).ids, spec
    # back to dense: the dense modules are the very ones the engine started with
    gate.install("dense")
    assert eng.thresholds is None and eng.kv_config is None
    plain = engine(device).generate(short, max_new_tokens=12)
    assert eng.generate(short, max_new_tokens=12).ids == plain.ids
    if device == "cuda":
        assert eng.graphs == 3  # proj, both, dense: each captured once, replayed after


@pytest.mark.slow
def test_smollm2_gate_from_cpu_cell_records():
    """(The gate calibrates its TEAL thresholds on WikiText-2 validation, as the timing cells did.)"""
    from _tables import CPU_CELLS

    from sparsedecode.dispatch.policies import admissible, choose
    from sparsedecode.dispatch.prices import from_records

    if not CPU_CELLS.is_dir():
        pytest.skip("CPU cell records not committed")
    require_embedded("smollm2-135m")  # a GPU machine without network skips; CI fetches it
    t = from_records([CPU_CELLS])
    ok, why = admissible(t, [], assume=True)
    t = PriceTable(**{**t.__dict__, "admissibility": {s: {"admitted": s in ok} for s in t.specs}})
    eng = sparsedecode.load("smollm2-135m", device="cpu", dtype="float32", max_len=2048, quiet=True)
    gate = load_gate(eng, t.to_dict())
    rng = random.Random(0)
    for _ in range(20):
        p, a = rng.randint(64, 8000), rng.randint(1, 2000)
        got = gate.choose(p, a)
        assert got.spec == choose(t, p, a, gate.specs)[0] and 0 <= got.choose_ms < 100.0
    # what the table says for a short and a long request, and what the engine then runs
    short_spec = gate.choose(100, 16).spec
    assert not t.configs[short_spec].uses_kv  # 100 tokens hold no KV budget
    long_p, long_a = 1024, 128
    long_spec = gate.choose(long_p, long_a).spec
    assert t.configs[long_spec].uses_kv  # on these CPU records a selection pays off here
    ids = torch.randint(0, eng.dims.vocab, (long_p,), generator=torch.Generator().manual_seed(0)).tolist()
    from sparsedecode.engine.engine import Generation

    g = Generation(prompt_ids=ids)
    it = eng.tokens(ids, long_a, timing=g, gate=gate)
    next(it)
    next(it)
    it.close()
    assert g.choice.spec == long_spec
    assert (eng.kv is not None) == t.configs[long_spec].uses_kv
    assert (eng.thresholds is not None) == (t.configs[long_spec].mode.proj_keep < 1)
    print(f"short -> {short_spec}, long -> {long_spec}")


def test_dispatch_check_sets_measured_beside_predicted(tmp_path, capsys):
    """`sparsedecode dispatch check` on a random-init model folder: a record of each request's
    configuration, predicted and measured ms/token; a table of another model is refused."""
    import json

    from conftest import run_cli

    def cli(*args):
        r = run_cli(capsys, *args)
        return r.returncode, r.stderr

    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY))
    eng = engine("cpu")
    gate = tmp_path / "gate.json"
    gate.write_text(json.dumps(table(eng).to_dict()))
    rec = tmp_path / "check.json"
    cmd = ["dispatch", "check", str(gate), "--model", str(folder), "--init", "random", "--device", "cpu",
           "--dtype", "float32", "--request", "40:8", "--request", "520:30", "--tolerance", "1000", "--out", str(rec)]
    code, err = cli(*cmd)
    assert code == 0, err
    out = json.loads(rec.read_text())
    assert out["kind"] == "gate_check" and out["passed"]
    assert [q["mode"] for q in out["requests"]] == ["proj0.5", "both0.5/0.3"]
    assert all(q["ms_per_token"] > 0 and q["decode_steps"] == q["answer_tokens"] - 1 for q in out["requests"])
    code, err = cli(*cmd)
    assert code == 2 and "exists" in err  # records are never overwritten
    other = json.loads(gate.read_text())
    other["dims"]["d"] = 128
    gate.write_text(json.dumps(other))
    code, err = cli(*cmd[:-2], "--out", str(tmp_path / "c2.json"))
    assert code == 2 and "timed on tiny" in err, err
    gate.write_text(json.dumps(table(eng).to_dict()))
    code, _ = cli(*cmd[:-4], "--tolerance", "1e-9", "--out", str(tmp_path / "c3.json"))
    assert code == 1  # the table is made up: far from what this CPU measures
