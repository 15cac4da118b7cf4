"""`load`: a model reference into an `Engine` with its static cache (engine/engine.py), on
the device and dtype asked, with the kernel options and the configuration given."""

from __future__ import annotations

import time

import torch

from sparsedecode.engine.device import check_dtype, resolve_device, resolve_dtype
from sparsedecode.engine.engine import DEFAULT_MAX_LEN, Engine
from sparsedecode.errors import InputError, option
from sparsedecode.models.args import ModelArgs
from sparsedecode.models.attention import get_backend
from sparsedecode.models.load import Checkpoint


def load(ref, *, device=None, dtype=None, init: str = "pretrained", max_len: int | None = None,
         attention: str = "split_k", compile: bool | str | None = None, seed: int | None = 0,
         quiet: bool = False, config=None, kernels=None) -> Engine:
    """Load `ref` (known name, HF folder, hub id, .gguf file, a config dict with
    init='random', or a `models.load.Checkpoint` already resolved) into an Engine whose static cache holds `max_len` tokens
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
        raise InputError(f"{option('max_len')} must be >= 1 token, got {max_len}")
    ckpt = ref if isinstance(ref, Checkpoint) else resolve(ref, init=init, quiet=quiet)
    mark("resolve_s")
    model, args = build_model(ckpt, dev, dt, seed=seed)
    mark("build_s")
    max_len = max_len or min(args.window, DEFAULT_MAX_LEN)
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


def cache_length(args: ModelArgs, prompt_tokens: int, max_new_tokens: int, max_len: int | None = None) -> int:
    """The cache a generation of `max_new_tokens` after a prompt of `prompt_tokens` needs, known
    before the model loads: `max_len` when given and large enough, else the default
    (min(window, 4096)) grown to the prompt plus its answer. A request past the model's window, or
    past a `max_len` given, is refused with the numbers and what to change."""
    window, need = args.window, prompt_tokens + max_new_tokens
    asked = (f"the prompt ({prompt_tokens} tokens) plus {option('max_new_tokens', max_new_tokens)} needs a "
             f"cache of {need} tokens")
    if need > window:
        fix = (f"give {option('max_new_tokens', window - prompt_tokens)} or less, or shorten the prompt"
               if prompt_tokens < window else f"shorten the prompt below {window} tokens")
        raise InputError(f"{asked}, more than the model window of {window} tokens ({args.name}); {fix}")
    if max_len is None:
        return max(min(window, DEFAULT_MAX_LEN), need)
    args.check_length(max_len)
    if need > max_len:
        raise InputError(f"{asked}, more than {option('max_len', max_len)}; give {option('max_len', need)} or "
                         f"more (the model window is {window}), leave {option('max_len')} out to size the "
                         "cache to the prompt, or shorten the prompt or the answer")
    return max_len


__all__ = ["cache_length", "load"]
