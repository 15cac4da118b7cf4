"""The peer a dense step is held against: Hugging Face transformers, compiled, with a StaticCache.

A cell with `impl = "transformers"` times the model's `forward` one token at a time the way
transformers documents for fast decoding: `torch.compile(mode="reduce-overhead")` (CUDA
graphs) over a `StaticCache` sized to the cell, on CUDA; eager on CPU. Random weights from the
same config as our engine's (bytes per step do not depend on values), the cache filled with
seeded normal keys and values, the same warm-up, repeats and steps as our cells, and the same
record fields, so reports set it beside our dense cell of the same block and context (ByteCross
App. A 'Timing': the baseline is the strongest dense step available).
"""

from __future__ import annotations

import inspect
import statistics
import time
from dataclasses import asdict

from sparsedecode.errors import InputError


def check_peer(spec) -> None:
    """What a transformers cell can time: dense, random weights of a known config, a random fill."""
    if spec.mode != "dense":
        raise InputError(f"the transformers peer times the dense step only, not {spec.mode}: give mode dense")
    if spec.init != "random" or spec.fill != "random":
        raise InputError("the transformers peer builds random weights and fills its StaticCache with seeded "
                         "random keys and values: use init = 'random' and fill = 'random'")
    if spec.kernels:
        raise InputError("kernel options are ours; the transformers peer takes none (drop --kernels)")


def run_peer_cell(spec, log=None) -> dict:
    """Time the transformers decode step of `spec` and return its 'timing_cell' record."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, StaticCache

    from sparsedecode.account.dims import ModelDims
    from sparsedecode.account.known import known_model
    from sparsedecode.engine.device import resolve_device, resolve_dtype
    from sparsedecode.records import stamp
    from sparsedecode.timing.cell import _bookkeeping, _peak_memory, check_fits, timed_step_bytes
    from sparsedecode.timing.clock import time_blocks

    say = log or (lambda line: None)
    check_fits(spec)  # check_peer, and the model window
    dev = resolve_device(spec.device)
    dt = resolve_dtype(spec.dtype, dev)
    cuda = dev.type == "cuda"
    n, generated = spec.context, spec.generated
    km = known_model(spec.model)
    dims = ModelDims.known(km.name)
    torch.manual_seed(spec.seed)
    t = time.perf_counter()
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**dict(km.config)), dtype=dt).eval()
    one_time = {"load_s": time.perf_counter() - t, "prefill_s": 0.0, "calibrate_s": 0.0, "select_s": 0.0}
    cache = StaticCache(config=model.config, max_cache_len=n + generated)
    # transformers 5.24 renamed forward's past_key_values to cache (5.17, on the H200, has the old name)
    kv = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    tok = torch.ones(1, 1, dtype=torch.long, device=dev)  # (1, 1)
    cpos = torch.tensor([n], dtype=torch.long, device=dev)  # (1,)
    with torch.inference_mode():  # one eager token allocates the cache's layers
        model(input_ids=tok, cache_position=torch.zeros(1, dtype=torch.long, device=dev), use_cache=True, **{kv: cache})
        gen = torch.Generator(dev).manual_seed(spec.seed)
        for layer in cache.layers:  # inference tensors: filled in inference mode
            layer.keys.normal_(generator=gen)
            layer.values.normal_(generator=gen)
    fwd = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True) if cuda else model.forward

    def step():
        if cuda:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.inference_mode():
            return fwd(input_ids=tok, position_ids=cpos.view(1, 1), cache_position=cpos, use_cache=True,
                       **{kv: cache}).logits

    t = time.perf_counter()
    for _ in range(3 if cuda else 1):  # compile, record, replay
        step()
    if cuda:
        torch.cuda.synchronize(dev)
    one_time["capture_s"] = time.perf_counter() - t
    say(f"transformers step compiled and captured in {one_time['capture_s']:.1f} s")
    step_ms = time_blocks(step, spec.warmup, spec.repeats, spec.steps, cuda)
    tps = [1e3 / ms for ms in step_ms]
    med = statistics.median(step_ms)
    nbytes = timed_step_bytes(dims, n, 1.0, 1.0, dt.itemsize, dt.itemsize)
    gpu = torch.cuda.get_device_name(dev) if cuda else "CPU"
    return stamp({
        "kind": "timing_cell", "status": "ok", "impl": "transformers", **_bookkeeping(spec),
        "model": {"name": km.name, "dims": dims.to_dict(), "init": "random"}, "model_name": km.name,
        "dtype": str(dt).removeprefix("torch."), "device": dev.type, "gpu": gpu,
        "label": (gpu.removeprefix("NVIDIA ") if cuda else "CPU") + " transformers",
        "mode": "dense", "mode_spec": "dense", "projection_keep": 1.0, "kv_keep": 1.0,
        "attention": getattr(model.config, "_attn_implementation", None) or "transformers",
        "compile_mode": "reduce-overhead" if cuda else "", "compiled": cuda,
        "runtime": "CUDA graph" if cuda else "eager", "context": n, "generated": generated, "fill": "random",
        "cache": "StaticCache",
        "protocol": f"{spec.warmup} warm-up steps, {spec.repeats} repeats x {spec.steps} steps, "
                    + ("CUDA events" if cuda else "perf_counter") + "; the position stays at n (a static step)",
        "step_ms_runs": step_ms, "tokens_per_sec_runs": tps, "tokens_per_sec": statistics.fmean(tps),
        "ms_per_token": 1e3 / statistics.fmean(tps), "step_ms_median": med,
        "realized_projection_keep": 1.0, "kv_budget": n, "kv_read_fraction": 1.0, "bytes_per_step": nbytes,
        "byte_bound": 1.0, "achieved_gbps": nbytes / (med * 1e-3) / 1e9, "peak_memory_bytes": _peak_memory(dev),
        "one_time": one_time, "spec": asdict(spec),
    })
