"""Where a decode step's time goes: its kernels under torch.profiler, by kind, against the time
its bytes take at the measured ceiling (issue 26, build item 2; ByteCross §4.4, App. D).

A timed step takes longer than its bytes would at the ceiling. The excess splits three ways,
and a profiled cell records each of them:

    step - byte time = gaps                        (no kernel running: launch and host gaps)
                     + fixed kernels                (norms, rope, copies, elementwise: no weight or KV bytes)
                     + (streaming kernels - byte time)   (GEMVs and attention moving bytes slower than the ceiling)

On CUDA the step's kernels come from CUPTI (CUDA graph replays included); the step time is the
span from the first kernel's start to the last one's end over the profiled steps, and busy
time is the union of the kernel intervals (programmatic dependent launches may overlap).
On CPU there are no kernels: each op's self time (its time outside the ops it calls:
`aten::mm`, `aten::bmm`, ...) stands in for them, and their sum for the busy time; the gap is
then the host's time outside any op (Python, dispatch).
"""

from __future__ import annotations

from collections.abc import Callable

# (kind, streams bytes?, names), first match wins, lower-cased: a kernel name matches a fragment
# it contains; a CPU op ('aten::...') matches its own name exactly, or a prefix ending in '*'.
# Inductor's kernels (triton_poi/red/per_fused_<ops>) are named after the ops they fuse, so the
# dense GEMV/GEMM fragments come last: a fused norm of `sparse_gemv`'s input is not a GEMV.
KINDS: tuple[tuple[str, bool, tuple[str, ...]], ...] = (
    # the CPU step in one C call (kernels/cpu_step.c): one range, its parts unseen by the profiler
    ("C step", True, ("sparsedecode::cpu_step",)),
    ("sparse GEMV", True, ("_sparse_gemv_kernel", "_cats_up_kernel")),
    ("attention", True, ("_split_kernel", "_merge_kernel", "flash", "fmha", "attention", "sdpa",
                         "aten::bmm", "aten::_scaled_dot_product*", "aten::_softmax", "softmax")),
    ("selection", False, ("_lse_kernel", "_colsum_kernel", "topk", "sort")),
    ("rope/cache write", False, ("_rope_cache_kernel", "rope", "aten::index_copy_", "aten::index_put_",
                                 "aten::scatter_", "index_copy", "scatter")),
    ("norm", False, ("rsqrt", "rms_norm", "aten::mean", "aten::pow")),
    ("copy", False, ("memcpy", "memset", "aten::copy_", "aten::fill_", "aten::zero_", "aten::clone",
                     "aten::_to_copy", "aten::cat", "aten::contiguous")),
    ("elementwise", False, ("triton_poi", "triton_red", "triton_per", "elementwise", "vectorized",
                            "aten::mul", "aten::add", "aten::silu", "aten::neg", "aten::div", "aten::div_",
                            "aten::sub", "aten::embedding", "aten::index", "aten::where", "aten::exp",
                            "aten::mul_", "aten::add_")),
    ("views/dispatch", False, ("aten::as_strided", "aten::view", "aten::transpose", "aten::t", "aten::slice",
                               "aten::matmul", "aten::linear", "aten::result_type", "aten::reshape",
                               "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::select", "aten::empty",
                               "aten::empty_strided", "aten::resolve_conj", "aten::resolve_neg",
                               "aten::_unsafe_view", "aten::alias", "aten::detach", "aten::to",
                               "aten::_local_scalar_dense", "aten::item", "aten::lift_fresh")),
    ("dense GEMV/GEMM", True, ("gemv", "gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk",
                               "triton_tem_fused_mm", "aten::mm", "aten::addmm", "aten::mv")),
)
OTHER = "other"
STREAMING = {kind for kind, streams, _ in KINDS if streams}


def _matches(low: str, frag: str) -> bool:
    if not frag.startswith("aten::"):
        return frag in low
    return low.startswith(frag[:-1]) if frag.endswith("*") else low == frag


def kernel_kind(name: str) -> tuple[str, bool]:
    """(kind, whether it streams weight or KV bytes) of a kernel or op name; ('other', False)
    when nothing in `KINDS` matches."""
    low = name.lower()
    for kind, streams, frags in KINDS:
        if any(_matches(low, f) for f in frags):
            return kind, streams
    return OTHER, False


def _union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def _exclusive(kernels: list[tuple[str, float, float]], timeline: bool):
    """(name, own µs, launched µs) of each kernel. On a timeline a kernel owns the part of its
    interval that no kernel started before it still covers: a programmatic dependent launch
    (PDL) starts while its predecessor runs and waits for it, and that wait is the
    predecessor's time, not its own. Host ops (timeline False) own their self time."""
    if not timeline:
        return [(n, e - s, e - s) for n, s, e in kernels]
    out, reach = [], float("-inf")
    for n, s, e in sorted(kernels, key=lambda k: (k[1], k[2])):
        out.append((n, max(e - max(s, reach), 0.0), e - s))
        reach = max(reach, e)
    return out


