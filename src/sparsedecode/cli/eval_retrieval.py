"""`sparsedecode eval passkey | multikey | two-turn`: retrieval placements decoded dense and
under a configuration from the same dense prefill (ByteCross App. A 'Retrieval tests',
App. G; issue 7 item 3; the protocol is in `quality.retrieval`).

    sparsedecode eval passkey -m smollm2-135m --context 2048 --kv snapkv --kv-keep 0.3
    sparsedecode eval multikey -m qwen2.5-coder-0.5b --context 4096 --kv window --kv-keep 0.3 \\
        --out runs/retrieval/multikey_window0.3.json
    sparsedecode eval two-turn -m qwen2.5-coder-0.5b --context 4096 --kv snapkv --kv-keep 0.2 \\
        --variant rescored --json

The record (kind 'retrieval_eval') holds every placement's dense and configured output and
verdict, so admission (a configuration answers what dense answers) can be decided from it
alone. The engine is loaded without torch.compile: each placement decodes 8 tokens per mode
and switches the projection modules, which would recompile every time. torch is imported
inside the commands.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from sparsedecode.cli.common import (
    COUNT_MAX,
    SEED_MAX,
    TOKENS,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    KvKeepOpt,
    KvOpt,
    ObsOpt,
    ProjKeepOpt,
    TextFileOpt,
    ThreadsOpt,
    ThresholdsOpt,
    apply_threads,
    bounded,
    emit_json,
    out_file,
    parse_float,
)
from sparsedecode.cli.eval import (
    KvParamOpt,
    ModelOpt,
    _check_sparsity,
    _projection,
    eval_app,
)
from sparsedecode.errors import InputError

ContextOpt = Annotated[int, typer.Option("--context", **TOKENS, help="Prompt length in tokens (4096, 4K), template and question included.")]
DepthsOpt = Annotated[str, typer.Option("--depths", help="Relative depths of the queried needle, comma-separated, in [0, 1].")]
TrialsOpt = Annotated[int, typer.Option("--trials", callback=bounded(1, COUNT_MAX), help="Placements per depth (ByteCross: 8).")]
SeedOpt = Annotated[int, typer.Option("--seed", callback=bounded(0, SEED_MAX), help="Seed of the codes, archives and placements.")]
NewOpt = Annotated[int, typer.Option("--new", **TOKENS, help="Tokens decoded greedily per answer.")]
OutOpt = Annotated[str | None, typer.Option("--out", "-o", callback=out_file(new=True), help="Record to write (kind 'retrieval_eval'; never overwritten).")]
VariantOpt = Annotated[str | None, typer.Option("--variant", help="kept (default): select once after the first question and append the rest; rescored: score the whole cache again after the second question. Needs --kv.")]

MODEL = "smollm2-135m"
DEPTHS = "0.05,0.25,0.5,0.75,0.95"


@eval_app.command("passkey")
def passkey(
    model: ModelOpt = MODEL, thresholds: ThresholdsOpt = None, proj_keep: ProjKeepOpt = None,
    kv: KvOpt = None, kv_keep: KvKeepOpt = None, obs: ObsOpt = 64, kv_param: KvParamOpt = None,
    context: ContextOpt = 2048,
    depths: DepthsOpt = DEPTHS, trials: TrialsOpt = 8, seed: SeedOpt = 0, new: NewOpt = 8,
    text_file: TextFileOpt = None, device: DeviceOpt = "auto", dtype: DtypeOpt = "auto",
    threads: ThreadsOpt = None, out: OutOpt = None, json_out: JsonOpt = False,
) -> None:
    """A six-digit pass key in filler text at each depth: does the configuration answer
    what dense decoding answers?

    --text-file replaces the repeated filler with WikiText-2 test or the file's text."""
    _command("passkey", **locals())


