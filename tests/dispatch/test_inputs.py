"""Gate tables, verdicts and request traces are input (issue 48): every field's type and range is
checked when a file is loaded, a bad one is refused in one line naming the file, the field and
the value, and absurd request sizes are refused before any pricing starts."""

import copy
import json
import math
import time

import numpy as np
import pytest
from _tables import dims

from sparsedecode.dispatch.mix import ANSWER_LIMIT, PROMPT_LIMIT, Mix, read_trace
from sparsedecode.dispatch.policies import admissible, choose, cost_matrix, request_ms
from sparsedecode.dispatch.prices import ConfigPrice, Curve, PriceTable, SelectCost
from sparsedecode.errors import InputError


def _table(**kw) -> PriceTable:
    configs = {"dense": ConfigPrice("dense", Curve((512, 4096), (10.0, 12.0))),
               "sel0.3": ConfigPrice("sel0.3", Curve((512, 4096), (9.0, 9.5)),
                                     SelectCost("per_token", seconds_at_32k=0.1))}
    fields = dict(model="m", dims=dims(), gpu="CPU", device="cpu", dtype="float32", attention="split_k",
                  source="sparsedecode", records=("x",), configs=configs,
                  admissibility={"dense": {"admitted": True}, "sel0.3": {"admitted": True}})
    return PriceTable(**{**fields, **kw})


DELETE = object()

BAD_TABLES = [  # (field path, value, words the one-line message must hold)
    ("model", None, ["field 'model' is null"]),
    ("model", 3, ["field 'model' is 3"]),
    ("gpu", True, ["field 'gpu' is true"]),
    ("source", "mine", ["field 'source' is \"mine\""]),
    ("configs", [], ["field 'configs' is []", "an object"]),
    ("configs.dense.curve.ms", [10.0, None], ["ms at context 4096", "null"]),
    ("configs.dense.curve.ms", [10.0, float("nan")], ["NaN"]),
    ("configs.dense.curve.ms", [10.0, float("inf")], ["Infinity"]),
    ("configs.dense.curve.ms", [10.0, -1.0], ["-1.0", "> 0"]),
    ("configs.dense.curve.ms", [10.0, 1e300], ["1e+300"]),
    ("configs.dense.curve.ms", [10.0, True], ["true"]),
    ("configs.dense.curve.ms", ["10", 12.0], ["\"10\""]),
    ("configs.dense.curve.contexts", [4096, 512], ["must increase", "512 follows 4096"]),
    ("configs.dense.curve.contexts", [512, 512], ["must increase"]),
    ("configs.dense.curve.contexts", [512, 2**63], ["9223372036854775808", "33554432"]),
    ("configs.dense.curve.contexts", [-5, 4096], ["-5"]),
    ("configs.dense.curve.contexts", [512.5, 4096], ["512.5", "whole number"]),
    ("configs.dense.curve.contexts", [512], ["one step time per context"]),
    ("configs.dense.curve.cells", -1, ["curve.cells", "-1"]),
    ("configs.dense.curve", DELETE, ["field 'curve' is missing"]),
    ("configs.sel0.3.select", None, ["no selection cost", "not a free selection"]),
    ("configs.sel0.3.select.seconds_at_32k", None, ["seconds_at_32k' is null"]),
    ("configs.sel0.3.select.seconds_at_32k", -0.1, ["-0.1"]),
    ("configs.sel0.3.select.kind", "free", ["select.kind", "free"]),
    ("configs.sel0.3.sinks", -4, ["sinks", "-4"]),
    ("configs.sel0.3.window", 1.5, ["window", "1.5"]),
    ("dims.vocab", DELETE, ["field 'dims.vocab' is missing"]),
    ("dims.vocab", None, ["field 'dims.vocab' is null"]),
    ("dims.n_kv_heads", 0, ["n_kv_heads", "0"]),
    ("dims.n_layers", -2, ["n_layers", "-2"]),
    ("dims.d", True, ["'dims.d' is true"]),
    ("dims.d", 2**70, ["1180591620717411303424"]),
    ("dims.d", "64", ["\"64\""]),
    ("dims.colour", "red", ["unknown fields colour"]),
    ("admissibility.sel0.3.admitted", "false", ["admitted' is \"false\"", "true or false"]),
    ("admissibility.sel0.3", None, ["admissibility.sel0.3' is null"]),
    ("admissibility.proj0.5", {"admitted": True}, ["proj0.5", "not one of the table's configurations"]),
    ("records", "x", ["field 'records' is \"x\""]),
    ("schema", 7, ["field 'schema' is 7"]),
]


