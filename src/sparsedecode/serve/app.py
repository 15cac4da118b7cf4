"""The HTTP app: OpenAI completions and chat completions (streamed or not), models, health, metrics.

`Server(engine, configs, max_queue)` owns the worker; `server.app` is the FastAPI app and
`server.uvicorn(drain_timeout_s)` the uvicorn server that runs it. Handlers read the body
(bounded: 413 past `max_body` bytes), then parse, validate and tokenize it on a thread of
their own, so neither a large prompt nor a large body stalls the event loop (`/health` and the
other requests' streams); a prompt is bounded by characters before it is tokenized. They queue
the job and relay its events; they never touch the engine. Every refusal is a JSON body in
OpenAI's error shape, counted in `/metrics` by status and reason.

Shutdown (SIGINT/SIGTERM) drains: uvicorn stops accepting connections and calls `drain`, which
refuses with a 503 `shutting_down` every request not yet running (queued, uploading its body
or being tokenized), lets the running one finish, and stops it with a 503 if it outlasts the
drain time. uvicorn waits `drain + GRACE_MARGIN_S` for the handlers, so none is cut off.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from sparsedecode.errors import InputError
from sparsedecode.serve.configs import Configurations
from sparsedecode.serve.metrics import Metrics
from sparsedecode.serve.protocol import (
    Params,
    RequestError,
    chunk,
    load_json,
    new_id,
    parse,
    response,
    usage,
)
from sparsedecode.serve.worker import Job, Worker

log = logging.getLogger("sparsedecode.serve")

DEFAULT_CHAT_TOKENS = 512  # a chat answer without max_tokens: at most this, or the rest of the cache
CLIENT_GONE = 499  # the status (nginx's) of an answer whose client disconnected: nobody reads it
DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed handler checks for its client
PROMPT_CHARS_PER_TOKEN = 32  # a prompt's character bound per cache token (English runs ~4; runs of spaces ~60)
BODY_BYTES_PER_CHAR = 12  # a JSON body's bytes per prompt character at most (an escaped pair \ud83d\ude00)
BODY_SLACK = 1 << 20  # bytes beside the prompt: the other fields, a token-id list's punctuation
PREPARE_THREADS = 4  # requests parsed and tokenized at once, off the event loop
DRAIN_TIMEOUT_S = 25.0  # how long a shutdown lets the running answer go on
GRACE_MARGIN_S = 5.0  # uvicorn's grace beyond the drain: the stopped handler's answer, the thread's join


class Server:
    def __init__(self, engine, configs: Configurations, *, max_queue: int = 64, max_prompt_chars: int | None = None):
        self.engine, self.configs = engine, configs
        self.metrics = Metrics()
        if getattr(engine, "batch", 1) > 1:  # continuous batching (serve/batch_worker.py)
            from sparsedecode.serve.batch_worker import BatchWorker

            self.worker = BatchWorker(engine, configs, self.metrics, max_queue)
        else:
            self.worker = Worker(engine, configs, self.metrics, max_queue)
        self.started = int(time.time())
        self.max_prompt_chars = max_prompt_chars or PROMPT_CHARS_PER_TOKEN * engine.max_len
        self.max_body = BODY_BYTES_PER_CHAR * self.max_prompt_chars + BODY_SLACK
        # a few threads, so one long prompt delays no other; they share the tokenizer only to read
        # it (no padding or truncation is set, the one change a fast tokenizer refuses mid-encode)
        self._prepare_pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="sparsedecode-prepare")
        self.draining = False
        self._drained = asyncio.Event()
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
        try:
            text = tok.apply_chat_template(p.prompt, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # a template may refuse an order of roles (jinja raises)
            raise RequestError(f"the model's chat template refused these messages ({type(e).__name__}: {e})"[:500],
                               "messages") from None
        return tok(text, add_special_tokens=False)["input_ids"]

    def _check_chars(self, p: Params) -> None:
        """Bound a text prompt by characters, before it costs a tokenization."""
        if isinstance(p.prompt, str):
            n = len(p.prompt)
        elif p.chat:
            n = sum(len(m["content"]) for m in p.prompt)
        else:
            return  # token ids: the cache bounds them
        if n > self.max_prompt_chars:
            raise RequestError(
                f"the prompt has {n} characters, more than this server takes ({self.max_prompt_chars}: "
                f"{PROMPT_CHARS_PER_TOKEN} per token of its {self.engine.max_len}-token cache); shorten it, or start "
                "the server with a larger --max-len", "messages" if p.chat else "prompt",
                code="context_length_exceeded")

    def _check_len(self, p: Params, n: int) -> None:
        cap = self.engine.max_len
        if p.max_tokens is None:
            p.max_tokens = max(min(DEFAULT_CHAT_TOKENS, cap - n), 1)
        if n + p.max_tokens > cap:
            field = "max_tokens" if n < cap else ("messages" if p.chat else "prompt")
            raise RequestError(
                f"the prompt ({n} tokens) plus max_tokens ({p.max_tokens}) is more than this server's cache of "
                f"{cap} tokens (model window {self.engine.args.max_position}); shorten the prompt or lower "
                "max_tokens, or start the server with a larger --max-len", field, code="context_length_exceeded")

    def _prepare(self, raw: bytes, chat: bool) -> tuple[Params, list[int]]:
        """Parse, validate and tokenize a body (on the prepare thread, off the event loop)."""
        p = parse(load_json(raw, "'messages'" if chat else "'prompt'"), chat=chat, model=self.engine.name)
        self._check_chars(p)
        ids = self._ids(p)
        self._check_len(p, len(ids))
        return p, ids

    async def _body(self, request: Request) -> bytes:
        """The request body, refused with a 415 unless JSON and a 413 past `max_body` bytes."""
        ctype = request.headers.get("content-type")
        media = None if ctype is None else ctype.split(";")[0].strip().lower()
        if media is not None and media != "application/json" and not media.endswith("+json"):
            raise RequestError(f"the body must be JSON (Content-Type: application/json), got Content-Type "
                               f"{ctype[:100]!r}", status=415, kind="invalid_request_error")
        too_large = RequestError(f"the request body is larger than this server takes ({self.max_body} bytes, for "
                                 f"a prompt of at most {self.max_prompt_chars} characters); shorten the prompt",
                                 status=413)
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body:
            raise too_large
        parts, size = [], 0
        try:
            async for part in request.stream():
                size += len(part)
                if size > self.max_body:
                    raise too_large
                parts.append(part)
        except ClientDisconnect:
            raise RequestError("the client closed the connection before the body ended",
                               code="incomplete_body") from None
        return b"".join(parts)

    async def _unless_draining(self, awaitable):
        """`awaitable`'s result, or a 503 as soon as shutdown begins (a body still uploading or a
        prompt still tokenizing is refused, not waited for)."""
        work, stop = asyncio.ensure_future(awaitable), asyncio.ensure_future(self._drained.wait())
        try:
            await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not work.done():
            work.cancel()
            raise self._shutting_down()
        return work.result()

    def _shutting_down(self) -> RequestError:
        return RequestError("the server is shutting down and did not start this request; send it again to a "
                            "running server", status=503, kind="server_error", code="shutting_down")

    async def _next(self, job: Job, request: Request):
        """The job's next event, or ("gone", None) once the client disconnected (the job is then
        cancelled). The client is asked every DISCONNECT_POLL_S whether events come or not: an
        answer whose tokens keep coming must still stop when nobody reads it."""
        while True:
            if time.monotonic() - job.client_seen >= DISCONNECT_POLL_S:
                if await request.is_disconnected():
                    job.cancelled.set()
                    return "gone", None
                job.client_seen = time.monotonic()
            try:
                return await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                pass

    def _refuse(self, endpoint: str, e: RequestError) -> Response:
        self.metrics.requests.labels(endpoint, str(e.status)).inc()
        self.metrics.refused.labels(endpoint, str(e.status), e.code).inc()
        return Response(e.json(), status_code=e.status, media_type="application/json")

    async def _handle(self, request: Request, chat: bool):
        endpoint = "chat" if chat else "completions"
        try:
            if self.draining:
                raise self._shutting_down()
            raw = await self._unless_draining(self._body(request))
            loop = asyncio.get_running_loop()
            p, ids = await self._unless_draining(loop.run_in_executor(self._prepare_pool, self._prepare, raw, chat))
            plan = self.configs.plan(p.sparsity, len(ids), p.max_tokens)
            job = Job(p, ids, plan, loop)
            self.worker.submit(job)
            rid = new_id(chat)
            first = await self._next(job, request)
            if first[0] == "error":
                raise first[1]
            if first[0] == "gone":
                return Response(status_code=CLIENT_GONE)
            if p.stream:
                self.metrics.requests.labels(endpoint, "200").inc()
                return StreamingResponse(self._stream(job, request, rid, first, endpoint),
                                         media_type="text/event-stream")
            parts, event = [], first
            while event[0] == "delta":
                parts.append(event[1])
                event = await self._next(job, request)
            if event[0] == "gone":
                return Response(status_code=CLIENT_GONE)
            if event[0] == "error":  # after the first token: an engine failure, or the drain ran out
                raise event[1]
        except RequestError as e:
            return self._refuse(endpoint, e)
        except InputError as e:
            return self._refuse(endpoint, RequestError(str(e)))
        except Exception as e:  # a bug: this request fails, the server goes on
            log.error("request failed:\n%s", traceback.format_exc())
            return self._refuse(endpoint, RequestError(f"internal error ({type(e).__name__}: {e})", status=500,
                                                       kind="server_error"))
        self.metrics.requests.labels(endpoint, "200").inc()
        done = event[1]
        text = done["text"] if done["text"] is not None else ""
        body = response(p, rid, text, done["finish"], usage(len(ids), len(done["ids"])), done["sparsedecode"])
        if done["text"] is None:
            body["choices"][0]["token_ids"] = done["ids"]
        return JSONResponse(body)

    async def _stream(self, job: Job, request: Request, rid: str, event, endpoint: str):
        p, head = job.params, True
        try:
            while event[0] == "delta":
                yield _sse(chunk(p, rid, event[1], first=head))
                head = False
                event = await self._next(job, request)
            if event[0] == "gone":
                return
            if event[0] == "error":  # the status is sent: the error rides in an event
                e = event[1]
                self.metrics.refused.labels(endpoint, str(e.status), e.code).inc()
                yield f"data: {e.json().decode()}\n\n"
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

    # -- shutdown --------------------------------------------------------------------------
    def drain(self, timeout_s: float) -> None:
        """Begin a shutdown (on the event loop): refuse all that is not running, and stop the
        running answer with a 503 if it is not done in `timeout_s`."""
        if self.draining:
            return
        self.draining = True
        self._drained.set()
        self.worker.close(self._shutting_down())
        late = RequestError(f"the server is shutting down and its drain time ({timeout_s:g} s, --drain-timeout) ran "
                            "out before this answer finished; send it again to a running server", status=503,
                            kind="server_error", code="shutting_down")
        asyncio.get_running_loop().call_later(timeout_s, self.worker.abort, late)

    def uvicorn(self, drain_timeout_s: float = DRAIN_TIMEOUT_S):
        """The uvicorn server of this app, whose shutdown drains (see the module doc)."""
        import uvicorn

        server = self

        class Draining(uvicorn.Server):
            async def shutdown(self, sockets=None):
                server.drain(drain_timeout_s)
                await super().shutdown(sockets)

        return Draining(uvicorn.Config(self.app, log_level="warning",
                                       timeout_graceful_shutdown=drain_timeout_s + GRACE_MARGIN_S))

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
            return {"status": "shutting_down" if self.draining else "ok", "model": eng.name,
                    "device": str(eng.device), "configurations": self.configs.specs, "default": self.configs.default,
                    "queue": self.worker.waiting, "running": self.worker.running, "batch": getattr(eng, "batch", 1),
                    "batch_projection": getattr(getattr(self.configs, "gate", None), "projection", None),  # a gated batch's
                    "max_len": eng.max_len,
                    "max_prompt_chars": self.max_prompt_chars, "max_body_bytes": self.max_body}

        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @app.exception_handler(HTTPException)
        async def http_error(request: Request, exc: HTTPException):  # an unknown path, a wrong method
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
            e = RequestError(f"{request.method} {request.url.path}: {exc.detail}", status=exc.status_code, code=code)
            return self._refuse("other", e)

        @app.exception_handler(Exception)
        async def bug(request: Request, exc: Exception):  # outside a handler's own catch; starlette logs it
            return self._refuse("other", RequestError(f"internal error ({type(exc).__name__}: {exc})", status=500,
                                                      kind="server_error"))

        return app

    def _lifespan(self, app):
        server = self

        class Life:
            async def __aenter__(self):
                return None

            async def __aexit__(self, *exc):
                await asyncio.get_running_loop().run_in_executor(None, server.worker.stop)
                server._prepare_pool.shutdown(wait=False, cancel_futures=True)

        return Life()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
