"""Continuous batching: up to B requests in one decode step (ByteCross §3.3, App. F; issue 44).

The worker thread owns an engine loaded with `batch=B` and its `engine.batch.BatchDecoder`.
Each turn of its loop it
1. takes queued jobs into free slots, one prompt prefilled at a time;
2. prefills at most one chunk of prompt tokens (`BatchDecoder.admit_chunks`): several short
   prompts join at once, a long one goes on chunk by chunk across steps, so a prompt stalls the
   decoding requests by one chunk at most, not by its whole prefill;
3. runs one decode step of every live request and hands each its token (`worker.Answer`: text,
   stop strings, cancellation); a request that ends frees its slot, and the next queued one
   takes it before the next step.
Every request's KV selection is its own (the server's `--kv`, or under a gate table of the
server's batch size the gate's choice for its prompt and max_tokens, selected after its own
prefill into its own compact region); the projection configuration is the whole batch's (one step
reads one set of weight rows: the union of the batch's kept channels): the server's, or the one
the gate prices cheapest at its batch size (`dispatch.runtime.batch_projection`).
The queue, the refusals and the drain behave as the batch-1 `Worker`'s.
"""

from __future__ import annotations

import logging
import queue
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass

from sparsedecode.errors import InputError
from sparsedecode.serve.protocol import RequestError
from sparsedecode.serve.worker import Answer, Job, Worker, report_failure

log = logging.getLogger("sparsedecode.serve")


@dataclass
class _Admission:
    """The job whose prompt is being prefilled: its prefill's chunks (`admit_chunks`), its slot,
    when it started, and the prompt tokens still to prefill."""

    job: Job
    chunks: Iterator[None]
    slot: int
    t0: float
    left: int