def _unflatten_specs(path: str) -> list[str]:
    """Dotted path split on dots, keeping mode names such as 'sel0.3' and 'both0.5/0.3' whole."""
    out = []
    for part in path.split("."):
        if out and out[-1][-1:].isdigit() and part.isdigit() is False and part[:1].isdigit():
            out[-1] += "." + part
        elif out and out[-1] in ("sel0", "proj0", "both0") or (out and out[-1].endswith("/0")):
            out[-1] += "." + part
        else:
            out.append(part)
    return out


def _put(d: dict, path: str, value) -> dict:
    d = copy.deepcopy(d)
    keys = _unflatten_specs(path)
    at = d
    for k in keys[:-1]:
        at = at[k]
    if value is DELETE:
        del at[keys[-1]]
    else:
        at[keys[-1]] = value
    return d


@pytest.mark.parametrize("path, value, words", BAD_TABLES, ids=[f"{p}={'<deleted>' if v is DELETE else repr(v)}"[:40]
                                                                 for p, v, _ in BAD_TABLES])
def test_a_bad_gate_table_field_is_refused_in_one_line(tmp_path, path, value, words):
    good = _table().to_dict()
    PriceTable.from_dict(good, "gate.json")  # the good table loads
    f = tmp_path / "gate.json"
    f.write_text(json.dumps(_put(good, path, value)))
    with pytest.raises(InputError) as e:
        PriceTable.read(f)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(f)), msg
    for w in words:
        assert w in msg, msg


def test_missing_dims_do_not_skip_the_model_check():
    class Eng:
        name, device, dims = "other", "cpu", dims(name="other")

    with pytest.raises(InputError, match="timed on m and carries no dims to compare; the engine runs other"):
        _table(dims=None).check_engine(Eng)
    Eng.name = "m"
    _table(dims=None).check_engine(Eng)  # same name, no dims: nothing to hold against it


def _verdict(**kw):
    v = {"kind": "admissibility", "model": "m", "admissible": True, "reasons": [],
         "config": {"mode": "sel", "kv": {"method": "snapkv", "keep": 0.3}}, "dims": dims().to_dict()}
    return {**v, **kw}


def test_a_verdict_of_another_model_admits_nothing():
    t = _table()
    assert admissible(t, [_verdict()])[0] == ["dense", "sel0.3"]
    with pytest.raises(InputError, match=r"--admit v.json judges big, whose dims differ .*d 128 vs 64"):
        admissible(t, [_verdict(model="big", dims=dims(d=128, name="big").to_dict())], names=["v.json"])
    # without dims on either side the names are compared: never skipped
    with pytest.raises(InputError, match="judges other and the table prices m, and the verdict carries no dims"):
        admissible(t, [_verdict(model="other", dims=None)])
    with pytest.raises(InputError, match="the table carries no dims"):
        admissible(_table(dims=None), [_verdict(model="other")])
    assert admissible(t, [_verdict(dims=None)])[0] == ["dense", "sel0.3"]  # same name


