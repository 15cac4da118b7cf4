"""What every 'timing_cell' record carries, whoever's decode step it times: ours
(`timing.cell.run_cell`) and the peers' (`timing.peer`) alike, so reports set them side by side.
Both runners import it; neither imports the other's internals.
"""

from __future__ import annotations


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


__all__ = ["bookkeeping", "peak_memory", "timed_step_bytes"]
