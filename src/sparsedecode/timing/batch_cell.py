"""One timing cell of B sequences: the App. A protocol with a batch dimension (ByteCross §3.3,
App. F; issue 44).

A cell with `batch` B > 1 loads the engine with B cache slots (`sparsedecode.load(..., batch=B)`)
and times the decode step that `BatchDecoder` runs for a server: B sequences, each at its own
position in its own cache row, one captured step on CUDA (the live rows, eagerly, on CPU). The
protocol of `timing.cell` otherwise, row by row:

1. each row b holds its own stretch of the token stream (row b starts (n + generated) x b tokens
   in, App. F's batch drawn from one stream), wrapped around where the stream is short;
2. the fill is that of a batch-1 cell, per row: a dense prefill of the row's first n tokens, or
   seeded normal keys and values (every row at once) with the row's last `obs` positions
   prefilled for real;
3. the projection branch calibrates TEAL thresholds once (slot 0, before the fill) and measures,
   in 8 tracked eager B-row steps, the union of kept channels over the batch (`batch_union`):
   the fraction of projection weight rows the step reads, u_B >= r_P; the KV branch selects
   in every row after its own fill (SnapKV on that row's own observation window) into the row's
   compact region, as a served request does (`BatchDecoder._select`);
4. each timed step feeds every row the next token of its own stretch at its own next position;
   with `profile`, that many more steps at the same positions run under torch.profiler.

Bytes a step reads: the projection weights once at the realized union, the head and norms once,
and B caches (or B selected regions); the byte bound is the dense batch's bytes over those. The
record's `tokens_per_sec` counts the B tokens of a step; `ms_per_token` is 1000 / that, and
`step_ms_median` the step.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict

from sparsedecode.timing.cell_fields import (
    PREFILL_CHUNK,
    calibrate_own,
    engine_fields,
    peak_memory,
    stream_ids,
)
from sparsedecode.timing.clock import process_age_s
from sparsedecode.timing.neighbors import check_alone, device_uuid, neighbors, watched

KEEP_STEPS = 8  # tracked eager steps that measure the union, as a batch-1 cell measures its keep


def batch_union(model, step, steps: int = KEEP_STEPS) -> tuple[float, float]:
    """(union, keep) of the sparse projections of `model` over `steps` calls of `step` (each an
    eager B-row decode step), each site weighted by its parameters: the fraction of projection
    weight rows a batch step reads, and the mean token's keep (ByteCross §3.3: u_B >= r_P).
    With one row the union is the keep."""
    import torch

    from sparsedecode.projection.sparse_linear import sparse_modules

    mods = sparse_modules(model)
    for m in mods:
        m.track = True
        m.reset_keep()
    try:
        with torch.inference_mode():
            for i in range(steps):
                step(i)
        w = [m.in_features * m.out_features for m in mods]
        u = [m.realized_union() for m in mods]
        k = [m.realized_keep() for m in mods]
    finally:
        for m in mods:
            m.track = False
    if any(x != x for x in u):  # one row: its keep is its union
        u = k
    return (sum(a * b for a, b in zip(u, w, strict=True)) / sum(w),
            sum(a * b for a, b in zip(k, w, strict=True)) / sum(w))


def batch_step_bytes(dims, n: int, batch: int, union: float, kv_read: float, weight_bytes: float,
                     kv_bytes: float) -> float:
    """Bytes one step of `batch` sequences at context n reads (§3.3, Eq. 1-4 with a batch): the
    projections once at the union of kept rows, head, embedding rows and norms once, and each
    sequence's cache at the read fraction."""
    from sparsedecode.account.traffic import step_bytes

    b = step_bytes(dims, n, weight_bytes, kv_bytes)
    return b.other + (b.mlp + b.attn) * union + batch * b.kv * kv_read


def row_streams(eng, spec, rows: int) -> tuple[list[list[int]], str]:
    """`rows` stretches of n + generated ids of the stream (`cell_fields.stream_ids`), row b
    starting (n + generated) x b ids in."""
    need = spec.context + spec.generated
    ids, what = stream_ids(eng, spec, need * rows)
    return [ids[b * need:(b + 1) * need] for b in range(rows)], what + f", {rows} rows {need} ids apart"


