"""`sparsedecode serve` through real clients on loopback (the `openai` package and httpx):
smollm2-135m on CPU behind a gate of dense and sel0.3 made from our committed CPU cells."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import require_embedded, run_cli  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CELLS = ROOT / "benchmarks/records/cpu/dispatch/cpu_gate_smollm2"
MAX_LEN = 1024
# after a graceful shutdown uvicorn re-raises the signal it caught, so the exit is by SIGTERM
DRAINED = (0, -signal.SIGTERM)
LONG = " ".join(["The quick brown fox jumps over the lazy dog."] * 40)  # ~400 tokens: sel0.3 can select


def gate_file(tmp: Path, capsys) -> Path:
    """A gate of dense and sel0.3 (no projection: nothing to calibrate) from the CPU cells."""
    cells = tmp / "cells" / "sweep"
    cells.mkdir(parents=True)
    (tmp / "spec.toml").write_text((CELLS / "spec.toml").read_text())
    for f in (CELLS / "cells" / "sweep").glob("*.json"):
        if f.name.startswith(("dense_", "sel30_")):
            (cells / f.name).write_text(f.read_text())
    out = tmp / "gate.json"
    r = run_cli(capsys, "dispatch", "table", str(tmp), "--assume-admissible", "--out", str(out))
    assert r.returncode == 0, r.stderr
    return out


def start(args: list[str], ready: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "sparsedecode", "serve", "--port", "0", "--ready-file",
                             str(ready), "--threads", "2", *args], stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env=env)
    t0 = time.monotonic()
    while not ready.is_file():
        if proc.poll() is not None or time.monotonic() - t0 > 300:
            proc.kill()
            pytest.fail(f"the server did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return proc


class NoCapture:
    """run_cli's capsys, outside a test (a module fixture)."""

    def readouterr(self):
        return type("O", (), {"out": "", "err": ""})()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_embedded("smollm2-135m")
    tmp = tmp_path_factory.mktemp("serve")
    gate = gate_file(tmp / "gate", NoCapture())
    ready, log = tmp / "ready.json", tmp / "server.log"
    proc = start(["--model", "smollm2-135m", "--gate", str(gate), "--max-len", str(MAX_LEN), "--max-queue", "6"],
                 ready, log)
    info = json.loads(ready.read_text())
    yield {"url": info["url"], "pid": proc.pid, "info": info, "log": log}
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) in DRAINED, log.read_text()[-3000:]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key="none", max_retries=0)


