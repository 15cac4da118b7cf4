"""`sparsedecode serve --batch 4` through real clients (issue 44, ByteCross App. F): concurrent
requests decode in one batch and each gets what batch-1 decoding gives it, a long prompt is
prefilled between steps, stop strings and streaming work per request, a request past the slots
waits for one, every request ends, and the metrics say how full the batch ran."""

from __future__ import annotations

import json
import re
import signal
import threading
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import require_embedded, run_cli  # noqa: E402
from serve.test_server import DRAINED, LONG, NoCapture, gate_file, start  # noqa: E402

HEADS = ["Notes:", "def add(a, b):", "Water boils at", "Once upon a time", "1, 2, 3,"]
PROMPTS = [f"{h} {LONG[:k]}" for h, k in zip(HEADS, (900, 1100, 1300, 1500, 1800), strict=True)]  # all can select


@pytest.fixture
def one_selected(embedded_engine):
    """The batch-1 engine under the server's configuration (SnapKV at keep 0.5)."""
    one = embedded_engine("smollm2-135m")
    one.configure("sel0.5")
    yield one
    one.configure("dense")


@pytest.fixture(scope="module")
def batch_server(tmp_path_factory):
    require_embedded("smollm2-135m")
    tmp = tmp_path_factory.mktemp("serve_batch")
    ready, log = tmp / "ready.json", tmp / "server.log"
    proc = start(["--model", "smollm2-135m", "--batch", "4", "--kv", "snapkv", "--kv-keep", "0.5",
                  "--max-len", "1024", "--dtype", "float32"], ready, log)
    info = json.loads(ready.read_text())
    yield {"url": info["url"], "pid": proc.pid, "log": log}
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) in DRAINED, log.read_text()[-3000:]


def _complete(url, prompt, n, **kw):
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0, **kw},
                   timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_concurrent_requests_decode_together_as_batch_1_would(batch_server, one_selected):
    url = batch_server["url"]
    out = [None] * len(PROMPTS)

    def ask(i):
        out[i] = _complete(url, PROMPTS[i], 12)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]  # 5 requests, 4 slots
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for body, p in zip(out, PROMPTS, strict=True):
        assert body["choices"][0]["text"] == one_selected.generate(p, 12).text
        assert body["sparsedecode"]["batch"] == 4 and body["sparsedecode"]["kv_select_ms"] > 0
    m = httpx.get(url + "/metrics").text
    assert "sparsedecode_batch_occupancy" in m
    waited = re.search(r"^sparsedecode_queue_wait_seconds_count (\S+)", m, re.M)
    assert waited and float(waited.group(1)) >= len(PROMPTS)


