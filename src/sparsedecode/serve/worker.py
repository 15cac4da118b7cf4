"""One engine, one worker thread, one FIFO queue (batch 1).

Every use of the engine happens on the worker thread: the warm-up (compile and capture of each
configuration) and every request. The HTTP handlers validate, tokenize and queue a `Job`, then
read its events (`delta` text, then `done` or `error`) from an asyncio queue that the worker
fills through the event loop. A job whose client went away is cancelled: the worker stops it
between two decode steps (or skips it if it has not started) and takes the next.

Shutdown drains (`close`, then `abort` once the drain time is up): the queued jobs are refused
with a 503 before any work, the running one finishes, or is stopped between two steps and
refused if it outlasts the drain, so no handler is left waiting for an engine that decodes for
nobody.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field

from sparsedecode.errors import InputError
from sparsedecode.serve.configs import Configurations, Plan
from sparsedecode.serve.metrics import Metrics
from sparsedecode.serve.protocol import Params, RequestError

log = logging.getLogger("sparsedecode.serve")


@dataclass
class Job:
    """A validated request: its token ids, configuration and the channel back to its handler."""

    params: Params
    ids: list[int]
    plan: Plan
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    refusal: RequestError | None = None  # why the server stopped it (None: its client went away)
    client_seen: float = field(default_factory=time.monotonic)  # when its handler last found the client there
    queued_at: float = field(default_factory=time.monotonic)  # when it was made, just before it queued

    def emit(self, kind: str, payload) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))


def _held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of `text` that may begin a stop sequence (not streamed yet)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class TextStream:
    """The answer's text as its tokens arrive, each token decoding only the few tokens since
    the last text it completed (a prefix and a read offset, as vLLM's incremental detokenizer
    does) instead of the whole answer, so a long answer costs linear, not quadratic, host time.
    A token that ends in the middle of a multi-byte character adds nothing until it completes."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.text = tokenizer, [], ""
        self.prefix = self.read = 0

    def add(self, token: int) -> str:
        """Append `token`; returns the text it completes ('' while a character is unfinished)."""
        self.ids.append(token)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        now = decode(self.ids[self.prefix:], skip_special_tokens=True)
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        delta = now[len(before):]
        self.text += delta
        self.prefix, self.read = self.read, len(self.ids)
        return delta


class Worker:
    """The engine's thread. `start()` warms every configuration; `submit(job)` queues a job or
    raises a 429 RequestError beyond `max_queue` waiting jobs; `close(refusal)` refuses what
    waits and all that comes after, `abort(refusal)` stops the running job; `stop()` joins."""

    def __init__(self, engine, configs: Configurations, metrics: Metrics, max_queue: int):
        self.engine, self.configs, self.metrics, self.max_queue = engine, configs, metrics, max_queue
        self._jobs: queue.Queue = queue.Queue()
        self._waiting = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="sparsedecode-engine", daemon=True)
        self._ready = threading.Event()
        self.running = 0  # 1 while a job decodes
        self._current: Job | None = None
        self._closed: RequestError | None = None  # set at shutdown: what every later job gets
        self.warm_s: dict[str, float] = {}
        self.failure: BaseException | None = None

    # -- life cycle ------------------------------------------------------------------------
    def start(self, progress=None) -> dict[str, float]:
        """Start the thread and wait for its warm-up; returns seconds per configuration."""
        self._progress = progress
        self._thread.start()
        self._ready.wait()
        if self.failure is not None:
            raise self.failure
        return self.warm_s

    def stop(self, timeout: float | None = None) -> None:
        """Finish the queued jobs (none are left after `close`), then end the thread."""
        self._jobs.put(None)
        self._thread.join(timeout)

    def close(self, refusal: RequestError) -> None:
        """Refuse every waiting job and every later `submit` with `refusal`; the running job goes on."""
        with self._lock:
            self._closed = refusal
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    self._waiting -= 1
                    self._refuse(job, refusal)
            self.metrics.queue_depth.set(self._waiting)
        self._jobs.put(None)  # the thread ends after the running job

    def abort(self, refusal: RequestError) -> None:
        """Stop the running job between two decode steps; its client gets `refusal`."""
        with self._lock:
            job = self._current
            if job is not None and not job.cancelled.is_set():
                job.refusal = refusal
                job.cancelled.set()

    def _refuse(self, job: Job, refusal: RequestError) -> None:
        job.refusal = refusal
        job.cancelled.set()
        job.emit("error", refusal)

    @property
    def waiting(self) -> int:
        return self._waiting

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._closed is not None:
                raise self._closed
            if self._waiting >= self.max_queue:
                raise RequestError(f"the queue is full ({self.max_queue} requests waiting); retry later",
                                   status=429, kind="rate_limit_error")
            self._waiting += 1
            self.metrics.queue_depth.set(self._waiting)
        self._jobs.put(job)

    # -- the thread ------------------------------------------------------------------------
    def _warm(self) -> dict[str, float]:
        """Compile and capture every configuration's decode step; seconds each."""
        return self.configs.warm(self._progress)

    def _start_up(self) -> bool:
        """Warm up and let `start()` return; False where the warm-up failed (`failure`)."""
        try:
            self.warm_s = self._warm()
            for spec, s in self.warm_s.items():
                self.metrics.capture_seconds.labels(spec).set(s)
        except BaseException as e:  # reported by start() on the main thread
            self.failure = e
            self._ready.set()
            return False
        self._ready.set()
        return True

    def _claim(self, job: Job, running=None) -> bool:
        """Take `job` off the queue's count; True where it is to be served. A job whose client
        went away is counted as cancelled, one taken as the server closed gets the refusal; the
        decision is made under the lock that `close` takes, where `running` (if given) marks
        the job as the running one."""
        with self._lock:
            self._waiting -= 1
            self.metrics.queue_depth.set(self._waiting)
            closed, gone = self._closed, job.cancelled.is_set()
            if closed is None and not gone and running is not None:
                running()
        if gone:
            self.metrics.cancelled.inc()
            return False
        if closed is not None:
            self._refuse(job, closed)  # taken off the queue as it closed: no work done
            return False
        return True

    def _run(self) -> None:
        if not self._start_up():
            return
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if not self._claim(job, lambda job=job: self._mark_running(job)):
                continue
            try:
                self._serve(job)
            except Exception as e:
                report_failure(job, e)
            finally:
                with self._lock:
                    self._current, self.running = None, 0

    def _mark_running(self, job: Job) -> None:
        self._current, self.running = job, 1

    def _serve(self, job: Job) -> None:
        from sparsedecode.engine.engine import Generation

        eng, p = self.engine, job.params
        self.configs.install(job.plan.spec)
        answer = Answer(job, eng.tokenizer)
        timing = Generation(prompt_ids=list(job.ids), ids=answer.ids)  # its decode speed counts `ids`
        t0 = time.perf_counter()
        steps = eng.tokens(job.ids, p.max_tokens, temperature=p.temperature, top_p=p.top_p, seed=p.seed,
                           stop_ids=() if p.ignore_eos else None, timing=timing)
        try:
            for tok in steps:
                if answer.add(tok):
                    break
        finally:
            steps.close()
        answer.end(timing, self.metrics, t0)