def metric(server, name: str, **labels) -> float:
    text = httpx.get(server["url"] + "/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # as exposed: sorted
    m = re.search(rf"^{name}(?:\{{{re.escape(want)}\}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_start_up_record_health_and_models(server):
    info = server["info"]
    assert info["configurations"] == ["dense", "sel0.3"] and info["default"] == "auto"
    assert info["kind"] == "serve_startup" and info["load_s"] > 0 and info["env"]["git_commit"] is not None
    h = httpx.get(server["url"] + "/health").json()
    assert h["status"] == "ok" and h["max_len"] == MAX_LEN
    assert [m.id for m in client(server).models.list().data] == ["smollm2-135m"]


def test_chat_answers_paris(server):
    r = client(server).chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.usage.completion_tokens >= 1 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    sd = r.model_extra["sparsedecode"]
    assert sd["mode"] == "dense" and sd["predicted_ms_per_token"] > 0  # a short prompt: the gate picks dense


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_chunks_concatenate_to_the_answer(server, chat):
    c = client(server)
    if chat:
        kw = dict(model="smollm2-135m", messages=[{"role": "user", "content": "Name three colours."}],
                  max_tokens=20, temperature=0)
        whole = c.chat.completions.create(**kw).choices[0].message.content
        parts = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(**kw, stream=True)]
    else:
        kw = dict(model="smollm2-135m", prompt="Once upon a time", max_tokens=20, temperature=0)
        whole = c.completions.create(**kw).choices[0].text
        stream = list(c.completions.create(**kw, stream=True))
        parts = [ch.choices[0].text for ch in stream]
        assert stream[-1].choices[0].finish_reason == "length" and stream[-1].usage.completion_tokens == 20
    assert len(parts) > 3 and "".join(parts) == whole


def test_token_ids_and_text_give_the_same_answer(server, embedded_engine):
    c = client(server)
    text = c.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=6, temperature=0)
    ids = embedded_engine("smollm2-135m").tokenizer("The capital of France is")["input_ids"]
    by_ids = c.completions.create(model="smollm2-135m", prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.usage.prompt_tokens == text.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == text.choices[0].text


def test_a_named_configuration_is_honoured(server):
    before = metric(server, "sparsedecode_requests_by_config_total", mode="sel0.3")
    r = client(server).completions.create(model="smollm2-135m", prompt=LONG, max_tokens=8, temperature=0,
                                          extra_body={"sparsedecode": {"kv": "snapkv", "kv_keep": 0.3}})
    sd = r.model_extra["sparsedecode"]
    assert sd["mode"] == "sel0.3" and sd["kv_select_ms"] > 0
    assert metric(server, "sparsedecode_requests_by_config_total", mode="sel0.3") == before + 1
    by_name = client(server).completions.create(model="smollm2-135m", prompt=LONG, max_tokens=8, temperature=0,
                                                extra_body={"sparsedecode": {"mode": "sel0.3"}})
    assert by_name.choices[0].text == r.choices[0].text


def test_ignore_eos_decodes_max_tokens_past_the_answer(server):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    short = client(server).chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=48, temperature=0)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 48
    n = short.usage.completion_tokens + 6
    long = client(server).chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=n, temperature=0,
                                                  extra_body={"ignore_eos": True})
    assert long.choices[0].finish_reason == "length" and long.usage.completion_tokens == n
    assert long.choices[0].message.content.startswith(short.choices[0].message.content)


def test_probe_sets_the_servers_ms_per_token_beside_its_cells(server, tmp_path, capsys):
    out = tmp_path / "probe.json"
    r = run_cli(capsys, "serve-probe", "--url", server["url"], "--request", "512:3", "--mode", "dense", "--mode",
                "sel0.3", "--cells", str(CELLS), "--tolerance", "0.99", "--out", str(out))
    rec = json.loads(out.read_text())
    assert rec["kind"] == "serve_probe" and [row["mode"] for row in rec["rows"]] == ["dense", "sel0.3"]
    for row in rec["rows"]:
        assert row["status"] == 200 and row["completion_tokens"] == 3 and row["cell_ms_per_token"] > 0
        assert row["ratio"] == pytest.approx(row["ms_per_token"] / row["cell_ms_per_token"])
    assert r.returncode == (0 if rec["comparison"]["passed"] else 1)
    r = run_cli(capsys, "serve-probe", "--url", server["url"], "--request", "700:2", "--mode", "dense",
                "--cells", str(CELLS), "--json")
    row = json.loads(r.stdout)["rows"][0]
    assert r.returncode == 1 and row["cell_ms_per_token"] is None and not row["within"]  # no cell at 700


@pytest.mark.parametrize("args,pattern", [
    (["--request", "512", "--mode", "dense"], "PROMPT:ANSWER"),
    (["--request", "512:2", "--mode", "fast"], "not one of"),
    (["--request", "512:2", "--mode", "dense", "--tolerance", "2"], "--tolerance"),
    (["--request", "512:2", "--mode", "dense", "--cells", "no/such/folder"], "no such folder"),
    (["--request", "512:2", "--mode", "dense", "--url", "http://127.0.0.1:9"], "no server answers"),
])
def test_probe_bad_options_exit_2(capsys, args, pattern):
    r = run_cli(capsys, "serve-probe", *args)
    assert r.returncode == 2 and pattern in r.stderr and "Traceback" not in r.stderr


