"""What every 'timing_cell' record carries, whoever's decode step it times: ours
(`timing.cell.run_cell`, `timing.batch_cell` for B sequences) and the peers' (`timing.peer`) alike,
so reports set them side by side, and the set-up our two runners share (the prefill chunk, the
calibration, the dense step's label). Every runner imports it; none imports another's internals.
"""

from __future__ import annotations

PREFILL_CHUNK = 512  # prompt tokens a timing cell's prefill runs at once (the paper's protocol)


def timed_step_bytes(dims, n: int, proj_keep: float, kv_read: float, weight_bytes: float,
                     kv_bytes: float) -> float:
    """Bytes one timed step reads (§3.1, Eq. 1-4): `step_bytes` at context n with the
    projection bytes (MLP + attention projections) scaled by the realized projection keep
    and the KV bytes by the read fraction; LM head, embedding row and norms stay dense."""
    from sparsedecode.account.traffic import step_bytes

    b = step_bytes(dims, n, weight_bytes, kv_bytes)
    return b.other + (b.mlp + b.attn) * proj_keep + b.kv * kv_read


def bookkeeping(spec) -> dict:
    """Where a cell sits in its campaign (a `timing.cell.CellSpec`'s campaign, block, group,
    cell and order)."""
    return {"campaign": spec.campaign, "block": spec.block, "group": spec.group, "cell": spec.cell,
            "order": spec.order}


def peak_memory(dev) -> int:
    """Peak bytes this process held on `dev`: allocated CUDA memory, or the host's max RSS."""
    import torch

    if dev.type == "cuda":
        return int(torch.cuda.max_memory_allocated(dev))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def calibrate_teal(eng, spec, keep: float):
    """Uniform TEAL thresholds at `keep` on the model's own activations (`own_teal`), as a timing
    cell (`spec`, a `timing.cell.CellSpec`) calibrates them; (thresholds, what the record says)."""
    from sparsedecode.projection.calibrate import own_teal

    th, what = own_teal(eng, keep, tokens=spec.calib_tokens, seed=spec.seed, text_file=spec.text)
    return th, {"method": "teal", "keep": keep, "ids": what, "text": th.calibration.get("text"),
                "tokens": spec.calib_tokens}


def dense_step_label(eng) -> str:
    """What runs the projections of `eng` that hold no threshold (every one of a dense step):
    the words a report prints beside the speedups that divide it (issue 26)."""
    if eng.kernels.gemv.dense:
        return "our GEMV reading every row"
    return "F.linear" + (" under inductor" if eng.compile else "")


__all__ = ["PREFILL_CHUNK", "bookkeeping", "calibrate_teal", "dense_step_label", "peak_memory", "timed_step_bytes"]