@pytest.mark.parametrize("field, value, words", [
    ("admissible", "yes", ["admissible' is \"yes\"", "true or false"]),
    ("admissible", None, ["admissible' is null"]),
    ("model", None, ["model' is null"]),
    ("config", None, ["config' is null"]),
    ("config", {"kv": {"keep": 1.5}}, ["config.kv.keep' is 1.5"]),
    ("config", {"kv": {"keep": float("nan")}}, ["NaN"]),
    ("config", {"projection": {"keep": True}}, ["config.projection.keep' is true"]),
    ("reasons", "bad", ["reasons' is \"bad\""]),
    ("dims", {"n_layers": 2}, ["dims.", "missing"]),
])
def test_a_bad_verdict_is_refused_in_one_line(field, value, words):
    with pytest.raises(InputError) as e:
        admissible(_table(), [_verdict(**{field: value})], names=["v.json"])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--admit v.json"), msg
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize("line, words", [
    ('{"prompt_tokens": 9223372036854775808, "answer_tokens": 8}', ["prompt_tokens", str(2**63), str(PROMPT_LIMIT)]),
    ('{"prompt_tokens": 100, "answer_tokens": 1000000000}', ["answer_tokens", "1000000000", str(ANSWER_LIMIT)]),
    ('{"prompt_tokens": 100, "answer_tokens": null}', ["answer_tokens' is null"]),
    ('{"prompt_tokens": true, "answer_tokens": 8}', ["prompt_tokens' is true"]),
    ('{"prompt_tokens": 1e3, "answer_tokens": 8}', ["1000.0", "whole number"]),
    ('{"prompt_tokens": -3, "answer_tokens": 8}', ["-3"]),
])
def test_a_trace_with_absurd_sizes_is_refused_with_the_limit(tmp_path, line, words):
    f = tmp_path / "t.jsonl"
    f.write_text('{"prompt_tokens": 10, "answer_tokens": 2}\n' + line + "\n")
    with pytest.raises(InputError) as e:
        read_trace(f)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{f} line 2: "), msg
    for w in words:
        assert w in msg, msg


def test_csv_trace_sizes_are_limited_too(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text(f"prompt_tokens,answer_tokens\n10,2\n{PROMPT_LIMIT + 1},4\n")
    with pytest.raises(InputError, match=f"line 3: field 'prompt_tokens' is {PROMPT_LIMIT + 1}, expected a whole "
                                         f"number from 1 to {PROMPT_LIMIT}"):
        read_trace(f)
    f.write_text(f"prompt_tokens,answer_tokens\n{PROMPT_LIMIT},{ANSWER_LIMIT}\n")
    assert len(read_trace(f)) == 1  # at the limits: allowed


def test_the_gate_refuses_absurd_request_sizes():
    t = _table()
    for p, a in ((2**63, 8), (100, 10**9), (0, 8), (True, 8), (None, 8), (100, math.nan)):
        with pytest.raises(InputError, match="request: field '(prompt|answer)_tokens'"):
            choose(t, p, a, t.specs)


def test_pricing_past_the_last_context_is_closed_form_and_fast():
    t = _table()
    dense = t.configs["dense"]
    # the closed form agrees with stepping segment by segment
    for p, a in ((100, 5000), (4000, 300), (5000, 129), (1, 1), (4096 - 32, 64), (4096 - 33, 64)):
        want, s = 0.0, 0
        while s < a:
            k = min(64, a - s)
            want += k * dense.curve.at(p + s + k / 2)
            s += k
        assert request_ms(dense, p, a) == pytest.approx(want, rel=1e-12)
    m = Mix("m", np.array([100, 4000, 5000, 3]), np.array([5000, 300, 129, 2]))
    specs, costs, _ = cost_matrix(t, m)
    for i, s in enumerate(specs):
        for r in range(len(m)):
            assert costs[i, r] == pytest.approx(request_ms(t.configs[s], int(m.prompt[r]), int(m.answer[r])))
    t0 = time.perf_counter()
    choose(t, PROMPT_LIMIT, ANSWER_LIMIT, t.specs)
    request_ms(dense, 100, ANSWER_LIMIT)
    cost_matrix(t, Mix("big", np.array([PROMPT_LIMIT, 100]), np.array([ANSWER_LIMIT, ANSWER_LIMIT])))
    assert time.perf_counter() - t0 < 1.0  # stepping would take 16K segments per request