BAD = [  # (endpoint, body or raw text, status, param, message pattern)
    ("completions", "not json", 400, None, "not JSON"),
    ("completions", {"prompt": ""}, 400, "prompt", "non-empty"),
    ("completions", {"prompt": LONG * 3, "max_tokens": 4}, 400, "prompt", "cache of 1024 tokens"),
    ("completions", {"prompt": "hi", "max_tokens": MAX_LEN}, 400, "max_tokens", "lower max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ("completions", {"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens", "integer"),
    ("completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature", ">= 0"),
    ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", "> 0"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p", "<= 1"),
    ("completions", {"prompt": [1, 2, 10**7]}, 400, "prompt", "outside the vocabulary"),
    ("completions", {"prompt": "hi", "n": 2}, 400, "n", "one sequence"),
    ("completions", {"prompt": "hi", "ignore_eos": "yes"}, 400, "ignore_eos", "true or false"),
    ("completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
    ("completions", {"prompt": "hi", "sparsedecode": {"speed": "max"}}, 400, "sparsedecode.speed", "unknown field"),
    ("completions", {"prompt": "hi", "sparsedecode": {"mode": "fast"}}, 400, "sparsedecode.mode", "not one of"),
    ("completions", {"prompt": "hi", "sparsedecode": {"proj_keep": 0.5}}, 400, "sparsedecode.mode", "not warmed up"),
    ("completions", {"prompt": "hi", "sparsedecode": {"kv": "snapkv"}}, 400, "sparsedecode.kv", "both 'kv'"),
    ("completions", {"prompt": "hi", "sparsedecode": {"kv": "h2o", "kv_keep": 0.3}}, 400, "sparsedecode.kv", "snapkv"),
    ("completions", {"prompt": "hi", "sparsedecode": {"kv": "snapkv", "kv_keep": 1.5}}, 400, "sparsedecode.kv_keep", "<= 1"),
    ("completions", {"prompt": "hi", "sparsedecode": {"mode": "sel0.3"}}, 400, "sparsedecode.mode", "longer prompt"),
    ("completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model", "not served here"),
    ("chat", {"messages": []}, 400, "messages", "non-empty list"),
    ("chat", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0]", "role"),
    # pathological JSON and wrong types (issue 48): 4xx, never 5xx
    ("completions", '{"prompt": "hi", "temperature": NaN}', 400, None, "NaN is not a JSON number"),
    ("completions", '{"prompt": "hi", "top_p": -Infinity}', 400, None, "Infinity is not a JSON number"),
    ("completions", '{"prompt": ' + "[" * 100000 + "]" * 100000 + "}", 400, None, "nests too deeply"),
    ("completions", {"prompt": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}, 400,
     "prompt" + "[0]" * 32, "nests deeper than 32"),
    ("completions", '{"prompt": "hi", "max_tokens": ' + "9" * 5000 + "}", 400, None, "4300 digits"),
    ("completions", {"prompt": "hi", "max_tokens": 10**400}, 400, "max_tokens", "more than this server's cache"),
    ("completions", {"prompt": "hi", "temperature": 10**400}, 400, "temperature", "<= 2"),
    ("completions", {"prompt": "hi", "seed": -(10**400)}, 400, "seed", ">= 0"),
    ("completions", [{"prompt": "hi"}], 400, None, "JSON object, got list"),
    ("completions", "\"hi\"", 400, None, "JSON object, got str"),
    ("completions", "", 400, None, "not JSON"),
    ("completions", {"prompt": "caf\ud800"}, 400, "prompt", "lone surrogate"),
    ("completions", {"prompt": "hi", "stop": ["\udfff"]}, 400, "stop[0]", "lone surrogate"),
    ("chat", {"messages": [{"role": "user", "content": "\ud800hi"}]}, 400, "messages[0].content", "lone surrogate"),
    ("completions", {"prompt": "hi", "model": 5}, 400, "model", "must be a string"),
    ("completions", {"prompt": "hi", "stop": 5}, 400, "stop", "a string or a list"),
    ("completions", {"prompt": "hi", "stream": "yes"}, 400, "stream", "true or false"),
    ("completions", {"prompt": "hi", "n": "1"}, 400, "n", "must be 1"),
    ("completions", {"prompt": "hi", "user": 7}, 400, "user", "must be a string"),
    ("completions", {"prompt": "hi", "sparsedecode": {"kv": ["snapkv"], "kv_keep": 0.3}}, 400, "sparsedecode.kv",
     "snapkv"),
    ("chat", {"messages": "hi"}, 400, "messages", "non-empty list"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "max_completion_tokens": 3}, 400,
     "max_completion_tokens", "not both"),
    # OpenAI fields the server does not implement, at a value that asks for something
    ("completions", {"prompt": "hi", "logprobs": 2}, 400, "logprobs", "not supported.*null or false"),
    ("completions", {"prompt": "hi", "echo": True}, 400, "echo", "not supported"),
    ("completions", {"prompt": "hi", "best_of": 3}, 400, "best_of", "not supported.*null or 1"),
    ("completions", {"prompt": "hi", "logit_bias": {"50256": -100}}, 400, "logit_bias", "not supported"),
    ("completions", {"prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty", "null or 0"),
    ("completions", {"prompt": "hi", "frequency_penalty": -1}, 400, "frequency_penalty", "not supported"),
    ("completions", {"prompt": "hi", "suffix": " end"}, 400, "suffix", "not supported"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, 400, "logprobs", "not supported"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}}, 400,
     "response_format", "not supported"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function":
     {"name": "f"}}]}, 400, "tools", "not supported"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}, 400, "tool_choice", "none"),
    ("chat", {"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, 400, "messages[0].name",
     "only 'role' and 'content'"),
    ("completions", {"prompt": "hi", "top_k": 5}, 400, "top_k", "unknown field"),
    ("completions", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, 400, "messages",
     "belongs to /v1/chat/completions"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "prompt": "hi"}, 400, "prompt", "belongs to /v1/completions"),
]