def run_batch_cell(spec, log=None) -> dict:
    """Run the batch cell `spec` (spec.batch > 1, checked by `timing.cell.run_cell`, which calls
    this) in this process; its 'timing_cell' record."""
    import torch

    import sparsedecode
    from sparsedecode.config import KVConfig
    from sparsedecode.engine.batch import BatchDecoder, Request, _Slot
    from sparsedecode.engine.device import resolve_device
    from sparsedecode.engine.generation import Generation
    from sparsedecode.records import stamp
    from sparsedecode.timing.clock import time_blocks

    say = log or (lambda line: None)
    started = process_age_s()
    mode = spec.parsed
    n, generated, B = spec.context, spec.generated, spec.batch
    dev = resolve_device(spec.device)
    cuda = dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    t = time.perf_counter()
    if cuda:
        torch.empty(1, device=dev)
        check_alone(neighbors(device_uuid(dev)), spec.shared_gpu)
    cuda_init_s = time.perf_counter() - t
    t = time.perf_counter()
    # the batch step is captured whole in a CUDA graph of the eager model (BatchDecoder), not compiled
    eng = sparsedecode.load(spec.model, device=dev, dtype=spec.dtype, init=spec.init, max_len=n + generated,
                            attention=spec.attention, compile=False, seed=spec.seed, quiet=True,
                            kernels=spec.kernel_options, batch=B, adapter=spec.adapter or None)
    sync()
    one_time = {"start_s": started, "cuda_init_s": cuda_init_s, "load_s": time.perf_counter() - t,
                "calibrate_s": 0.0, "prefill_s": 0.0, "select_s": 0.0, "select_warm_s": 0.0,
                "keep_s": 0.0, "capture_s": 0.0, "after_s": 0.0}
    say(f"loaded {eng!r} with {B} slots in {one_time['load_s']:.1f} s")
    dec = BatchDecoder(eng)
    rows, stream = row_streams(eng, spec, B)

    thresholds, calibration = None, None
    if mode.proj_method:  # before the fill: calibration's passes write slot 0
        t = time.perf_counter()
        with dec._on_slot(0):
            thresholds, calibration = calibrate_own(eng, spec, mode.proj_keep)
        sync()
        one_time["calibrate_s"] = time.perf_counter() - t
        say(f"calibrated teal {mode.proj_keep:g} on {calibration['ids']} in {one_time['calibrate_s']:.1f} s")

    kv = None if mode.kv is None else KVConfig(mode.kv.method, mode.kv.keep, {"window": spec.obs})
    if spec.fill == "random":
        eng.fill_random_(spec.seed)
    w = min(spec.obs, n)
    select_s, budget = [], n
    for b in range(B):  # each row filled, then selected on its own observation window
        t = time.perf_counter()
        with dec._on_slot(b):
            if spec.fill == "prefill":
                eng.prefill(rows[b][:n], chunk=PREFILL_CHUNK)
            else:
                eng.prefill(rows[b][n - w:n], chunk=PREFILL_CHUNK, start=n - w)
            sync()
            one_time["prefill_s"] += time.perf_counter() - t
            if kv is not None:
                select_s.append(dec._select(b, kv, generated, n))
        req = Request(ids=rows[b][:n], max_new_tokens=generated, kv=kv)
        dec.slots[b] = _Slot(b, req, Generation(prompt_ids=[]), None, set(), n, rows[b][n])
    say(f"filled {B} rows of {n} tokens ({spec.fill}) in {one_time['prefill_s']:.1f} s")
    selection = None
    if kv is not None:
        from sparsedecode.kv.select import get_selector

        budget = get_selector(kv.method, **kv.params).budget(n, kv.keep, generated)
        one_time["select_s"] = sum(select_s)
        one_time["select_warm_s"] = statistics.median(select_s[1:]) if B > 1 else select_s[0]
        selection = {"first_s": select_s[0], "rows_s": select_s, "warm_s": one_time["select_warm_s"]}
    if thresholds is not None:
        eng.configure(mode.with_(kv=None), thresholds=thresholds)  # the rows select themselves

    def feed(i: int) -> None:  # every row: the next token of its stretch at its own position n + i
        for b, s in enumerate(dec.slots):
            s.pos, s.last = n + i, rows[b][n + i]

    union, keep = 1.0, 1.0
    if thresholds is not None:
        t = time.perf_counter()

        def eager(i):
            feed(i)
            tok = torch.tensor([[s.last] for s in dec.slots], device=dev)
            eng.model(tok, torch.full((B,), n + i, dtype=torch.long, device=dev), None)

        union, keep = batch_union(eng.model, eager, min(KEEP_STEPS, generated))
        sync()
        one_time["keep_s"] = time.perf_counter() - t

    t = time.perf_counter()
    feed(0)
    dec.step()  # the first call captures on CUDA; it rewrites slot n, as step 1 does
    sync()
    one_time["capture_s"] = time.perf_counter() - t
    it = iter(range(generated))

    def timed():
        feed(next(it))
        dec.step()

    step_ms, seen = watched(dev, spec.shared_gpu,
                            lambda: time_blocks(timed, spec.warmup, spec.repeats, spec.steps, cuda))
    t_after = time.perf_counter()
    profiled = None
    if spec.profile:  # the same positions again: the profiled steps read what the timed ones read
        from sparsedecode.timing.profile import profile_steps

        again = iter(range(generated))

        def profiled_step():
            feed(next(again))
            dec.step()

        profiled = profile_steps(profiled_step, spec.profile, cuda, None)
        say(f"profiled {spec.profile} steps: {profiled['step_us']:.0f} us a step, {profiled['gap_us']:.0f} us of it gaps")

    tps = [B * 1e3 / ms for ms in step_ms]
    med = statistics.median(step_ms)
    size = eng.dtype.itemsize
    kv_read = min((budget + generated) / n, 1.0)
    nbytes = batch_step_bytes(eng.dims, n, B, union, kv_read, size, size)
    dense = batch_step_bytes(eng.dims, n, B, 1.0, 1.0, size, size)
    rec = {
        **engine_fields(spec, eng, mode, dev),
        "batch": B,
        "compile_mode": "",
        "compiled": False,
        "runtime": "CUDA graph" if cuda else "eager",
        "context": n,
        "generated": generated,
        "fill": spec.fill,
        "stream": stream,
        "protocol": f"{B} sequences a step; {spec.warmup} warm-up steps, {spec.repeats} repeats x {spec.steps} "
                    "steps, " + ("CUDA events" if cuda else "perf_counter"),
        "step_ms_runs": step_ms,
        "tokens_per_sec_runs": tps,
        "tokens_per_sec": statistics.fmean(tps),
        "ms_per_token": 1e3 / statistics.fmean(tps),
        "step_ms_median": med,
        "realized_projection_keep": keep,  # the mean token's
        "realized_union": union,  # the rows a step reads: what its bytes count
        "union_source": None if thresholds is None else (
            "random weights: tokens' kept channels nearly independent" if spec.init == "random"
            else "the model's own activations on its stream"),
        "kv_budget": budget,
        "kv_read_fraction": kv_read,
        "bytes_per_step": nbytes,
        "byte_bound": dense / nbytes,
        "achieved_gbps": nbytes / (med * 1e-3) / 1e9,
        "peak_memory_bytes": peak_memory(dev),
        "one_time": one_time,
        "selection": selection,
        "calibration": calibration,
        "gpu_neighbors": seen,
        "profile": profiled,  # `timing.profile`: the B-row step's kernels by kind; None unless asked
        "spec": asdict(spec),
    }
    one_time["after_s"] = time.perf_counter() - t_after
    return stamp(rec)


__all__ = ["batch_step_bytes", "batch_union", "run_batch_cell"]
