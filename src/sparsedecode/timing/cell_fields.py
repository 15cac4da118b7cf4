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


def calibrate_own(eng, spec, keep: float):
    """Thresholds of the cell's method (`spec.method`: uniform TEAL, or CATS/SATS on SiLU(gate)) at
    `keep` on the model's own activations (`own_thresholds`), as a timing cell (`spec`, a
    `timing.cell.CellSpec`) calibrates them; (thresholds, what the record says)."""
    from sparsedecode.projection.calibrate import own_thresholds

    method = spec.method
    th, what = own_thresholds(eng, keep, method, tokens=spec.calib_tokens, seed=spec.seed, text_file=spec.text)
    return th, {"method": th.method, "keep": keep, "ids": what, "text": th.calibration.get("text"),
                "tokens": spec.calib_tokens}


def dense_step_label(eng) -> str:
    """What runs the projections of `eng` that hold no threshold (every one of a dense step):
    the words a report prints beside the speedups that divide it (issue 26)."""
    if eng.kernels.gemv.dense:
        return "our GEMV reading every row"
    return "F.linear" + (" under inductor" if eng.compile else "")


def stream_ids(eng, spec, count: int) -> tuple[list[int], str]:
    """The first `count` token ids of a cell's stream (WikiText-2 test, or the text option, when
    the model has a tokenizer; seeded random ids otherwise), wrapped around when short, and what
    they are."""
    import math

    import torch

    if eng.tokenizer is not None:
        from sparsedecode.corpus import wikitext_ids, wikitext_path

        ids = list(wikitext_ids(eng.tokenizer, "test", spec.text))
        what = wikitext_path("test", spec.text).name
    else:
        gen = torch.Generator().manual_seed(spec.seed)
        ids = torch.randint(0, eng.dims.vocab, (count,), generator=gen).tolist()
        what = f"random ids (seed {spec.seed})"
    if len(ids) < count:
        ids = (ids * math.ceil(count / len(ids)))[:count]
        what += " (wrapped)"
    return ids[:count], what


def engine_fields(spec, eng, mode, dev) -> dict:
    """The fields of an ok 'timing_cell' record that say what ran (`timing.cell` and
    `timing.batch_cell` alike): the cell's place, the model, device, mode and kernels."""
    import torch

    cuda = dev.type == "cuda"
    gpu = torch.cuda.get_device_name(dev) if cuda else "CPU"
    return {
        "kind": "timing_cell",
        "status": "ok",
        "impl": "ours",
        **bookkeeping(spec),
        "model": {"name": eng.name, "dims": eng.dims.to_dict(), "init": spec.init},
        "model_name": eng.name,
        "dtype": str(eng.dtype).removeprefix("torch."),
        "device": dev.type,
        "gpu": gpu,
        "label": gpu.removeprefix("NVIDIA ") if cuda else "CPU",
        "mode": mode.kind,
        "mode_spec": str(mode),
        "projection_keep": mode.proj_keep,
        "kv_keep": mode.kv_keep,
        "proj_method": mode.proj_method and spec.method,  # what calibrated the keep
        "kv_method": mode.kv_method,
        "attention": spec.attention,
        "kernels": eng.kernels.to_dict(),
        "adapter": None if eng.adapter is None else {**eng.adapter.summary(), "merged": eng.kernels.lora.merge},
        "dense_step": dense_step_label(eng),
    }


__all__ = ["PREFILL_CHUNK", "bookkeeping", "calibrate_own", "dense_step_label", "engine_fields", "peak_memory",
           "stream_ids", "timed_step_bytes"]