class BatchWorker(Worker):
    """`Worker` for an engine of `batch` > 1 slots; see the module doc. `chunk`: prompt tokens
    prefilled between two decode steps."""

    def __init__(self, engine, configs, metrics, max_queue: int, chunk: int = 512):
        from sparsedecode.engine.batch import BatchDecoder

        super().__init__(engine, configs, metrics, max_queue)
        self.decoder = BatchDecoder(engine)
        self.chunk = chunk
        self._live: dict[int, tuple[Job, Answer, float]] = {}  # id(job) -> the job, its answer, its start
        self._admitting: _Admission | None = None  # the job whose prompt is being prefilled
        self._ending = False  # the stop sentinel was taken: finish what runs, take nothing more

    @property
    def running(self) -> int:  # jobs decoding or being prefilled
        return len(self._live) + (self._admitting is not None)

    @running.setter
    def running(self, value) -> None:  # Worker.__init__ sets it; here it is counted
        pass

    def abort(self, refusal: RequestError) -> None:
        """Stop every running job before the next step; their clients get `refusal`."""
        with self._lock:
            jobs = [j for j, _, _ in self._live.values()] + ([self._admitting.job] if self._admitting else [])
            for job in jobs:
                if not job.cancelled.is_set():
                    job.refusal = refusal
                    job.cancelled.set()

    # -- the thread ------------------------------------------------------------------------
    def _warm(self) -> dict[str, float]:
        """Per configuration the server runs (its one, or each its gate may choose for a request):
        prefill, select where it selects, and decode a few steps of one prompt; on CUDA this
        captures the B-row step (every occupancy replays it)."""
        from sparsedecode.engine.batch import Request
        from sparsedecode.kv.select import get_selector

        eng, out = self.engine, {}
        for spec in self.configs.specs:
            self.configs.install(spec)  # a gate's configuration; the server's one is in place
            kv = eng.kv_config if eng.kv_config is not None and eng.kv_config.keep < 1.0 else None
            n = 16
            if kv is not None:
                sel = get_selector(kv.method, **kv.params)
                n = int((sel.sinks + sel.window + 4) / kv.keep) + 1
            if n + 4 > eng.max_len:
                raise InputError(f"the cache of {eng.max_len} tokens cannot hold a prompt that {spec} can select "
                                 f"from ({n} tokens); load with a larger max_len")
            t0 = time.perf_counter()
            self.decoder.run([Request([0] * n, 4, stop_ids=(), kv=kv)])
            out[spec] = time.perf_counter() - t0
            if self._progress is not None:
                self._progress(spec, out[spec])
        return out

    def _run(self) -> None:
        if not self._start_up():
            return
        while not (self._ending and not self.running):
            self._admit()
            self._drop_cancelled()
            if self._live:
                self._step()
            self.metrics.batch_occupancy.set(len(self._live))

    def _admit(self) -> None:
        """Prefill up to `chunk` prompt tokens before the next step: several short prompts join
        the batch at once (a wave of finished requests refills every free slot before one step),
        a long one goes on chunk by chunk across steps."""
        budget = self.chunk
        while budget > 0:
            if self._admitting is None:
                if self._ending or self.decoder.free_slot() is None:
                    return
                self._take(block=not self._live and budget == self.chunk)
                if self._admitting is None:
                    return
            cost = min(self.chunk, self._admitting.left)
            if cost > budget:
                return
            budget -= cost
            self._admitting.left -= cost
            self._admit_chunk()

    def _take(self, block: bool) -> None:
        """Take the next queued job that is still wanted and start its prefill (blocking only
        while nothing decodes)."""
        while True:
            try:
                job = self._jobs.get(block=block)
            except queue.Empty:
                return
            if job is None:
                self._ending = True
                return
            if not self._claim(job):
                continue
            self.metrics.queue_wait.observe(time.monotonic() - job.queued_at)
            self._start(job)
            return

    def _start(self, job: Job) -> None:
        from sparsedecode.engine.batch import Request

        eng, p, b = self.engine, job.params, self.decoder.free_slot()
        self.configs.install(job.plan.spec)
        try:
            req = Request(list(job.ids), p.max_tokens, p.temperature, p.top_p, p.seed,
                          () if p.ignore_eos else None, eng.kv_config)
            chunks = self.decoder.admit_chunks(b, id(job), req, self.chunk)
        except Exception as e:
            self._fail(job, e)
            return
        with self._lock:
            self._admitting = _Admission(job, chunks, b, time.perf_counter(), len(job.ids))

    def _admit_chunk(self) -> None:
        a = self._admitting
        job, b, t0 = a.job, a.slot, a.t0
        try:
            next(a.chunks)
            return  # more chunks to come: the others decode a step first
        except StopIteration:
            pass
        except Exception as e:
            with self._lock:
                self._admitting = None
            if self.decoder.slots[b] is not None:
                self.decoder.free(b)
            self._fail(job, e)
            return
        gen = self.decoder.generations[id(job)]
        answer = Answer(job, self.engine.tokenizer)
        with self._lock:
            self._admitting = None
            self._live[id(job)] = (job, answer, t0)
        if gen.ids and answer.add(gen.ids[0]) or self.decoder.slot_of(id(job)) is None:
            self._end(id(job))  # its first token ended it (a stop, max_tokens 1, EOS), or a stop string

    def _step(self) -> None:
        try:
            events = self.decoder.decode()
        except Exception as e:  # a bug: every running request learns it was ours; the server goes on
            log.error("decode step failed:\n%s", traceback.format_exc())
            for key in list(self._live):
                b = self.decoder.slot_of(key)
                if b is not None:
                    self.decoder.free(b)
                job = self._live[key][0]
                with self._lock:
                    del self._live[key]
                self._fail(job, e)
            return
        for key, tok, done in events:
            _, answer, _ = self._live[key]
            if answer.add(tok) or done:
                self._end(key)

    def _drop_cancelled(self) -> None:
        """A job whose client went away, or that the drain stopped, leaves its slot before the step."""
        for key, (job, answer, _) in list(self._live.items()):
            if job.cancelled.is_set():
                answer.finish = "cancelled"
                self._end(key)

    def _end(self, key: int) -> None:
        job, answer, t0 = self._live[key]
        b = self.decoder.slot_of(key)
        if b is not None:
            self.decoder.free(b)
        with self._lock:
            del self._live[key]
        gen = self.decoder.generations.pop(key)
        answer.end(gen, self.metrics, t0, {"batch": self.decoder.B})

    def _fail(self, job: Job, e: Exception) -> None:
        self.decoder.generations.pop(id(job), None)
        report_failure(job, e)


__all__ = ["BatchWorker"]
