"""Passkey retrieval with the KV branch: which placements each mode still answers (ByteCross App. A, G).

A five-digit pass key is hidden at several depths of a filler text of about
`--tokens` tokens; the model completes "The pass key is" greedily. Per
placement: one dense prefill, then every mode decodes from the same cache
(dense reads it all; snapkv at each keep selects after the prefill; window
reads 4 sinks + the recent entries in place). The full cache keeps every entry,
so modes are switched by rewinding to the prompt's end and selecting again.
For the window the record says whether the key's tokens lie inside its region.

    PYTHONPATH=src python benchmarks/passkey_kv.py --out benchmarks/records/cpu/passkey

Writes one record (kind 'passkey_kv') per run: CPU unless --device says otherwise.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import sparsedecode
from sparsedecode.kv.apply import clear_kv
from sparsedecode.records import stamp, write_record

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
QUESTION = " What is the pass key? The pass key is"


def build(tok, n_tokens: int, depth: float, key: str) -> tuple[list[int], int, int]:
    """Prompt ids of about n_tokens with the key sentence at `depth`; (ids, key start, key end)."""
    filler = tok(FILLER, add_special_tokens=False)["input_ids"]
    needle = tok(f" The pass key is {key}. Remember it. {key} is the pass key. ", add_special_tokens=False)["input_ids"]
    tail = tok(QUESTION, add_special_tokens=False)["input_ids"]
    body = (filler * (n_tokens // len(filler) + 1))[: n_tokens - len(needle) - len(tail)]
    at = int(depth * len(body))
    ids = body[:at] + needle + body[at:] + tail
    return ids, at, at + len(needle)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    ap.add_argument("--modes", default="dense,snapkv:0.2,snapkv:0.3,window:0.3")
    ap.add_argument("--new", type=int, default=8, help="tokens generated per answer")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    depths = [float(d) for d in a.depths.split(",")]
    modes = [m.split(":") for m in a.modes.split(",")]
    eng = sparsedecode.load(a.model, device=a.device, max_len=a.tokens + a.new + 8)
    rng = random.Random(a.seed)
    rows = []
    t_start = time.perf_counter()
    for depth in depths:
        key = str(rng.randrange(10000, 100000))
        ids, k0, k1 = build(eng.tokenizer, a.tokens, depth, key)
        n = len(ids)
        t = time.perf_counter()
        first = eng.prefill(ids)
        prefill_s = time.perf_counter() - t
        for mode in modes:
            method, keep = mode[0], float(mode[1]) if len(mode) > 1 else 1.0
            eng.pos = n  # rewind to the prompt's end: the cache still holds the prompt
            sel = None
            if method == "dense":
                clear_kv(eng)
            else:
                sel = eng.select_kv(method, keep, a.new)
            out, tok = [], int(first.argmax())
            for _ in range(a.new):
                out.append(tok)
                tok = int(eng.decode_step(tok).argmax())
            text = eng.tokenizer.decode(out, skip_special_tokens=True)
            row = {"depth": depth, "key": key, "prompt_tokens": n, "key_span": [k0, k1], "mode": method,
                   "keep": keep, "answer": text, "correct": key in text, "prefill_s": prefill_s,
                   "select_s": None if sel is None else sel.select_s,
                   "budget": None if sel is None else sel.budget}
            if method == "window":  # is the key inside the 4 sinks + the recent entries it reads?
                recent = sel.budget - 4 + a.new
                row["key_in_window"] = k1 <= 4 or k0 >= n + 1 - recent
            rows.append(row)
            print(f"depth {depth:g} {method}:{keep:g} -> {text!r} "
                  f"{'OK' if row['correct'] else 'miss'}", flush=True)
        clear_kv(eng)
    rec = stamp({"kind": "passkey_kv", "model": a.model, "device": str(eng.device),
                 "dtype": str(eng.dtype).removeprefix("torch."), "tokens": a.tokens, "new": a.new,
                 "runtime": "CPU" if eng.device.type == "cpu" else str(eng.device),
                 "rows": rows, "wall_s": time.perf_counter() - t_start})
    path = write_record(a.out / f"passkey_kv_{a.model}_{a.tokens}_{time.strftime('%Y%m%dT%H%M%S')}.json", rec)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