def test_streaming_with_a_stop_string_beside_another_request(batch_server, one_selected):
    url = batch_server["url"]
    want = one_selected.generate(PROMPTS[4], 30).text
    stop = want.split()[3]  # a word the answer reaches: the stream ends before it
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    res = {}
    t = threading.Thread(target=lambda: res.setdefault("other", _complete(url, PROMPTS[3], 8)))
    t.start()
    chunks = list(c.completions.create(model="smollm2-135m", prompt=PROMPTS[4], max_tokens=30, temperature=0,
                                       stream=True, stop=[stop]))
    t.join()
    text = "".join(ch.choices[0].text for ch in chunks)
    assert text == want[:want.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert res["other"]["choices"][0]["text"] == one_selected.generate(PROMPTS[3], 8).text


def test_health_says_the_batch(batch_server):
    h = httpx.get(batch_server["url"] + "/health").json()
    assert h["batch"] == 4 and h["running"] == 0


def batch_gate(tmp, capsys, batch: int) -> Path:
    """A gate table of `batch` (synthetic prices): the committed CPU cells' dense curve as the batch's
    step, sel0.3 at half of it (its selection 0.05 s at 32K), proj0.5 and both0.5/0.3 at twice
    those, so the batch's projection is dense and each request takes sel0.3 where its prompt can
    select and dense where it cannot."""
    table = json.loads(gate_file(tmp, capsys).read_text())
    table["batch"] = batch
    dense = table["configs"]["dense"]["curve"]
    table["configs"]["sel0.3"]["curve"] = {**dense, "ms": [x / 2 for x in dense["ms"]]}
    table["configs"]["sel0.3"]["select"] = {"kind": "per_token", "seconds_at_32k": 0.05}
    for proj, base in (("proj0.5", "dense"), ("both0.5/0.3", "sel0.3")):
        c = json.loads(json.dumps(table["configs"][base]))
        c["curve"]["ms"] = [2 * x for x in c["curve"]["ms"]]
        table["configs"][proj] = c
        table["admissibility"][proj] = {"admitted": True}
    out = tmp / f"gate_b{batch}.json"
    out.write_text(json.dumps(table))
    return out


@pytest.fixture(scope="module")
def gated_batch_server(tmp_path_factory):
    require_embedded("smollm2-135m")
    tmp = tmp_path_factory.mktemp("serve_batch_gate")
    ready, log = tmp / "ready.json", tmp / "server.log"
    proc = start(["--model", "smollm2-135m", "--batch", "4", "--gate", str(batch_gate(tmp, NoCapture(), 4)),
                  "--max-len", "1024"], ready, log)
    info = json.loads(ready.read_text())
    yield {"url": info["url"], "log": log}
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) in DRAINED, log.read_text()[-3000:]


def test_a_gated_batch_chooses_its_projection_once_and_each_request_its_selection(gated_batch_server):
    url = gated_batch_server["url"]
    h = httpx.get(url + "/health").json()
    assert h["batch"] == 4 and h["batch_projection"] == "dense" and h["configurations"] == ["dense", "sel0.3"]
    out = {}
    jobs = {"short": ("Water boils at", 6), "long": (PROMPTS[4], 6)}
    threads = [threading.Thread(target=lambda k=k, p=p: out.setdefault(k, _complete(url, p[0], p[1])))
               for k, p in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    short, long = out["short"]["sparsedecode"], out["long"]["sparsedecode"]
    assert short["mode"] == "dense" and short["kv_select_ms"] == 0 and short["batch"] == 4
    assert long["mode"] == "sel0.3" and long["kv_select_ms"] > 0 and long["predicted_ms_per_token"] > 0


def test_a_gate_of_another_batch_size_is_refused(capsys, tmp_path):
    require_embedded("smollm2-135m")
    gate = batch_gate(tmp_path, capsys, 1)
    r = run_cli(capsys, "serve", "--batch", "2", "--gate", str(gate), "--port", "0")
    assert r.returncode == 2 and "prices steps of 1 sequence(s) and the engine decodes 2" in r.stderr
    r = run_cli(capsys, "serve", "--batch", "0")
    assert r.returncode == 2 and "--batch" in r.stderr


def test_serve_load_and_serve_probe_run_against_a_batch(batch_server, capsys):
    url = batch_server["url"]
    r = run_cli(capsys, "serve-load", "--url", url, "--clients", "6", "--requests", "1", "--max-tokens", "4",
                "--prompt", PROMPTS[0], "--pid", str(batch_server["pid"]), "--json")  # a prompt sel0.5 can select from
    assert r.returncode == 0, r.stderr
    load = json.loads(r.stdout)
    assert load["ok"] and load["status_counts"] == {"200": 6}
    r = run_cli(capsys, "serve-probe", "--url", url, "--request", "600:4", "--mode", "sel0.5", "--json")
    assert r.returncode == 0, r.stderr
    probe = json.loads(r.stdout)
    row = probe["rows"][0]
    assert probe["server"]["batch"] == 4 and row["status"] == 200
    assert row["mode"] == "sel0.5" and row["ms_per_token"] > 0 and row["kv_select_ms"] > 0
