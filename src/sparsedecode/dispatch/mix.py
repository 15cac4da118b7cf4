"""Request mixes as data: the workloads of ByteCross App. I, seeded, and a user's own traffic.

App. I: 'The workload combines 70% chat requests with lognormal prompts of median 1K tokens
and 256-token answers, 20% long-document questions with 32K to 128K prompts and 128-token
answers, and 10% agent loops with 16K to 96K prompts and 1,024-token answers.'

- chat: prompt lengths lognormal with median 1,024 tokens and sigma 1.1, clamped to
  [64, 32,768] and truncated to whole tokens; 256-token answers;
- long_doc: prompts uniform on the integers [32,768, 131,072]; 128-token answers;
- agent: prompts uniform on [16,384, 98,304]; 1,024-token answers;
- mixed: 1,400 chat + 400 long-document + 200 agent requests.

Each workload is a stratified draw from its own stream (`numpy.random.default_rng([seed, k])`):
the i-th of its N prompts falls in the i-th of N equally likely slices of the distribution, at
a uniform random place inside it, and the requests are then shuffled. Independent draws of
2,000 requests move the mixed workload's speedups in the third decimal from seed to seed; the
stratified draw prices the distribution itself, so a table does not depend on a lucky seed
(`tests/dispatch/test_policies.py` checks that seeds agree to 0.003).

A trace is a user's traffic: JSONL lines {"prompt_tokens": N, "answer_tokens": M} or a CSV
with those two columns; a bad row is refused with its line number.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

import numpy as np

from sparsedecode.errors import InputError, option
from sparsedecode.validate import require_number

CHAT_MEDIAN, CHAT_SIGMA, CHAT_RANGE, CHAT_ANSWER = 1024, 1.1, (64, 32768), 256
LONG_DOC_RANGE, LONG_DOC_ANSWER = (32768, 131072), 128
AGENT_RANGE, AGENT_ANSWER = (16384, 98304), 1024
MIXED = {"chat": 1400, "long_doc": 400, "agent": 200}
SIZES = {"chat": 2000, "long_doc": 500, "agent": 500}  # a single workload's default size
WORKLOADS = ("mixed", "chat", "long_doc", "agent")
PROMPT_LIMIT, ANSWER_LIMIT = 2**24, 2**20  # tokens of one request; beyond them a size is a mistake


def check_request(prompt, answer, where: str = "request", *, answer_lo: int = 1) -> tuple[int, int]:
    """(prompt tokens, answer tokens) of one request when they are whole numbers within
    1..PROMPT_LIMIT and answer_lo..ANSWER_LIMIT; the message names the limit."""
    return (int(require_number(prompt, "prompt_tokens", lo=1, hi=PROMPT_LIMIT, integer=True, where=where)),
            int(require_number(answer, "answer_tokens", lo=answer_lo, hi=ANSWER_LIMIT, integer=True, where=where)))


@dataclass(frozen=True)
class Mix:
    """Requests as two int arrays of equal length: prompt tokens and answer tokens."""

    name: str
    prompt: np.ndarray  # (R,) int64
    answer: np.ndarray  # (R,) int64
    source: str = ""

    def __post_init__(self):
        if self.prompt.shape != self.answer.shape or self.prompt.ndim != 1 or self.prompt.size == 0:
            raise InputError(f"mix '{self.name}' needs at least one request with a prompt and an answer length")
        for arr, limit, what in ((self.prompt, PROMPT_LIMIT, "prompt"), (self.answer, ANSWER_LIMIT, "answer")):
            if arr.min() < 1 or arr.max() > limit:
                raise InputError(f"mix '{self.name}': {what} lengths run from {arr.min()} to {arr.max()} tokens, "
                                 f"expected 1 to {limit}")

    def __len__(self) -> int:
        return int(self.prompt.size)

    def summary(self) -> dict:
        return {"name": self.name, "source": self.source, "requests": len(self),
                "prompt_tokens": {"median": float(np.median(self.prompt)), "min": int(self.prompt.min()),
                                  "max": int(self.prompt.max())},
                "answer_tokens": {"mean": float(self.answer.mean()), "min": int(self.answer.min()),
                                  "max": int(self.answer.max())}}


def _strata(seed: int, k: int, n: int) -> np.ndarray:
    """n uniforms on (0, 1), one in each slice [i/n, (i+1)/n), in random order (stream k)."""
    rng = np.random.default_rng([seed, k])
    u = (np.arange(n) + rng.random(n)) / n
    return u[rng.permutation(n)]


def _chat(seed: int, n: int) -> np.ndarray:
    inv = NormalDist(math.log(CHAT_MEDIAN), CHAT_SIGMA).inv_cdf
    x = np.exp([inv(min(max(u, 1e-12), 1 - 1e-12)) for u in _strata(seed, 0, n)])
    return np.clip(x, *CHAT_RANGE).astype(np.int64)


def _uniform(seed: int, k: int, lo_hi: tuple[int, int], n: int) -> np.ndarray:
    lo, hi = lo_hi
    return np.minimum(lo + np.floor(_strata(seed, k, n) * (hi - lo + 1)), hi).astype(np.int64)


def workload(name: str, seed: int = 0) -> Mix:
    """One of App. I's workloads (`WORKLOADS`), drawn with `seed`."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise InputError(f"{option('seed')} must be a whole number >= 0, got {seed!r}")
    parts = {
        "chat": lambda n: (_chat(seed, n), CHAT_ANSWER),
        "long_doc": lambda n: (_uniform(seed, 1, LONG_DOC_RANGE, n), LONG_DOC_ANSWER),
        "agent": lambda n: (_uniform(seed, 2, AGENT_RANGE, n), AGENT_ANSWER),
    }
    if name == "mixed":
        ps, ans = [], []
        for part, n in MIXED.items():
            p, a = parts[part](n)
            ps.append(p)
            ans.append(np.full(n, a, dtype=np.int64))
        return Mix("mixed", np.concatenate(ps), np.concatenate(ans), f"App. I, seed {seed}")
    if name not in parts:
        raise InputError(f"mix '{name}' is not one of {', '.join(WORKLOADS)} or a trace file "
                         "(JSONL or CSV with prompt_tokens and answer_tokens)")
    p, a = parts[name](SIZES[name])
    return Mix(name, p, np.full(p.size, a, dtype=np.int64), f"App. I, seed {seed}")