def summarize(kernels: list[tuple[str, float, float]], steps: int, byte_us: float | None,
              span_us: float | None = None, top: int = 25) -> dict:
    """The profile record from `kernels` as (name, start µs, end µs) over `steps` steps: per step
    the span, busy and gap µs, µs by kind (each kernel's own time, `_exclusive`: the kinds add up
    to the busy time), the `top` kernels by own time (`launched_us`: start to end, waits
    included), and against `byte_us` (the
    step's bytes at the ceiling, per step) the excess split into gaps, fixed kernels and the
    streaming kernels' time past the byte time. `span_us` overrides the span (CPU: host time)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if not kernels:
        raise RuntimeError("the profiler saw no kernels in the profiled steps")
    if span_us is None:  # device kernels on one timeline: span and covered time
        step = (max(e for _, _, e in kernels) - min(s for _, s, _ in kernels)) / steps
        busy = _union([(s, e) for _, s, e in kernels]) / steps
    else:  # host ops: the host time per step, and the ops' self times
        step, busy = span_us, sum(e - s for _, s, e in kernels) / steps
    by_name: dict[str, list[tuple[float, float]]] = {}
    for name, own, whole in _exclusive(kernels, timeline=span_us is None):
        by_name.setdefault(name, []).append((own, whole))
    table, kinds, streaming = [], {}, 0.0
    for name, ts in by_name.items():
        kind, streams = kernel_kind(name)
        us = sum(t for t, _ in ts) / steps
        kinds[kind] = kinds.get(kind, 0.0) + us
        streaming += us if streams else 0.0
        table.append({"name": name[:160], "kind": kind, "launches": len(ts) / steps, "us": us,
                      "launched_us": sum(w for _, w in ts) / steps})
    table.sort(key=lambda k: -k["us"])
    out = {"steps": steps, "step_us": step, "busy_us": busy, "gap_us": max(step - busy, 0.0),
           "launches": len(kernels) / steps, "kinds_us": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
           "streaming_us": streaming, "fixed_us": sum(kinds.values()) - streaming, "kernels": table[:top]}
    if byte_us is not None:
        out["byte_us"] = byte_us
        out["excess_us"] = step - byte_us
        out["streaming_excess_us"] = streaming - byte_us
    return out


def profile_steps(step: Callable[[], object], steps: int, cuda: bool, byte_us: float | None) -> dict:
    """Run `step` `steps` times under torch.profiler (after one unprofiled call) and summarize
    its kernels (`summarize`); on CPU its leaf ops and the host time per step."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    step()
    if cuda:
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
        host_us = (time.perf_counter() - t) * 1e6 / steps
    events = prof.events()
    if cuda:
        kernels = [(e.name, e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA]
        rec = summarize(kernels, steps, byte_us)
    else:
        ops = [(e.name, e.time_range.start, e.time_range.start + e.self_cpu_time_total) for e in events
               if e.device_type == torch.autograd.DeviceType.CPU and e.self_cpu_time_total > 0]
        rec = summarize(ops, steps, byte_us, span_us=host_us)
    rec["clock"] = "CUPTI kernel times" if cuda else "host time; CPU op self times"
    rec["host_us"] = host_us
    return rec


def step_profiles(cc, ceiling: float | None) -> list[dict]:
    """Where each profiled cell's step goes (`profile_steps`, issue 26 item 2), mean over the
    blocks that profiled it: the profiled step, its bytes at the measured ceiling, and the time
    above that split into gaps (no kernel running), fixed kernels (no weight or KV bytes; the
    two largest kinds named) and the streaming kernels' time past the byte time, with those
    kernels' (kind, µs) largest first. `cc`: a campaign's cells (`timing.cells.load_cells`)."""
    import numpy as np

    by: dict[tuple, list] = {}
    for c in cc.cells:
        x = cc.extra(c)
        if x.profile:
            by.setdefault((c.context, c.group, c.cell), []).append(x)
    rows = []
    for (n, group, cell), xs in sorted(by.items()):
        ps = [x.profile for x in xs]
        mean = lambda k, ps=ps: float(np.mean([p[k] for p in ps]))  # noqa: E731
        kinds: dict[str, float] = {}
        for p in ps:
            for k, us in p["kinds_us"].items():
                kinds[k] = kinds.get(k, 0.0) + us / len(ps)
        byte_us = (float(np.mean([x.bytes_per_step for x in xs])) / (ceiling * 1e9) * 1e6
                   if ceiling and all(x.bytes_per_step for x in xs) else None)
        step, streaming = mean("step_us"), mean("streaming_us")
        ranked = sorted(kinds.items(), key=lambda kv: -kv[1])
        fixed = [(k, us) for k, us in ranked if k not in STREAMING]
        rows.append({"context": n, "group": group, "cell": cell, "blocks": len(ps), "clock": ps[0].get("clock"),
                     "step_us": step, "byte_us": byte_us, "above_us": None if byte_us is None else step - byte_us,
                     "gap_us": mean("gap_us"), "fixed_us": mean("fixed_us"), "largest_fixed": fixed[:2],
                     "streaming_kinds": [(k, us) for k, us in ranked if k in STREAMING],
                     "streaming_us": streaming,
                     "streaming_past_us": None if byte_us is None else streaming - byte_us,
                     "launches": mean("launches"), "kinds_us": kinds})
    return rows


__all__ = ["KINDS", "STREAMING", "kernel_kind", "profile_steps", "step_profiles", "summarize"]