@pytest.mark.parametrize("endpoint,body,status,param,pattern", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_gets_its_status_and_says_what_to_change(server, endpoint, body, status, param, pattern):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    raw = body if isinstance(body, str) else json.dumps(body)  # a lone surrogate goes as its \\u escape
    r = httpx.post(server["url"] + path, timeout=60, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["code"], str), err
    assert err["param"] == param and re.search(pattern, err["message"]), err
    assert metric(server, "sparsedecode_refused_total", endpoint=endpoint, status=status, reason=err["code"]) >= 1
    assert httpx.get(server["url"] + "/health").status_code == 200  # still serving


def test_openai_defaults_and_nulls_are_accepted(server):
    """A field the server does not implement, sent at its OpenAI default, and any field sent as
    null (as some clients do), asks for nothing: the answer is the one without them."""
    c = client(server)
    plain = c.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=5, temperature=0)
    r = c.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=5, temperature=0,
                             echo=False, best_of=1, logprobs=None, presence_penalty=0, frequency_penalty=0.0,
                             logit_bias={}, suffix=None, n=1, stop=None, top_p=None, seed=None, user="u1",
                             extra_body={"stream_options": None, "ignore_eos": None, "sparsedecode": None})
    assert r.choices[0].text == plain.choices[0].text
    body = {"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0, **dict.fromkeys(
        ["n", "stream", "top_p", "stop", "seed", "model", "user", "logprobs", "echo", "best_of", "logit_bias",
         "presence_penalty", "frequency_penalty", "suffix", "tools", "tool_choice", "top_k"])}
    r = httpx.post(server["url"] + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain.choices[0].text
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    plain = c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=8, temperature=0)
    r = c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=None, max_completion_tokens=8,
                                  temperature=0, logprobs=False, top_logprobs=None, response_format={"type": "text"},
                                  tools=[], tool_choice="none", parallel_tool_calls=True, n=None, presence_penalty=None)
    assert r.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="smollm2-135m", prompt="hi", max_tokens=2, logprobs=3)
    assert e.value.body["param"] == "logprobs" and e.value.body["code"] == "unsupported_parameter"


