"""The HTTP app: OpenAI completions and chat completions (streamed or not), models, health, metrics.

`Server(engine, configs, max_queue)` owns the worker; `server.app` is the FastAPI app that
`uvicorn` runs. Handlers validate and tokenize on the event loop, queue the job and relay its
events; they never touch the engine.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sparsedecode.serve.configs import Configurations
from sparsedecode.serve.metrics import Metrics
from sparsedecode.serve.protocol import Params, RequestError, chunk, new_id, parse, response, usage
from sparsedecode.serve.worker import Job, Worker

DEFAULT_CHAT_TOKENS = 512  # a chat answer without max_tokens: at most this, or the rest of the cache
DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed handler checks for its client


class Server:
    def __init__(self, engine, configs: Configurations, *, max_queue: int = 64):
        self.engine, self.configs = engine, configs
        self.metrics = Metrics()
        self.worker = Worker(engine, configs, self.metrics, max_queue)
        self.started = int(time.time())
        self.app = self._build()

    # -- requests --------------------------------------------------------------------------
    def _ids(self, p: Params) -> list[int]:
        eng, tok = self.engine, self.engine.tokenizer
        if isinstance(p.prompt, list) and not p.chat:
            bad = [t for t in p.prompt if t >= eng.dims.vocab]
            if bad:
                raise RequestError(f"token id {bad[0]} is outside the vocabulary of {eng.dims.vocab}", "prompt")
            return list(p.prompt)
        if tok is None:
            raise RequestError(f"'{eng.name}' has no tokenizer here: send 'prompt' as a list of token ids"
                               + (" to /v1/completions" if p.chat else ""), "messages" if p.chat else "prompt")
        if not p.chat:
            return tok(p.prompt)["input_ids"]
        if not getattr(tok, "chat_template", None):
            raise RequestError(f"'{eng.name}' has no chat template: use /v1/completions", "messages")
        text = tok.apply_chat_template(p.prompt, add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]

    def _check_len(self, p: Params, n: int) -> None:
        cap = self.engine.max_len
        if p.max_tokens is None:
            p.max_tokens = max(min(DEFAULT_CHAT_TOKENS, cap - n), 1)
        if n + p.max_tokens > cap:
            field = "max_tokens" if n < cap else ("messages" if p.chat else "prompt")
            raise RequestError(
                f"the prompt ({n} tokens) plus max_tokens ({p.max_tokens}) is more than this server's cache of "
                f"{cap} tokens (model window {self.engine.args.max_position}); shorten the prompt or lower "
                "max_tokens, or start the server with a larger --max-len", field)

    async def _next(self, job: Job, request: Request):
        """The job's next event; cancels the job if the client disconnects meanwhile."""
        while True:
            try:
                return await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancelled.set()
                    raise asyncio.CancelledError from None

    async def _handle(self, request: Request, chat: bool):
        endpoint = "chat" if chat else "completions"
        count = self.metrics.requests
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise RequestError("the request body is not JSON: send a JSON object with "
                                   + ("'messages'" if chat else "'prompt'")) from None
            p = parse(body, chat=chat, model=self.engine.name)
            ids = self._ids(p)
            self._check_len(p, len(ids))
            plan = self.configs.plan(p.sparsity, len(ids), p.max_tokens)
            job = Job(p, ids, plan, asyncio.get_running_loop())
            self.worker.submit(job)
            rid = new_id(chat)
            first = await self._next(job, request)
            if first[0] == "error":
                raise first[1]
        except RequestError as e:
            count.labels(endpoint, str(e.status)).inc()
            return JSONResponse(e.body(), status_code=e.status)
        count.labels(endpoint, "200").inc()
        if p.stream:
            return StreamingResponse(self._stream(job, request, rid, first), media_type="text/event-stream")
        parts, event = [], first
        while event[0] == "delta":
            parts.append(event[1])
            event = await self._next(job, request)
        if event[0] == "error":  # after the first token: an engine failure mid-answer
            e = event[1]
            return JSONResponse(e.body(), status_code=e.status)
        done = event[1]
        text = done["text"] if done["text"] is not None else ""
        body = response(p, rid, text, done["finish"], usage(len(ids), len(done["ids"])), done["sparsedecode"])
        if done["text"] is None:
            body["choices"][0]["token_ids"] = done["ids"]
        return JSONResponse(body)

    async def _stream(self, job: Job, request: Request, rid: str, event):
        p, head = job.params, True
        try:
            while event[0] == "delta":
                yield _sse(chunk(p, rid, event[1], first=head))
                head = False
                event = await self._next(job, request)
            if event[0] == "error":
                yield _sse(event[1].body())
                return
            done = event[1]
            if head and p.chat:
                yield _sse(chunk(p, rid, "", first=True))
            last = chunk(p, rid, None, done["finish"], usage(len(job.ids), len(done["ids"])), done["sparsedecode"])
            if done["text"] is None:
                last["choices"][0]["token_ids"] = done["ids"]
            yield _sse(last)
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled.set()  # a no-op once done; stops the engine if the client went away

    # -- the app ---------------------------------------------------------------------------
    def _build(self) -> FastAPI:
        app = FastAPI(title="sparsedecode", lifespan=self._lifespan)
        eng = self.engine

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._handle(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await self._handle(request, chat=True)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": eng.name, "object": "model", "created": self.started,
                                                "owned_by": "sparsedecode"}]}

        @app.get("/health")
        async def health():
            return {"status": "ok", "model": eng.name, "device": str(eng.device),
                    "configurations": self.configs.specs, "default": self.configs.default,
                    "queue": self.worker.waiting, "running": self.worker.running, "max_len": eng.max_len}

        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        return app

    def _lifespan(self, app):
        server = self

        class Life:
            async def __aenter__(self):
                return None

            async def __aexit__(self, *exc):
                await asyncio.get_running_loop().run_in_executor(None, server.worker.stop)

        return Life()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
