"""Chunked WikiText-2 perplexity under a projection configuration (ByteCross App. A,
'Quality protocols'; issue 7 defines the protocol).

Consecutive chunks of 2,048 tokens from token 0 of the stream: the first 1,024
positions of each chunk run dense (they fill the cache), the last 1,024
positions run under the configuration, and their next-token losses are scored
(the last target of a chunk is the first token of the next). Losses are pooled
over all scored targets. On CPU the projection branch runs as its masked
reference: the same arithmetic as the sparse GEMV, every weight still read.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from sparsedecode.errors import InputError

CHUNK = 2048
DENSE = 1024


@torch.inference_mode()
def chunked_nll(engine, ids, chunks: int = 128, table: dict | None = None,
                progress: bool = False) -> list[float]:
    """Summed next-token NLL (nats) of each chunk's scored targets; `table` maps threshold
    keys to thresholds (input sites and CATS `act`), None is dense."""
    from sparsedecode.projection.calibrate import masks

    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)  # (N,)
    need = chunks * CHUNK + 1
    if chunks < 1 or ids.numel() < need:
        raise InputError(
            f"chunked perplexity over {chunks} chunks needs {need:,} tokens, the text has "
            f"{ids.numel():,}; use fewer chunks or a longer text"
        )
    if engine.max_len < CHUNK:
        raise InputError(f"chunked perplexity needs a cache of {CHUNK} tokens; load with max_len >= {CHUNK}")
    out = []
    it = range(chunks)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc="chunks", unit="chunk", leave=False)
    for k in it:
        c = ids[k * CHUNK : (k + 1) * CHUNK + 1]  # (2049,): the chunk and the next token
        engine.reset()
        engine.prefill(c[:DENSE])  # dense positions 0..1023
        with masks(engine.model, table or {}):
            logits = engine.prefill(c[DENSE:CHUNK], start=DENSE, all_logits=True)  # (1024, V)
        nll = F.cross_entropy(logits.double(), c[DENSE + 1 :].to(logits.device), reduction="sum")
        out.append(float(nll))
    engine.reset()
    return out


def pooled_ppl(nll_per_chunk: list[float], targets_per_chunk: int = CHUNK - DENSE) -> float:
    """exp of the mean NLL over every scored target."""
    return math.exp(sum(nll_per_chunk) / (targets_per_chunk * len(nll_per_chunk)))