@eval_app.command("multikey")
def multikey(
    model: ModelOpt = MODEL, thresholds: ThresholdsOpt = None, proj_keep: ProjKeepOpt = None,
    kv: KvOpt = None, kv_keep: KvKeepOpt = None, obs: ObsOpt = 64, kv_param: KvParamOpt = None,
    context: ContextOpt = 2048,
    depths: DepthsOpt = DEPTHS, trials: TrialsOpt = 8, seed: SeedOpt = 0, new: NewOpt = 8,
    text_file: TextFileOpt = None, device: DeviceOpt = "auto", dtype: DtypeOpt = "auto",
    threads: ThreadsOpt = None, out: OutOpt = None, json_out: JsonOpt = False,
) -> None:
    """Four archives' codes in WikiText-2 text, one asked for at each depth: correct,
    distractor (another archive's code) or miss.

    The text hiding the codes is WikiText-2 test or --text-file."""
    _command("multikey", **locals())


@eval_app.command("two-turn")
def two_turn(
    model: ModelOpt = MODEL, thresholds: ThresholdsOpt = None, proj_keep: ProjKeepOpt = None,
    kv: KvOpt = None, kv_keep: KvKeepOpt = None, obs: ObsOpt = 64, kv_param: KvParamOpt = None,
    context: ContextOpt = 2048,
    depths: DepthsOpt = DEPTHS, trials: TrialsOpt = 8, seed: SeedOpt = 0, new: NewOpt = 8,
    text_file: TextFileOpt = None, device: DeviceOpt = "auto", dtype: DtypeOpt = "auto",
    threads: ThreadsOpt = None, out: OutOpt = None, json_out: JsonOpt = False, variant: VariantOpt = None,
) -> None:
    """Multi-key with a second question (App. G): the first answer is given, the second
    question asks for another archive at each depth.

    The text hiding the codes is WikiText-2 test or --text-file."""
    _command("two_turn", **locals())


def _command(test: str, *, model, thresholds, proj_keep, kv, kv_keep, obs, kv_param, context, depths, trials,
             seed, new, text_file, device, dtype, out, json_out, variant=None, threads=None) -> None:
    from sparsedecode.quality.retrieval import check_counts, check_depths, check_variant

    apply_threads(threads)
    # Everything the user can get wrong fails here, before a model loads.
    keep, kv_config = _check_sparsity(out, thresholds, proj_keep, kv, kv_keep, obs, kv_param)
    if thresholds is not None and not Path(thresholds).expanduser().is_file():
        raise InputError(f"no thresholds file at {thresholds}; make one with sparsedecode calibrate "
                         "or use --proj-keep K")
    depth_list = check_depths([parse_float(d, "depth") for d in depths.split(",") if d.strip()])
    check_counts(context, trials, new)
    check_variant(variant)
    if variant is not None and kv is None:
        raise InputError(f"--variant {variant} says how the KV selection meets the second turn: "
                         "give --kv METHOD --kv-keep K too")
    if kv_config is not None:
        from sparsedecode.kv.select import get_selector

        # a budget without room for sinks + window fails now (two-turn kept: again once its
        # prompts are built, at the end of the first question)
        get_selector(kv, **kv_config.params).budget(context, kv_config.keep, new)
    _check_window(model, context + new)
    path = None
    if test != "passkey" or text_file is not None:
        from sparsedecode.corpus import wikitext_path

        path = wikitext_path("test", text_file)

    t0 = time.perf_counter()
    eng = _load(model, context + new, device=device, dtype=dtype, quiet=json_out)
    from sparsedecode.quality.retrieval import partial_path

    partial = None if out is None else partial_path(out)  # an interrupted run resumes from it
    rec = _run(eng, test, path, thresholds, keep, kv_config, text_file, context=context,
               depths=depth_list, trials=trials, seed=seed, new=new, variant=variant,
               progress=not json_out, partial=partial)
    rec["seconds"] = round(time.perf_counter() - t0, 2)  # of this run: a resumed one ran part of it
    if out is not None:
        from sparsedecode.records import stamp, write_record

        rec = stamp(rec)
        write_record(out, rec)
        partial.unlink(missing_ok=True)
    if json_out:
        emit_json({**rec, "correct": rec["configured"]["correct"], "total": rec["configured"]["total"]})
        return
    _show(rec, out)


