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
         quiet: bool = False, config=None, kernels=None, batch: int = 1, adapter=None) -> Engine:
    """Load `ref` (known name, HF folder, hub id, .gguf file, a config dict with
    init='random', or a `models.load.Checkpoint` already resolved) into an Engine whose static cache holds `max_len` tokens
    (default min(model window, 4096)). `compile` defaults to True on CUDA; a string
    is taken as the torch.compile mode. `config` (a `SparsityConfig` or its text, e.g.
    'proj[t.safetensors]' or 'both0.5/0.3') is installed by `Engine.configure`; a gate that
    chooses per request belongs to whoever generates or serves (`dispatch.runtime.load_gate`,
    `Engine.generate(..., gate=)`). `kernels` (a
    `kernels.options.KernelOptions`; default: the defaults) is what every kernel launches with
    (`Engine.set_kernels`). On CUDA, load also pays what the first KV selection would
    (`kv.apply.warm_selection`: Triton's setup, the score and sort kernels' first launch).
    `batch`: the sequences one decode step runs (ByteCross App. F; `Engine.generate_batch`),
    the cache holding `max_len` tokens for each; refused before allocation where the cache would
    not fit the device's free memory. `adapter` (a LoRA folder written by `sparsedecode finetune`, or
    the config's lora[DIR] part; 'random:r16:all' for a seeded random one, timing's stand-in) is
    merged into the base weights here, before any projection branch, or with `kernels`'
    lora.merge=false kept apart and added by each adapted site's GEMV (`Engine.attach_adapter`):
    the engine runs base + adapter on every path for its lifetime (`projection.lora`); one made
    for another model is refused."""
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
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise InputError(f"{option('batch')} must be a whole number >= 1 (sequences per decode step), got {batch!r}")
    if batch > 1 and attention != "split_k":
        raise InputError(f"a decode batch attends with split_k; drop {option('attention', attention)} or load with batch=1")
    adapter = _adapter_of(adapter, config)  # a bad folder fails before the model loads
    ckpt = ref if isinstance(ref, Checkpoint) else resolve(ref, init=init, quiet=quiet)
    mark("resolve_s")
    model, args = build_model(ckpt, dev, dt, seed=seed)
    merge = kernels is None or kernels.lora.merge
    if adapter is not None:
        from sparsedecode.projection.lora import merge_, random_adapter

        if isinstance(adapter, str):  # a random adapter's name: built for these dims
            adapter = random_adapter(adapter, args.dims(), seed=seed or 0)
        if merge:
            merge_(model, adapter, args.dims())  # into the dense weights, before any layout
        else:
            adapter.check(args.dims())  # kept apart: attached to the sites below
    mark("build_s")
    max_len = max_len or min(args.window, DEFAULT_MAX_LEN)
    args.check_length(max_len)
    check_cache_memory(args, max_len, batch, dt, dev)
    if dev.type == "cpu":
        model.column_major_()  # faster one-token GEMV on CPU; same values and shapes
    model.setup_cache(max_len, batch=batch, attention=attention)
    mark("cache_s")
    tokenizer = load_tokenizer(ckpt) if ckpt.kind != "random" else None
    eos = list(args.eos_ids) + list(extra_eos_ids(ckpt))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.append(tokenizer.eos_token_id)
    eng = Engine(model, args, tokenizer=tokenizer, source_path=ckpt.source, device=dev, dtype=dt,
                 attention=attention, name=ckpt.name, init=init, eos_ids=eos, compile=compile, kernels=kernels)
    if adapter is not None:
        eng.adapter = adapter
        eng.config = eng.config.with_(adapter=str(adapter.path))
        eng.attach_adapter()  # apart (lora.merge=false): on every adapted site; merged: nothing to do
    mark("engine_s")  # with the tokenizer and the kernels' weight layout
    if dev.type == "cuda":  # a CUDA process's first selection would pay Triton's setup and kernel loads
        from sparsedecode.kv.apply import warm_selection

        warm_selection(eng)
        mark("warm_kv_s")
    eng.load_phases = {name: t - marks[i][1] for i, (name, t) in enumerate(marks[1:])}
    if config is not None:
        eng.configure(config, progress=not quiet)
    return eng


def _adapter_of(adapter, config):
    """The `projection.lora.Adapter` to load: `adapter` (a folder or an Adapter), or the lora[DIR]
    part of `config`; both given and naming other folders is refused. A random adapter's name
    ('random:r16:all', `projection.lora.random_spec`) is checked and returned as text: it is built
    once the model's dims are known."""
    from sparsedecode.config import SparsityConfig
    from sparsedecode.projection.lora import adapter_of, random_spec, same_adapter

    named = None if config is None else SparsityConfig.parse(config).adapter
    if adapter is None and named is None:
        return None
    if adapter is not None and named is not None and not same_adapter(adapter, named):
        raise InputError(f"{option('adapter', str(getattr(adapter, 'path', adapter)))} and the configuration's "
                         f"lora[{named}] name different adapters; give one")
    value = adapter if adapter is not None else named
    if not hasattr(value, "path") and random_spec(value) is not None:
        return str(value)
    return adapter_of(value)


def cache_bytes(args: ModelArgs, max_len: int, batch: int, dtype: torch.dtype) -> int:
    """Bytes of the static KV cache: keys and values of every layer, `batch` rows of `max_len`."""
    return 2 * args.n_layers * batch * args.n_kv_heads * max_len * args.head_dim * dtype.itemsize


def free_bytes(dev: torch.device) -> int | None:
    """Free memory on `dev` (the GPU's, or the host's MemAvailable); None where unknown."""
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_cache_memory(args: ModelArgs, max_len: int, batch: int, dtype: torch.dtype, dev: torch.device) -> None:
    """Refuse, before allocating, a cache that would not fit the device's free memory."""
    need, free = cache_bytes(args, max_len, batch, dtype), free_bytes(dev)
    if free is not None and need > free:
        gib = 2**30
        raise InputError(f"a cache of {batch} x {max_len} tokens needs {need / gib:.2f} GiB and {dev} has "
                         f"{free / gib:.2f} GiB free: lower {option('batch', batch)} or {option('max_len', max_len)}")


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


__all__ = ["cache_bytes", "cache_length", "check_cache_memory", "load"]
