"""The peers a dense step is held against (ByteCross App. A 'Timing': the baseline is the
strongest dense step available).

`impl = "transformers"`: the model's `forward` one token at a time the way transformers
documents for fast decoding, `torch.compile(mode="reduce-overhead")` (CUDA graphs) over a
`StaticCache` sized to the cell, on CUDA; eager on CPU.

`impl = "graph"`: the step a performance engineer writes by hand in plain PyTorch (what
gpt-fast-style decoders do): per layer RMSNorm, `F.linear` for q, k, v, o, gate, up and down,
RoPE, the new key and value written into a static cache, `F.scaled_dot_product_attention` over
it, the LM head; the whole step captured once in a CUDA graph and replayed. CUDA only. Its
attention takes the fastest of SDPA's forms at the cell's shape, timed on one layer before the
capture (`ATTENDS`: each KV head's query group as the query length, or `enable_gqa`, under the
flash, memory-efficient, cuDNN and math backends), as a careful engineer would; the record says
which.

Both: random weights of the same config as our engine's (bytes per step do not depend on
values), the cache filled with seeded normal keys and values, the same warm-up, repeats and
steps as our cells, and the same record fields, so reports set them beside our dense cell of
the same block and context.
"""

from __future__ import annotations

import contextlib
import inspect
import statistics
import time
from dataclasses import asdict

from sparsedecode.errors import InputError, option


def check_peer(spec) -> None:
    """What a peer cell can time: dense, random weights of a known config, a random fill; the
    hand-written graph step on CUDA only."""
    if spec.mode != "dense":
        raise InputError(f"the {spec.impl} peer times the dense step only, not {spec.mode}: give mode dense")
    if spec.init != "random" or spec.fill != "random":
        raise InputError(f"the {spec.impl} peer builds random weights and fills its cache with seeded "
                         "random keys and values: use init = 'random' and fill = 'random'")
    if spec.kernels:
        raise InputError(f"kernel options are ours; the {spec.impl} peer takes none (drop {option('kernels')})")
    if spec.impl == "graph" and spec.device not in ("cuda", "auto") and not spec.device.startswith("cuda:"):
        raise InputError(f"the graph peer captures a CUDA graph: give a CUDA device, not {spec.device}")


def run_peer_cell(spec, log=None) -> dict:
    """Time the peer decode step of `spec` (its impl) and return its 'timing_cell' record;
    `timing.cell.run_cell` has checked that it fits (`check_fits`)."""
    import torch

    from sparsedecode.account.dims import ModelDims
    from sparsedecode.account.known import known_model
    from sparsedecode.engine.device import resolve_device, resolve_dtype
    from sparsedecode.timing.clock import time_blocks
    from sparsedecode.timing.neighbors import watched

    say = log or (lambda line: None)
    dev = resolve_device(spec.device)
    dt = resolve_dtype(spec.dtype, dev)
    cuda = dev.type == "cuda"
    n, generated = spec.context, spec.generated
    km = known_model(spec.model)
    dims = ModelDims.known(km.name)
    torch.manual_seed(spec.seed)
    if spec.impl == "graph":
        if not cuda:
            raise InputError(f"the graph peer captures a CUDA graph: {dev} is not a CUDA device")
        step, one_time, attention = _graph_step(dims, dict(km.config), n + 1, dt, dev, spec.seed, say)
        step_ms, seen = watched(dev, spec.shared_gpu,
                                lambda: time_blocks(step, spec.warmup, spec.repeats, spec.steps, cuda))
        rec = _record(spec, km.name, dims, dt, dev, step_ms, one_time, attention=f"sdpa {attention['form']}",
                      compile_mode="", runtime="CUDA graph", cache=f"static, {n + 1} slots")
        return {**rec, "gpu_neighbors": seen, "peer_attention": attention}
    from transformers import AutoConfig, AutoModelForCausalLM, StaticCache

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
    step_ms, seen = watched(dev, spec.shared_gpu, lambda: time_blocks(step, spec.warmup, spec.repeats, spec.steps, cuda))
    rec = _record(spec, km.name, dims, dt, dev, step_ms, one_time,
                  attention=getattr(model.config, "_attn_implementation", None) or "transformers",
                  compile_mode="reduce-overhead" if cuda else "", runtime="CUDA graph" if cuda else "eager",
                  cache="StaticCache")
    return {**rec, "gpu_neighbors": seen}


ATTENDS = ("grouped", "gqa")  # how the peer lays the query heads out for SDPA (graph_forward)
BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")


