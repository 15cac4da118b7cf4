"""The server's shutdown, queue, hang-ups and large requests through real HTTP on loopback,
around a fake engine (fake_server.py: 0.1 s per decode step, a 3 s tokenizer on "slow:"
prompts), so answers can outlast uvicorn's grace period without a model."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
DRAINED = (0, -signal.SIGTERM)  # uvicorn re-raises the signal it caught
MAX_PROMPT_CHARS = 2000
STEP_S, SLOW_TOKENIZE_S = 0.1, 3.0  # as in fake_server.py


class Fake:
    """A fake-engine server process: its url, and what it wrote."""

    def __init__(self, tmp: Path, drain_s: float = 1.0, max_queue: int = 2):
        port_file, self.log = tmp / "port", tmp / "server.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(SRC)}
        self.proc = subprocess.Popen([sys.executable, str(HERE / "fake_server.py"), str(port_file), str(drain_s),
                                      str(max_queue), str(MAX_PROMPT_CHARS)], stdout=self.log.open("w"),
                                     stderr=subprocess.STDOUT, env=env)
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None or time.monotonic() - t0 > 120:
                self.proc.kill()
                pytest.fail(f"the fake server did not start:\n{self.log.read_text()[-3000:]}")
            if port_file.is_file():
                self.port = int(port_file.read_text())
                self.url = f"http://127.0.0.1:{self.port}"
                try:
                    if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def wait_for(self, running: int, queue: int, timeout: float = 20) -> None:
        t0 = time.monotonic()
        while (h := self.health())["running"] != running or h["queue"] != queue:
            assert time.monotonic() - t0 < timeout, h
            time.sleep(0.02)

    def metric(self, name: str, **labels) -> float:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # as exposed: sorted
        m = re.search(rf"^{name}(?:\{{{re.escape(want)}\}})? (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


def post(url: str, body: dict, out: dict, key: str, path: str = "/v1/completions", **kw) -> threading.Thread:
    """POST in a thread; out[key] = (status, JSON body or SSE lines, seconds), or the exception."""

    def run():
        t0 = time.monotonic()
        try:
            if body.get("stream"):
                with httpx.stream("POST", url + path, json=body, timeout=60) as r:
                    out[key] = (r.status_code, [ln for ln in r.iter_lines() if ln], time.monotonic() - t0)
            else:
                r = httpx.post(url + path, json=body, timeout=kw.get("timeout", 60))
                out[key] = (r.status_code, r.json(), time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - the test reads it
            out[key] = e

    t = threading.Thread(target=run)
    t.start()
    return t


def shutting_down(body: dict) -> bool:
    err = body["error"]
    return err["code"] == "shutting_down" and err["type"] == "server_error" and "shutting down" in err["message"]


def test_sigterm_refuses_what_waits_and_stops_an_answer_longer_than_the_grace_period(tmp_path):
    """Drain 3 s, so uvicorn's grace is 8 s; the running answer would take 15 s. Nothing is cut off
    with a 500: the queued, the uploading and the tokenizing requests get 503 at once, the running
    one a 503 once the drain is up, and the process exits before the grace period ends."""
    fake = Fake(tmp_path, drain_s=3.0, max_queue=4)
    try:
        out = {}
        threads = [post(fake.url, {"prompt": "long", "max_tokens": 150}, out, "running")]
        fake.wait_for(running=1, queue=0)
        threads.append(post(fake.url, {"prompt": "queued", "max_tokens": 3}, out, "queued"))
        fake.wait_for(running=1, queue=1)
        threads.append(post(fake.url, {"prompt": "slow: tokenizing", "max_tokens": 3}, out, "tokenizing"))
        upload = socket.create_connection(("127.0.0.1", fake.port))  # headers and half its body
        upload.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 100\r\n\r\n{\"prompt\": \"up")
        time.sleep(0.5)
        t0 = time.monotonic()
        fake.proc.send_signal(signal.SIGTERM)
        upload.settimeout(10)
        reply = b""
        while part := upload.recv(65536):  # headers and body may come apart; the server then closes
            reply += part
            waited = time.monotonic() - t0
        reply = reply.decode()
        code = fake.proc.wait(30)
        exit_s = time.monotonic() - t0
        for t in threads:
            t.join(30)
    finally:
        fake.stop()
    log = fake.log.read_text()
    assert code in DRAINED, log
    assert exit_s < 3.0 + 5.0 and "timeout graceful shutdown exceeded" not in log and "Traceback" not in log, log
    assert reply.startswith("HTTP/1.1 503") and waited < 2.0, (reply, waited)
    assert shutting_down(json.loads(reply.split("\r\n\r\n", 1)[1]))
    for key in ("queued", "tokenizing"):
        status, body, _ = out[key]
        assert status == 503 and shutting_down(body), (key, body, log)
        assert "did not start" in body["error"]["message"]
    assert out["tokenizing"][2] < SLOW_TOKENIZE_S, out  # refused, not waited for
    status, body, _ = out["running"]
    assert status == 503 and shutting_down(body) and "drain time (3 s" in body["error"]["message"]


def _answer_through_sigterm(tmp_path, drain_s: float, body: dict):
    """(status, body or stream lines, ...) of one request to a fake server sent SIGTERM while the
    request runs; the server must exit as drained."""
    fake, out = Fake(tmp_path, drain_s=drain_s), {}
    try:
        t = post(fake.url, body, out, "answer")
        fake.wait_for(running=1, queue=0)
        fake.proc.send_signal(signal.SIGTERM)
        t.join(30)
        assert fake.proc.wait(30) in DRAINED
    finally:
        fake.stop()
    return out["answer"]


def test_sigterm_lets_a_short_answer_finish_and_ends_a_long_stream_with_an_error_event(tmp_path):
    status, body, _ = _answer_through_sigterm(tmp_path, 3.0, {"prompt": "short", "max_tokens": 15})  # 1.5 s
    assert status == 200 and body["usage"]["completion_tokens"] == 15 and body["choices"][0]["text"]

    status, lines, _ = _answer_through_sigterm(tmp_path, 1.0, {"prompt": "stream", "max_tokens": 150,
                                                               "stream": True})
    chunks = [json.loads(ln.removeprefix("data: ")) for ln in lines]
    assert status == 200 and len(chunks) > 3 and chunks[0]["choices"][0]["text"]
    assert shutting_down(chunks[-1]) and "data: [DONE]" not in lines


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    server = Fake(tmp_path_factory.mktemp("fake"), drain_s=1.0, max_queue=1)
    yield server
    assert server.stop() in DRAINED, server.log.read_text()[-3000:]


def test_a_full_queue_gets_a_429_in_json(fake):
    out = {}
    running = post(fake.url, {"prompt": "a", "max_tokens": 20}, out, "running")
    fake.wait_for(running=1, queue=0)
    queued = post(fake.url, {"prompt": "b", "max_tokens": 2}, out, "queued")
    fake.wait_for(running=1, queue=1)
    before = fake.metric("sparsedecode_refused_total", endpoint="completions", status="429", reason="queue_full")
    c = openai.OpenAI(base_url=fake.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model="fake", prompt="c", max_tokens=2)
    assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
    assert "queue is full (1 requests waiting)" in e.value.body["message"]
    assert fake.metric("sparsedecode_refused_total", endpoint="completions", status="429",
                       reason="queue_full") == before + 1
    running.join(30)
    queued.join(30)
    assert out["running"][0] == out["queued"][0] == 200


def test_a_client_that_hangs_up_frees_the_engine(fake):
    """A non-streamed answer of 10 s whose client gives up after 1 s is stopped, not finished for
    nobody; the next request is answered at once."""
    before = fake.metric("sparsedecode_cancelled_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(fake.url + "/v1/completions", json={"prompt": "a", "max_tokens": 100}, timeout=1.0)
    t0 = time.monotonic()
    r = httpx.post(fake.url + "/v1/completions", json={"prompt": "b", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and time.monotonic() - t0 < 3.0
    assert fake.metric("sparsedecode_cancelled_total") == before + 1


def test_a_slow_tokenization_stalls_neither_health_nor_other_requests(fake):
    out = {}
    slow = post(fake.url, {"prompt": "slow: a long prompt", "max_tokens": 2}, out, "slow")
    time.sleep(0.3)  # it is tokenizing now
    t0 = time.monotonic()
    assert fake.health()["status"] == "ok" and time.monotonic() - t0 < 0.5
    r = httpx.post(fake.url + "/v1/completions", json={"prompt": "quick", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and time.monotonic() - t0 < SLOW_TOKENIZE_S - 1
    assert "slow" not in out  # still tokenizing
    slow.join(30)
    assert out["slow"][0] == 200


@pytest.mark.parametrize("chat", [False, True])
def test_a_prompt_past_the_character_bound_is_refused_before_tokenizing(fake, chat):
    text = "slow:" + "x" * MAX_PROMPT_CHARS  # tokenizing it would take 3 s
    body = ({"messages": [{"role": "user", "content": "slow:"}, {"role": "user", "content": text}]} if chat else
            {"prompt": text})
    t0 = time.monotonic()
    r = httpx.post(fake.url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and time.monotonic() - t0 < 1.5
    assert err["param"] == ("messages" if chat else "prompt") and err["code"] == "context_length_exceeded"
    assert f"more than this server takes ({MAX_PROMPT_CHARS}" in err["message"] and "--max-len" in err["message"]


def test_an_oversized_body_gets_413_whether_its_length_is_declared_or_not(fake):
    limit = fake.health()["max_body_bytes"]
    big = json.dumps({"prompt": "x" * limit}).encode()
    before = fake.metric("sparsedecode_refused_total", endpoint="completions", status="413", reason="request_too_large")
    r = httpx.post(fake.url + "/v1/completions", content=big, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and f"({limit} bytes" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 1 << 16):
            yield big[i:i + (1 << 16)]

    r = httpx.post(fake.url + "/v1/completions", content=chunked(), headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert fake.metric("sparsedecode_refused_total", endpoint="completions", status="413",
                       reason="request_too_large") == before + 2


@pytest.mark.parametrize("ctype,status", [("text/plain", 415), ("application/x-www-form-urlencoded", 415),
                                          ("application/json; charset=utf-8", 200), (None, 200)])
def test_a_body_that_says_it_is_not_json_gets_415(fake, ctype, status):
    """curl -d sends form encoding unless told; a missing Content-Type is read as JSON (as FastAPI does)."""
    headers = {} if ctype is None else {"content-type": ctype}
    r = httpx.post(fake.url + "/v1/completions", content=b'{"prompt": "hi", "max_tokens": 1}', headers=headers,
                   timeout=30)
    assert r.status_code == status, r.text
    if status == 415:
        err = r.json()["error"]
        assert err["code"] == "unsupported_media_type" and "application/json" in err["message"]


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405),
                                                ("DELETE", "/health", 405)])
def test_wrong_paths_and_methods_answer_in_openai_json(fake, method, path, status):
    r = httpx.request(method, fake.url + path, timeout=30)
    assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}