def _count(value, line: int, col: str, where: str) -> int:
    if isinstance(value, str):
        text = value.strip()
        try:
            value = int(text)
        except ValueError:
            raise InputError(f"{where} line {line}: field '{col}' is {text!r}, expected a whole number of "
                             "tokens") from None
    limit = PROMPT_LIMIT if col == "prompt_tokens" else ANSWER_LIMIT
    return int(require_number(value, col, lo=1, hi=limit, integer=True, where=f"{where} line {line}"))


def read_trace(path: str | Path) -> Mix:
    """A user's traffic from a JSONL or CSV file of (prompt_tokens, answer_tokens) rows."""
    path = Path(path)
    where = str(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise InputError(f"{where}: trace file not found (give mixed, chat, long_doc, agent or a file)") from None
    except IsADirectoryError:
        raise InputError(f"{where} is a folder; give a JSONL or CSV trace file") from None
    except UnicodeDecodeError as err:
        raise InputError(f"{where}: not UTF-8 text (byte {err.start}); save the trace as UTF-8") from None
    rows: list[tuple[int, int]] = []
    lines = text.splitlines()
    first = next((ln.strip() for ln in lines if ln.strip()), "")
    if first.startswith("{"):
        for i, ln in enumerate(lines, 1):
            if not ln.strip():
                continue
            try:
                obj = json.loads(ln)
            except json.JSONDecodeError as err:
                raise InputError(f"{where} line {i}: not a JSON object ({err.msg})") from None
            if not isinstance(obj, dict) or "prompt_tokens" not in obj or "answer_tokens" not in obj:
                raise InputError(f"{where} line {i}: expected {{\"prompt_tokens\": N, \"answer_tokens\": M}}")
            rows.append((_count(obj["prompt_tokens"], i, "prompt_tokens", where),
                         _count(obj["answer_tokens"], i, "answer_tokens", where)))
    else:
        reader = csv.reader(io.StringIO(text))
        header = None
        for i, row in enumerate(reader, 1):
            if not row or not any(c.strip() for c in row):
                continue
            if header is None:
                header = [c.strip() for c in row]
                missing = [c for c in ("prompt_tokens", "answer_tokens") if c not in header]
                if missing:
                    raise InputError(f"{where} line {i}: the CSV header lacks {', '.join(missing)} "
                                     f"(it has {', '.join(header) or 'nothing'})")
                ip, ia = header.index("prompt_tokens"), header.index("answer_tokens")
                continue
            if len(row) != len(header):
                raise InputError(f"{where} line {i}: {len(row)} fields, the header has {len(header)}")
            rows.append((_count(row[ip], i, "prompt_tokens", where), _count(row[ia], i, "answer_tokens", where)))
    if not rows:
        raise InputError(f"{where}: no requests (expected JSONL lines or CSV rows of prompt_tokens, answer_tokens)")
    arr = np.asarray(rows, dtype=np.int64)
    return Mix(path.stem, arr[:, 0], arr[:, 1], where)


def get_mix(spec: str, seed: int = 0) -> Mix:
    """A named workload, or a trace when `spec` is not one of `WORKLOADS`."""
    return workload(spec, seed) if spec in WORKLOADS else read_trace(spec)


__all__ = ["ANSWER_LIMIT", "MIXED", "PROMPT_LIMIT", "WORKLOADS", "Mix", "check_request", "get_mix", "read_trace",
           "workload"]