def _check_window(model: str, need: int) -> None:
    """A known model's window, checked before it loads (others: by the loader)."""
    from sparsedecode.account.known import KNOWN_MODELS

    km = KNOWN_MODELS.get(str(model).lower())
    window = None if km is None else km.config.get("max_position_embeddings")
    if window is not None and need > window:
        raise InputError(f"--context plus --new is {need:,} tokens, more than the {window:,} that "
                         f"'{model}' attends: use a shorter --context")


def _load(model: str, need: int, **kw):
    import sparsedecode

    try:
        return sparsedecode.load(model, max_len=need, compile=False, **kw)
    except InputError as e:
        if "exceeds the model window" not in str(e) and "sliding-window" not in str(e):
            raise
        raise InputError(f"--context plus --new is {need:,} tokens, more than '{model}' attends: "
                         f"{str(e).split(';')[0]}; use a shorter --context") from None


def _run(eng, test, path, thresholds, keep, kv_config, text_file, **kw) -> dict:
    from sparsedecode.cli.eval import _configured
    from sparsedecode.quality.retrieval import evaluate_retrieval

    config, th = _configured(eng, _projection(eng, thresholds, keep, text_file, kw["progress"]), kv_config)
    if kw["progress"]:
        where = "filler" if path is None else f"{path.name}"
        typer.echo(f"{test.replace('_', '-')}: {eng.name}, {kw['context']:,} tokens of {where}, "
                   f"{len(kw['depths'])} depths x {kw['trials']} trials", err=True)
    rec = evaluate_retrieval(eng, test, config, thresholds=th, text_path=path, **kw)
    if rec["config"]["projection"] is not None and thresholds is not None:
        rec["config"]["projection"]["source"] = str(thresholds)
    return rec


def _show(rec: dict, out: str | None) -> None:
    test = rec["test"].replace("_", "-")
    typer.echo(f"{rec['model']['name']}, {test}: {rec['context']:,}-token prompts"
               f"{'' if rec['chat_template'] else ' (no chat template: plain text)'}, "
               f"{rec['trials']} trials per depth, {rec['new']} new tokens")
    from sparsedecode.report.retrieval_table import label

    mode, name = rec["config"]["mode"], label(rec)
    typer.echo(f"configuration: {name}" + ("" if name == mode else f" (mode {mode})"))
    window = rec["config"]["kv"] is not None and rec["config"]["kv"]["method"] == "window"
    kept = all(p["configured"].get("needle_kept") for p in rec["placements"])
    typer.echo(f"{'depth':>6}  {'dense':>6}  {'config':>6}  {'distr.':>6}" + ("  in window" if window else "")
               + ("  needle tokens kept" if kept else ""))
    for d in rec["depths"]:
        rows = [p for p in rec["placements"] if p["depth"] == d]
        dense = sum(p["dense"]["verdict"] == "correct" for p in rows)
        conf = sum(p["configured"]["verdict"] == "correct" for p in rows)
        distr = sum(p["configured"]["verdict"] == "distractor" for p in rows)
        line = f"{d:>6g}  {dense:>3}/{len(rows):<2}  {conf:>3}/{len(rows):<2}  {distr:>6}"
        if window:
            line += f"  {sum(bool(p['configured']['in_window']) for p in rows):>3}/{len(rows)}"
        if kept:
            line += "  " + " ".join(f"{p['configured']['needle_kept']['tokens']:.2f}" for p in rows)
        typer.echo(line)
    d, c = rec["dense"], rec["configured"]
    typer.echo(f"{'all':>6}  {d['correct']:>3}/{d['total']:<2}  {c['correct']:>3}/{c['total']:<2}  "
               f"{c['distractor']:>6}   matches dense: {'yes' if rec['matches_dense'] else 'no'}; "
               f"{rec['seconds']:.0f} s")
    if out is not None:
        typer.echo(f"wrote {out}")
