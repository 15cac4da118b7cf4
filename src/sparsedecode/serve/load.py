"""A bounded load test of a running server: C concurrent clients x R requests each, on loopback.

Every request must end in 200 or 429 (the queue was full); a request that errors, times out or
comes back twice is counted as such, and `ok` says whether none did. The record holds the
latency percentiles of the answered requests, throughput, and the server's resident memory
before and after (from /proc, where the server's PID is given), to show it stays flat.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path


def _rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def run_load(url: str, *, clients: int = 32, requests: int = 4, max_tokens: int = 8,
             prompt: str | list[int] = "The capital of France is", timeout_s: float = 600.0,
             pid: int | None = None, progress=None) -> dict:
    """Run the load and return its record (see the module doc)."""
    import httpx

    server = httpx.get(url.rstrip("/") + "/health", timeout=30).json()  # what was loaded
    rss0 = _rss_mb(pid)
    seen: dict[str, int] = {}
    results: list[dict] = []
    lock = threading.Lock()
    deadline = time.monotonic() + timeout_s

    def client(c: int) -> None:
        with httpx.Client(base_url=url, timeout=timeout_s) as h:
            for r in range(requests):
                t0 = time.perf_counter()
                row = {"client": c, "request": r}
                try:
                    if time.monotonic() > deadline:
                        raise TimeoutError("the load test ran past its time bound")
                    resp = h.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                           "temperature": 0})
                    row["status"] = resp.status_code
                    if resp.status_code == 200:
                        body = resp.json()
                        row["id"] = body["id"]
                        row["tokens"] = body["usage"]["completion_tokens"]
                except Exception as e:  # counted, never raised: the record says what failed
                    row["status"], row["error"] = None, f"{type(e).__name__}: {e}"
                row["latency_s"] = time.perf_counter() - t0
                with lock:
                    results.append(row)
                    if "id" in row:
                        seen[row["id"]] = seen.get(row["id"], 0) + 1
                    if progress is not None:
                        progress(len(results))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok200 = [r for r in results if r["status"] == 200]
    lat = [r["latency_s"] for r in ok200]
    counts = {str(s): sum(1 for r in results if r["status"] == s) for s in sorted({r["status"] for r in results},
                                                                                   key=str)}
    errors = [r for r in results if r["status"] not in (200, 429)]
    dup = sum(n - 1 for n in seen.values() if n > 1)
    return {
        "url": url, "server": server, "prompt": prompt, "clients": clients, "requests_per_client": requests, "max_tokens": max_tokens,
        "sent": clients * requests, "answered": len(results), "status_counts": counts,
        "errors": [r.get("error") or f"HTTP {r['status']}" for r in errors][:10], "duplicated_ids": dup,
        "ok": len(results) == clients * requests and not errors and dup == 0,
        "latency_s": {"p50": _pct(lat, 0.5), "p95": _pct(lat, 0.95), "mean": statistics.fmean(lat) if lat else None},
        "wall_s": wall, "requests_per_s": len(ok200) / wall if wall > 0 else None,
        "tokens_per_s": sum(r.get("tokens", 0) for r in ok200) / wall if wall > 0 else None,
        "server_rss_mb": {"before": rss0, "after": _rss_mb(pid)},
    }
