"""The server's Prometheus metrics (GET /metrics), on a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# decode ms per token: 0.5 ms (an H200 step of a small model) to 2 s (a large model on CPU)
MS_BUCKETS = (0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 50, 75, 100, 200, 500, 1000, 2000)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        p = "sparsedecode_"
        self.requests = Counter(p + "requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of answered requests", registry=r)
        self.generated_tokens = Counter(p + "generated_tokens", "Tokens generated", registry=r)
        self.decode_ms = Histogram(p + "decode_ms_per_token", "Decode milliseconds per token of a request",
                                   buckets=MS_BUCKETS, registry=r)
        self.by_config = Counter(p + "requests_by_config", "Requests decoded, by configuration", ["mode"],
                                 registry=r)
        self.refused = Counter(p + "refused", "Requests refused (an error body, or a stream's error event), by "
                               "endpoint, HTTP status and reason (the error's code)", ["endpoint", "status", "reason"],
                               registry=r)
        self.queue_depth = Gauge(p + "queue_depth", "Requests waiting for the engine", registry=r)
        self.batch_occupancy = Gauge(p + "batch_occupancy", "Requests in the decode batch (serve --batch)",
                                     registry=r)
        self.queue_wait = Histogram(p + "queue_wait_seconds", "Seconds a request waited for a slot before its prefill",
                                    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300), registry=r)
        self.cancelled = Counter(p + "cancelled", "Requests whose client went away before the end",
                                 registry=r)
        self.capture_seconds = Gauge(p + "capture_seconds", "Compile and capture seconds of each "
                                     "configuration's decode step at start-up", ["mode"], registry=r)
        self.startup_seconds = Gauge(p + "startup_seconds", "Start-up seconds by phase (load, warm)",
                                     ["phase"], registry=r)

    def observe(self, mode: str, prompt_tokens: int, new_tokens: int, ms_per_token: float) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(new_tokens)
        self.by_config.labels(mode).inc()
        if ms_per_token == ms_per_token:  # nan for an answer of one token
            self.decode_ms.observe(ms_per_token)
