"""The real `Server` and its uvicorn shutdown around a fake engine whose every decode step takes
STEP_S seconds and whose tokenizer takes SLOW_TOKENIZE_S on a prompt starting with "slow:", so
tests can hold a request in flight, in the queue or in the tokenizer as long as they need.

    python fake_server.py PORT_FILE DRAIN_TIMEOUT_S MAX_QUEUE MAX_PROMPT_CHARS

binds a free port, writes it to PORT_FILE and serves until SIGTERM/SIGINT (then drains).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from types import SimpleNamespace

from sparsedecode.serve.configs import Plan
from sparsedecode.serve.protocol import RequestError

STEP_S = 0.1
SLOW_TOKENIZE_S = 3.0
VOCAB = 1000


class Tokenizer:
    chat_template = "fake: the contents, joined"

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        if text.startswith("slow:"):
            time.sleep(SLOW_TOKENIZE_S)
        return {"input_ids": [ord(c) % VOCAB for c in text]}

    def apply_chat_template(self, messages, add_generation_prompt: bool, tokenize: bool) -> str:
        return "\n".join(m["content"] for m in messages)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


class Engine:
    name, device, max_len = "fake", "cpu", 4096
    dims = SimpleNamespace(vocab=VOCAB)
    args = SimpleNamespace(max_position=4096)
    tokenizer = Tokenizer()

    def tokens(self, ids, max_new, *, temperature, top_p, seed, stop_ids, timing):
        t0 = time.perf_counter()
        for i in range(max_new):
            time.sleep(STEP_S)
            timing.decode_s = time.perf_counter() - t0
            yield i % 26


class Configs:
    specs, default = ["dense"], "dense"

    def plan(self, asked: str, prompt_tokens: int, max_new: int) -> Plan:
        if asked not in ("auto", "dense"):
            raise RequestError(f"configuration {asked} was not warmed up by this server", "sparsedecode.mode")
        return Plan("dense")

    def install(self, spec: str) -> None:
        pass

    def warm(self, progress=None) -> dict[str, float]:
        return {"dense": 0.0}


def main(port_file: str, drain_timeout_s: str, max_queue: str, max_prompt_chars: str) -> None:
    import sparsedecode.engine.engine  # noqa: F401 - what the worker imports on its first request (torch)
    from sparsedecode.serve.app import Server

    server = Server(Engine(), Configs(), max_queue=int(max_queue), max_prompt_chars=int(max_prompt_chars))
    server.worker.start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    with open(port_file + ".tmp", "w") as f:
        f.write(str(sock.getsockname()[1]))
    os.replace(port_file + ".tmp", port_file)
    server.uvicorn(float(drain_timeout_s)).run(sockets=[sock])


if __name__ == "__main__":
    main(*sys.argv[1:])
