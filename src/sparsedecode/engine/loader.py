"""`load`: a model reference into an `Engine` with its static cache (engine/engine.py), on
the device and dtype asked, with the kernel options and the configuration given."""

from __future__ import annotations

import time

import torch

from sparsedecode.engine.device import check_dtype, resolve_device, resolve_dtype
from sparsedecode.engine.engine import DEFAULT_MAX_LEN, Engine
from sparsedecode.errors import InputError
from sparsedecode.models.attention import get_backend


def load(ref, *, device=None, dtype=None, init: str = "pretrained", max_len: int | None = None,
         attention: str = "split_k", compile: bool | str | None = None, seed: int | None = 0,
         quiet: bool = False, config=None, kernels=None) -> Engine:
    """Load `ref` (known name, HF folder, hub id, .gguf file, or a config dict with
    init='random') into an Engine whose static cache holds `max_len` tokens
    (default min(model window, 4096)). `compile` defaults to True on CUDA; a string
    is taken as the torch.compile mode. `config` (a `SparsityConfig` or its text, e.g.
    'proj[t.safetensors]' or 'both0.5/0.3') is installed by `Engine.configure`; a gate that
    chooses per request belongs to whoever generates or serves (`dispatch.runtime.load_gate`,
    `Engine.generate(..., gate=)`). `kernels` (a
    `kernels.options.KernelOptions`; default: the defaults) is what every kernel launches with
    (`Engine.set_kernels`). On CUDA, load also pays what the first KV selection would
    (`kv.apply.warm_selection`: Triton's setup, the score and sort kernels' first launch)."""
    from sparsedecode.models.load import build_model, extra_eos_ids, load_tokenizer, resolve

    get_backend(attention)  # an unknown backend fails before any download
    marks = [("start", time.perf_counter())]
    dev = resolve_device(device)

    def mark(name: str) -> None:  # where the time went, phase by phase (Engine.load_phases)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        marks.append((name, time.perf_counter()))

    dt = resolve_dtype(dtype, dev)
    check_dtype(dev, dt)
    if max_len is not None and max_len < 1:
        raise InputError(f"max_len must be >= 1, got {max_len}")
    ckpt = resolve(ref, init=init, quiet=quiet)
    mark("resolve_s")
    model, args = build_model(ckpt, dev, dt, seed=seed)
    mark("build_s")
    max_len = max_len or min(args.max_position, DEFAULT_MAX_LEN)
    args.check_length(max_len)
    if dev.type == "cpu":
        model.column_major_()  # faster one-token GEMV on CPU; same values and shapes
    model.setup_cache(max_len, batch=1, attention=attention)
    mark("cache_s")
    tokenizer = load_tokenizer(ckpt) if ckpt.kind != "random" else None
    eos = list(args.eos_ids) + list(extra_eos_ids(ckpt))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.append(tokenizer.eos_token_id)
    eng = Engine(model, args, tokenizer=tokenizer, source_path=ckpt.source, device=dev, dtype=dt,
                 attention=attention, name=ckpt.name, init=init, eos_ids=eos, compile=compile, kernels=kernels)
    mark("engine_s")  # with the tokenizer and the kernels' weight layout
    if dev.type == "cuda":  # a CUDA process's first selection would pay Triton's setup and kernel loads
        from sparsedecode.kv.apply import warm_selection

        warm_selection(eng)
        mark("warm_kv_s")
    eng.load_phases = {name: t - marks[i][1] for i, (name, t) in enumerate(marks[1:])}
    if config is not None:
        eng.configure(config, progress=not quiet)
    return eng


__all__ = ["load"]