def report_failure(job: Job, e: Exception) -> None:
    """Send `job` the error that stopped it: a RequestError as it is, an InputError as a 400, any
    other exception (a bug: the server keeps serving, the client learns it was ours) logged and
    answered 500."""
    if isinstance(e, RequestError):
        job.emit("error", e)
    elif isinstance(e, InputError):
        job.emit("error", RequestError(str(e)))
    else:
        log.error("request failed:\n%s", "".join(traceback.format_exception(e)))
        job.emit("error", RequestError(f"internal error ({type(e).__name__}: {e})", status=500,
                                       kind="server_error"))


class Answer:
    """One job's answer as its tokens arrive: the text streamed as `delta` events, held back
    where it may begin a stop string and cut at one; then `end` sends `done` (or the refusal of
    a job stopped by the server). `ids` are the answer's tokens."""

    def __init__(self, job: Job, tokenizer):
        self.job, self.tokenizer, self.ids = job, tokenizer, []
        self.stream = TextStream(tokenizer) if tokenizer is not None else None
        self.longest = max((len(s) for s in job.params.stop), default=0)
        self.sent, self.text, self.finish = 0, "", None

    def add(self, tok: int) -> bool:
        """Take the next token; True where the answer ends here (a stop string, or cancelled)."""
        job = self.job
        if job.cancelled.is_set():
            self.finish = "cancelled"
            return True
        self.ids.append(tok)
        if self.stream is None or not self.stream.add(tok):  # ids only, or nothing new (mid-character)
            return False
        stops, text = job.params.stop, self.stream.text
        start = max(0, self.sent - self.longest)  # a stop can only begin in what has not been sent
        cut = min((i for i in (text.find(s, start) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.finish = text[:cut], "stop"
            return True
        self.text = text
        ready = len(text) - _held_back(text, stops)
        if ready > self.sent:
            job.emit("delta", text[self.sent:ready])
            self.sent = ready
        return False

    def end(self, timing, metrics: Metrics, t0: float, extra: dict | None = None) -> None:
        """Send the answer's end: `done` with its ids, text, finish reason and timings (`extra`
        joins the response's `sparsedecode` field), or, where it was cancelled, the server's
        refusal (the drain ran out) or nothing (its client went away)."""
        job = self.job
        if self.finish == "cancelled":
            if job.refusal is not None:  # the drain ran out: the client hears why, not a cut connection
                job.emit("error", job.refusal)
            else:
                metrics.cancelled.inc()
            return
        finish = self.finish or ("stop" if timing.stopped_at_eos else "length")
        if self.tokenizer is not None and len(self.text) > self.sent:
            job.emit("delta", self.text[self.sent:])
        ms = timing.ms_per_token
        metrics.observe(job.plan.spec, len(job.ids), len(self.ids), ms)
        job.emit("done", {
            "ids": self.ids, "text": self.text if self.tokenizer is not None else None, "finish": finish,
            "sparsedecode": {
                "mode": job.plan.spec, "predicted_ms_per_token": job.plan.predicted_ms_per_token,
                "ms_per_token": None if ms != ms else ms, "kv_select_ms": 1000.0 * timing.kv_select_s,
                "prefill_ms": 1000.0 * timing.prefill_s, "compile_ms": 1000.0 * timing.compile_s,
                "wall_ms": 1000.0 * (time.perf_counter() - t0), **(extra or {}),
            },
        })