def test_a_client_that_goes_away_frees_the_engine(server):
    before = metric(server, "sparsedecode_cancelled_total")
    with httpx.stream("POST", server["url"] + "/v1/completions",
                      json={"prompt": "Count: 1, 2, 3,", "max_tokens": 800, "stream": True, "temperature": 0}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one chunk, then hang up
    t0 = time.monotonic()
    r = httpx.post(server["url"] + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=120)
    assert r.status_code == 200
    assert time.monotonic() - t0 < 30  # not behind 800 tokens of the abandoned answer
    assert metric(server, "sparsedecode_cancelled_total") == before + 1


def test_bounded_load_loses_nothing(server):
    from sparsedecode.serve.load import run_load

    rec = run_load(server["url"], clients=12, requests=2, max_tokens=4, timeout_s=300, pid=server["pid"])
    assert rec["ok"], rec
    assert rec["answered"] == 24 and set(rec["status_counts"]) <= {"200", "429"}
    assert rec["status_counts"].get("429", 0) > 0  # 12 clients against a queue of 6: some are refused
    assert rec["latency_s"]["p95"] >= rec["latency_s"]["p50"] > 0
    growth = rec["server_rss_mb"]["after"] - rec["server_rss_mb"]["before"]
    assert growth < 200, rec["server_rss_mb"]


def test_sigterm_drains_the_request_in_flight(tmp_path):
    require_embedded("smollm2-135m")
    proc = start(["--model", "smollm2-135m", "--max-len", "256"], tmp_path / "ready.json", tmp_path / "log")
    url = json.loads((tmp_path / "ready.json").read_text())["url"]
    out = {}

    def ask():
        out["r"] = httpx.post(url + "/v1/completions", json={"prompt": "Once", "max_tokens": 40, "temperature": 0},
                              timeout=120)

    t = threading.Thread(target=ask)
    t.start()
    t0 = time.monotonic()
    while httpx.get(url + "/health").json()["running"] == 0:  # SIGTERM once the request decodes
        assert time.monotonic() - t0 < 60 and t.is_alive(), "the request never started"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    t.join(120)
    assert proc.wait(60) in DRAINED
    assert out["r"].status_code == 200 and out["r"].json()["usage"]["completion_tokens"] == 40


def test_bad_options_fail_before_loading(capsys):
    r = run_cli(capsys, "serve", "--port", "70000")
    assert r.returncode == 2 and "--port must be >= 0 and <= 65,535, got 70000" in r.stderr
    r = run_cli(capsys, "serve", "--gate", "missing.json")
    assert r.returncode == 2 and "file not found" in r.stderr
    r = run_cli(capsys, "serve", "--attention", "sdpa_fused")
    assert r.returncode == 2 and "sdpa_fused" in r.stderr
    r = run_cli(capsys, "serve", "--drain-timeout", "-1")
    assert r.returncode == 2 and "--drain-timeout must be >= 0 and <= 3,600" in r.stderr


@pytest.mark.parametrize("args,pattern", [
    (["serve", "--max-queue", "10000000000"], "--max-queue must be >= 1 and <= 1,000,000"),
    (["serve", "--drain-timeout", "nan"], "--drain-timeout must be >= 0"),
    (["serve-load", "--clients", "100000"], "--clients must be >= 1 and <= 4,096"),
    (["serve-load", "--requests", "0"], "--requests must be >= 1"),
    (["serve-load", "--timeout", "inf"], "--timeout must be > 0"),
    (["serve-load", "--pid", "0"], "--pid must be >= 1"),
    (["serve-probe", "--request", "512:2", "--mode", "dense", "--seed", "-1"], "--seed must be >= 0"),
    (["serve-probe", "--request", "512:2", "--mode", "dense", "--vocab", "0"], "--vocab must be >= 1"),
    (["serve-probe", "--request", "2000000000:2000000000", "--mode", "dense"], "past any model's window"),
])
def test_numeric_options_out_of_range_exit_2_naming_the_flag(capsys, args, pattern):
    """Hardening (issue 48): a count, a time or a seed out of range is refused while the command
    line is read, never taken into a thread pool, a sleep or a generator."""
    r = run_cli(capsys, *args)
    assert r.returncode == 2 and pattern in r.stderr and "Traceback" not in r.stderr


def test_a_random_init_model_answers_token_ids_under_its_one_configuration(tmp_path):
    """What the H200 run serves (paper dims, random weights): token-id prompts only, one static
    configuration (here sel0.5) that a too-short prompt cannot select from."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(model_type="llama", hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, vocab_size=100,
                                   max_position_embeddings=512, rope_theta=10000.0, eos_token_id=None)))
    proc = start(["--model", str(cfg), "--init", "random", "--max-len", "512", "--kv", "snapkv", "--kv-keep", "0.5"],
                 tmp_path / "ready.json", tmp_path / "log")
    try:
        info = json.loads((tmp_path / "ready.json").read_text())
        assert info["configurations"] == ["sel0.5"] and info["default"] == "sel0.5"
        url = info["url"] + "/v1/completions"
        r = httpx.post(url, json={"prompt": list(range(1, 99)) * 3, "max_tokens": 5, "temperature": 0}, timeout=60)
        body = r.json()
        assert r.status_code == 200 and len(body["choices"][0]["token_ids"]) == 5 and body["choices"][0]["text"] == ""
        assert body["sparsedecode"]["mode"] == "sel0.5" and body["sparsedecode"]["kv_select_ms"] > 0
        r = httpx.post(url, json={"prompt": "hello"}, timeout=60)
        assert r.status_code == 400 and "list of token ids" in r.json()["error"]["message"]
        r = httpx.post(url, json={"prompt": [1, 2, 3, 4, 5], "max_tokens": 3}, timeout=60)
        assert r.status_code == 400 and "cannot hold" in r.json()["error"]["message"]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) in DRAINED


PROMPT_IDS = [(7 * i) % 1000 + 20 for i in range(300)]  # 300 token ids: keep 0.5 selects from them


@pytest.mark.parametrize("flags", [
    [],
    ["--proj-keep", "0.5"],
    ["--kv", "snapkv", "--kv-keep", "0.5"],
    ["--kv", "window", "--kv-keep", "0.5"],
    ["--proj-keep", "0.5", "--kv", "snapkv", "--kv-keep", "0.5"],
    ["--proj-keep", "0.5", "--kv", "window", "--kv-keep", "0.5"],
], ids=lambda f: "+".join(f[1::2]) or "dense")
def test_every_listed_configuration_can_be_asked_for_by_name(tmp_path, flags):
    """Issue 43: whatever options a server starts with, the names it lists parse back into the
    configuration it runs, and a request naming one (through the openai client) is served by it."""
    from sparsedecode.config import SparsityConfig

    require_embedded("smollm2-135m")
    proc = start(["--model", "smollm2-135m", "--max-len", "512", *flags], tmp_path / "ready.json", tmp_path / "log")
    try:
        info = json.loads((tmp_path / "ready.json").read_text())
        names = info["configurations"]
        assert len(names) == 1 and info["default"] == names[0]
        assert str(SparsityConfig.parse(names[0])) == names[0]
        c = openai.OpenAI(base_url=info["url"] + "/v1", api_key="none", max_retries=0)
        r = c.completions.create(model="smollm2-135m", prompt=PROMPT_IDS, max_tokens=3, temperature=0,
                                 extra_body={"sparsedecode": {"mode": names[0]}})
        assert r.model_extra["sparsedecode"]["mode"] == names[0] and r.choices[0].finish_reason == "length"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) in DRAINED
