"""Ask a running server for token-id requests of given lengths under named configurations, and
set the ms/token it reports beside timing cells of the same configurations.

This is how the server is shown to add nothing to the decode step (issue 24): each request's
`sparsedecode.ms_per_token` (decode seconds over decode steps, measured inside the worker) is
divided by the step time of the `sparsedecode bench cell` record of its configuration at its
prompt length, timed on the same machine in the same call. Prompts are seeded random token ids
and EOS is ignored, so every request decodes exactly `max_tokens` steps.
"""

from __future__ import annotations

import random
import time
from pathlib import Path


def probe(url: str, requests: list[tuple[int, int]], modes: list[str], *, vocab: int = 32000, seed: int = 0,
          timeout_s: float = 1800.0, progress=None) -> list[dict]:
    """One request per (prompt length, answer length) and mode; a row per request."""
    import httpx

    rows = []
    with httpx.Client(base_url=url, timeout=timeout_s) as h:
        for i, (n, m) in enumerate(requests):
            ids = random.Random(seed + i).choices(range(vocab), k=n)  # the same prompt for every mode
            for mode in modes:
                t0 = time.perf_counter()
                resp = h.post("/v1/completions", json={"prompt": ids, "max_tokens": m, "temperature": 0,
                                                       "ignore_eos": True, "sparsedecode": {"mode": mode}})
                row = {"prompt_tokens": n, "max_tokens": m, "asked": mode, "status": resp.status_code,
                       "client_s": time.perf_counter() - t0}
                body = resp.json()
                if resp.status_code == 200:
                    row.update(completion_tokens=body["usage"]["completion_tokens"], **body["sparsedecode"])
                else:
                    row["error"] = body.get("error", {}).get("message", resp.text[:300])
                rows.append(row)
                if progress is not None:
                    progress(row)
    return rows


def compare(rows: list[dict], cells_folder: str | Path, tolerance: float) -> dict:
    """Each answered row's server/cell ms-per-token ratio against the cell of its mode at its
    prompt length; `passed` when every row has a cell and lies within `tolerance`."""
    from sparsedecode.dispatch.prices import cell_spec
    from sparsedecode.timing.cells import load_cells

    camp = load_cells(cells_folder)
    by = {}
    for c in camp.cells:
        by.setdefault((cell_spec(c), c.context), []).append(c.ms_per_token)
    for r in rows:
        ms = by.get((r.get("mode"), r["prompt_tokens"]))
        r["cell_ms_per_token"] = None if not ms else sum(ms) / len(ms)
        ok = r["status"] == 200 and r["cell_ms_per_token"] and r.get("ms_per_token")
        r["ratio"] = r["ms_per_token"] / r["cell_ms_per_token"] if ok else None
        r["within"] = bool(ok) and abs(r["ratio"] - 1) <= tolerance
    return {"cells": str(cells_folder), "gpu": camp.gpu, "tolerance": tolerance,
            "passed": bool(rows) and all(r["within"] for r in rows)}