def _fastest_attention(dims, slots: int, dt, dev, say) -> tuple[str, str, dict]:
    """(attend, backend, {form: us}) of the fastest SDPA form at one layer's decode shape (q of one
    token, `slots` keys), each timed over 20 calls by CUDA events; forms a backend refuses are left
    out of the table."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kvh, g, hd = dims.n_kv_heads, dims.n_heads // dims.n_kv_heads, dims.head_dim
    kc = torch.randn(1, kvh, slots, hd, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    qs = {"grouped": torch.randn(1, kvh, g, hd, device=dev, dtype=dt),
          "gqa": torch.randn(1, kvh * g, 1, hd, device=dev, dtype=dt)}
    table = {}
    for attend in ATTENDS:
        for backend in BACKENDS:
            try:
                with sdpa_kernel([getattr(SDPBackend, backend)]):
                    q, gqa = qs[attend], attend == "gqa"
                    call = lambda q=q, gqa=gqa: F.scaled_dot_product_attention(q, kc, vc, enable_gqa=gqa)  # noqa: E731
                    call()
                    torch.cuda.synchronize(dev)
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    for _ in range(20):
                        call()
                    b.record()
                    torch.cuda.synchronize(dev)
            except RuntimeError:
                continue
            table[f"{attend}/{backend}"] = a.elapsed_time(b) / 20 * 1e3
    if not table:
        raise InputError(f"no SDPA backend runs a {slots}-key decode attention on {dev}")
    best = min(table, key=table.__getitem__)
    say(f"hand-written step's attention: {best} ({table[best]:.1f} us a layer)")
    attend, backend = best.split("/")
    return attend, backend, table


def _graph_step(dims, config: dict, slots: int, dt, dev, seed: int, say):
    """The hand-written dense step (module doc) over a cache of `slots` positions, the new token
    at the last one, captured in a CUDA graph: (replay, one_time, attention)."""
    import torch

    t = time.perf_counter()
    attend, backend, table = _fastest_attention(dims, slots, dt, dev, say)
    forward, _ = graph_forward(dims, config, slots, dt, dev, seed, attend=attend, backend=backend)
    one_time = {"load_s": time.perf_counter() - t, "prefill_s": 0.0, "calibrate_s": 0.0, "select_s": 0.0}
    t = time.perf_counter()
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.inference_mode(), torch.cuda.stream(side):
        for _ in range(3):  # warm the kernels (and cuBLAS workspaces) before capture
            forward()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        forward()
    torch.cuda.synchronize(dev)
    one_time["capture_s"] = time.perf_counter() - t
    say(f"hand-written step captured in {one_time['capture_s']:.1f} s")
    return graph.replay, one_time, {"form": f"{attend}/{backend}", "us_per_layer": table}


def graph_forward(dims, config: dict, slots: int, dt, dev, seed: int, *, attend: str = "grouped",
                  backend: str | None = None):
    """The hand-written step's forward, uncaptured, and its weights: (forward, (emb, head, norm,
    layers)), each layer (wq, wk, wv, wo, wg, wu, wd, norm1, norm2, k_cache, v_cache) with the
    caches (1, kv_heads, slots, head_dim) and the token at slot slots - 1. Plain RoPE at the
    config's theta (a scaled RoPE reads the same bytes). attend: 'grouped' (each KV head's query
    group as SDPA's query length, no key copied) or 'gqa' (one query per head, `enable_gqa`);
    backend: an `SDPBackend` name SDPA is held to, or None for its own choice."""
    import torch
    import torch.nn.functional as F

    d, hd, h, kvh, ff = dims.d, dims.head_dim, dims.n_heads, dims.n_kv_heads, dims.d_ff
    g = h // kvh
    gen = torch.Generator(dev).manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32) * 0.02).to(dt)

    emb, head, norm = w(dims.vocab, d), w(dims.vocab, d), torch.ones(d, device=dev, dtype=dt)
    layers = []
    for _ in range(dims.n_layers):
        kc = torch.empty(1, kvh, slots, hd, device=dev, dtype=dt).normal_(generator=gen)
        vc = torch.empty(1, kvh, slots, hd, device=dev, dtype=dt).normal_(generator=gen)
        layers.append((w(h * hd, d), w(kvh * hd, d), w(kvh * hd, d), w(d, h * hd), w(ff, d), w(ff, d), w(d, ff),
                       torch.ones(d, device=dev, dtype=dt), torch.ones(d, device=dev, dtype=dt), kc, vc))
    pos = slots - 1
    inv = 1.0 / float(config.get("rope_theta", 10000.0)) ** (torch.arange(0, hd, 2, device=dev) / hd)
    ang = pos * inv
    cos, sin = torch.cat([ang.cos(), ang.cos()]).to(dt), torch.cat([ang.sin(), ang.sin()]).to(dt)
    slot = torch.tensor([pos], device=dev)
    tok = torch.ones(1, dtype=torch.long, device=dev)
    eps = float(config.get("rms_norm_eps", 1e-5))

    def rope(x):  # (..., hd), rotate-half
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    if attend not in ATTENDS:
        raise InputError(f"attend must be one of {', '.join(ATTENDS)}, got {attend!r}")
    grouped = attend == "grouped"
    if backend is None:
        held = contextlib.nullcontext
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        held = lambda: sdpa_kernel([getattr(SDPBackend, backend)])  # noqa: E731

    def forward():
        x = emb[tok]  # (1, d)
        for wq, wk, wv, wo, wg, wu, wd, n1, n2, kc, vc in layers:
            a = F.rms_norm(x, (d,), n1, eps)
            q = rope(F.linear(a, wq).view(1, kvh, g, hd) if grouped else F.linear(a, wq).view(1, h, 1, hd))
            k = rope(F.linear(a, wk).view(1, kvh, 1, hd))
            kc.index_copy_(2, slot, k)
            vc.index_copy_(2, slot, F.linear(a, wv).view(1, kvh, 1, hd))
            with held():  # every slot is in the past: no mask
                o = F.scaled_dot_product_attention(q, kc, vc, enable_gqa=not grouped)
            x = x + F.linear(o.reshape(1, h * hd), wo)
            a = F.rms_norm(x, (d,), n2, eps)
            x = x + F.linear(F.silu(F.linear(a, wg)) * F.linear(a, wu), wd)
        return F.linear(F.rms_norm(x, (d,), norm, eps), head)

    return forward, (emb, head, norm, layers)


def _record(spec, name, dims, dt, dev, step_ms, one_time, *, attention, compile_mode, runtime, cache) -> dict:
    """The peer's 'timing_cell' record: the fields of ours, impl and label saying whose step."""
    import torch

    from sparsedecode.records import stamp
    from sparsedecode.timing.cell_fields import bookkeeping, peak_memory, timed_step_bytes

    cuda = dev.type == "cuda"
    n, generated = spec.context, spec.generated
    tps = [1e3 / ms for ms in step_ms]
    med = statistics.median(step_ms)
    nbytes = timed_step_bytes(dims, n, 1.0, 1.0, dt.itemsize, dt.itemsize)
    gpu = torch.cuda.get_device_name(dev) if cuda else "CPU"
    return stamp({
        "kind": "timing_cell", "status": "ok", "impl": spec.impl, **bookkeeping(spec),
        "model": {"name": name, "dims": dims.to_dict(), "init": "random"}, "model_name": name,
        "dtype": str(dt).removeprefix("torch."), "device": dev.type, "gpu": gpu,
        "label": (gpu.removeprefix("NVIDIA ") if cuda else "CPU") + f" {spec.impl}",
        "mode": "dense", "mode_spec": "dense", "projection_keep": 1.0, "kv_keep": 1.0,
        "attention": attention, "compile_mode": compile_mode, "compiled": bool(compile_mode) or spec.impl == "graph",
        "runtime": runtime, "dense_step": {"graph": "hand-written F.linear + SDPA",
                                           "transformers": "transformers forward"}[spec.impl],
        "context": n, "generated": generated, "fill": "random", "cache": cache,
        "protocol": f"{spec.warmup} warm-up steps, {spec.repeats} repeats x {spec.steps} steps, "
                    + ("CUDA events" if cuda else "perf_counter") + "; the position stays at n (a static step)",
        "step_ms_runs": step_ms, "tokens_per_sec_runs": tps, "tokens_per_sec": statistics.fmean(tps),
        "ms_per_token": 1e3 / statistics.fmean(tps), "step_ms_median": med,
        "realized_projection_keep": 1.0, "kv_budget": n, "kv_read_fraction": 1.0, "bytes_per_step": nbytes,
        "byte_bound": 1.0, "achieved_gbps": nbytes / (med * 1e-3) / 1e9, "peak_memory_bytes": peak_memory(dev),
        "one_time": one_time, "spec": asdict(spec),
    })
