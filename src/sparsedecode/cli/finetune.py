"""`sparsedecode finetune`: a LoRA adapter trained with the thresholds applied (SATS paper §4.2).

    sparsedecode finetune --model smollm2-135m --thresholds cats50.safetensors --out ft/cats50
    sparsedecode generate --model smollm2-135m --thresholds cats50.safetensors --adapter ft/cats50 -p "..."

Trains on WikiText-2 validation (or --text-file); test stays held out. A stopped run (Ctrl-C,
SIGTERM) saves a checkpoint into --out, and the same command resumes it. torch and peft are
imported inside the command.
"""

from __future__ import annotations

from typing import Annotated

import typer

from sparsedecode.cli.app import app
from sparsedecode.cli.common import (
    COUNT_MAX,
    SEED_MAX,
    TOKENS,
    DeviceOpt,
    JsonOpt,
    TextFileOpt,
    ThreadsOpt,
    ThresholdsOpt,
    apply_threads,
    bounded,
    check_engine_args,
    check_out_dir,
    check_text_file,
    emit_json,
    out_dir,
)
from sparsedecode.errors import InputError


@app.command()
def finetune(
    out: Annotated[str, typer.Option("--out", "-o", metavar="DIR", callback=out_dir, help="Adapter folder to write (peft's layout); a stopped run's checkpoint lives there too.")],
    thresholds: ThresholdsOpt = None,
    model: Annotated[str, typer.Option("--model", "-m", help="Known name, HF folder, hub id or .gguf file.")] = "smollm2-135m",
    rank: Annotated[int, typer.Option("--rank", metavar="R", help="LoRA rank r (>= 1).")] = 16,
    alpha: Annotated[float, typer.Option("--alpha", metavar="A", help="LoRA alpha: the merged delta is (alpha / r)·B·A.")] = 32.0,
    targets: Annotated[str, typer.Option("--targets", metavar="WHICH", help="Projections adapted: mlp (gate, up, down) or all (the seven).")] = "mlp",
    tokens: Annotated[int, typer.Option("--tokens", **TOKENS, help="Training tokens: the first N of the text (e.g. 32K).")] = "32K",
    seq_len: Annotated[int, typer.Option("--seq-len", **TOKENS, help="Tokens per training window.")] = 256,
    batch: Annotated[int, typer.Option("--batch", metavar="N", callback=bounded(1, COUNT_MAX), help="Windows per step.")] = 1,
    steps: Annotated[int, typer.Option("--steps", metavar="N", callback=bounded(1, COUNT_MAX), help="Optimizer steps.")] = 128,
    lr: Annotated[float, typer.Option("--lr", metavar="LR", callback=bounded(0, 1, low_open=True, high_open=True), help="Peak learning rate (AdamW; linear warm-up, cosine decay).")] = 1e-3,
    warmup: Annotated[int, typer.Option("--warmup", metavar="N", callback=bounded(0, COUNT_MAX), help="Warm-up steps.")] = 8,
    seed: Annotated[int, typer.Option("--seed", metavar="S", callback=bounded(0, SEED_MAX), help="Seed of the LoRA init and the window order.")] = 0,
    text_file: TextFileOpt = None,
    device: DeviceOpt = "cpu",
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Fine-tune a LoRA adapter of a sparse model with its thresholds applied in every forward pass.

    CATS/SATS thresholds zero the channels of |SiLU(gate)| at or below theirs before down; TEAL
    thresholds zero the input channels of each projection, for the base weight and the LoRA path
    alike, as the sparse decode step reads them. The text is the first --tokens of WikiText-2
    validation, or of --text-file (a folder's wiki.valid.raw). Weights train in float32. The
    adapter runs with --adapter on generate, eval ppl, eval grid, serve and bench cell."""
    import sparsedecode
    from sparsedecode.corpus import require_tokens, text_ids, wikitext_path
    from sparsedecode.models.load import load_tokenizer, resolve
    from sparsedecode.projection.thresholds import Thresholds
    from sparsedecode.quality.finetune import (
        FinetuneOptions,
        Interrupted,
        finetune,
        stop_on_signals,
    )

    apply_threads(threads)
    if thresholds is None:
        raise InputError("give --thresholds FILE (sparsedecode calibrate --method cats|sats|teal ...): the "
                         "adapter is trained for the sparse model those thresholds make")
    opts = FinetuneOptions(rank=rank, alpha=alpha, targets=targets, tokens=tokens, seq_len=seq_len, batch=batch,
                           steps=steps, lr=lr, warmup=warmup, seed=seed)
    check_out_dir(out, "--out")
    th = Thresholds.load(thresholds)
    path = wikitext_path("valid", text_file)
    check_text_file(path)
    check_engine_args(device, "float32")

    ckpt = resolve(model, quiet=json_out)  # the text is counted and the rank checked before the model loads
    from sparsedecode.account.dims import ModelDims

    dims = ModelDims.from_config(ckpt.config, name=ckpt.name)
    th.validate(dims)
    opts.spec.check(dims)
    tokenizer = load_tokenizer(ckpt)
    if tokenizer is None:
        raise InputError(f"'{model}' has no tokenizer files; fine-tuning reads text: give a model with one")
    ids = text_ids(tokenizer, path)
    require_tokens(ids, tokens, path)
    eng = sparsedecode.load(ckpt, device=device, dtype="float32", max_len=seq_len, quiet=json_out)
    th.validate(eng.dims)
    desc = f"{path.name}[:{tokens}]"
    with stop_on_signals() as stop:  # from here on a SIGTERM or Ctrl-C checkpoints the run
        if not json_out:
            typer.echo(f"fine-tuning {eng.name} under {th.method} keep {th.keep:g} ({thresholds}): LoRA r={rank}, "
                       f"alpha={alpha:g} on {targets}, {steps} steps of {batch} x {seq_len} tokens from {desc}",
                       err=True)
        try:
            rec = finetune(eng, ids, th, opts, out, text=desc, thresholds_file=thresholds, progress=not json_out,
                           stop=stop)
        except Interrupted as e:
            typer.echo(f"interrupted: {e}", err=True)
            raise typer.Exit(130) from None
    if json_out:
        emit_json(rec)
        return
    loss = rec["loss"]
    typer.echo(f"wrote {out}: loss {loss[0]:.4f} -> {loss[-1]:.4f} (mean of the last {min(16, len(loss))} steps "
               f"{sum(loss[-16:]) / len(loss[-16:]):.4f}) in {rec['seconds']:.0f} s; record {out}/finetune.json")
