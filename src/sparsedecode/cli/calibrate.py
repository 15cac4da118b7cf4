"""`sparsedecode calibrate`: activation thresholds for the projection branch (issue 4).

    sparsedecode calibrate --model smollm2-135m --method teal --proj-keep 0.5 --out t.safetensors
    sparsedecode calibrate --model qwen2.5-coder-0.5b --method teal --proj-keep 0.5 --greedy --out g.st
    sparsedecode calibrate --model smollm2-135m --method cats --proj-keep 0.5 --out c.st --json

Calibrates on WikiText-2 validation (or --text-file), then measures the
realized keep with the sparsity applied (masked reference) on held-out text:
WikiText-2 test, or the part of --text-file after the calibration tokens.
torch is imported inside the command.
"""

from __future__ import annotations

from typing import Annotated

import typer

from sparsedecode.cli.app import app
from sparsedecode.cli.common import (
    TOKENS,
    DeviceOpt,
    DtypeOpt,
    FfOnlyOpt,
    JsonOpt,
    MethodOpt,
    ProjKeepOpt,
    TextFileOpt,
    ThreadsOpt,
    apply_threads,
    check_engine_args,
    check_new_file,
    check_text_file,
    emit_json,
    out_file,
)
from sparsedecode.errors import InputError


@app.command()
def calibrate(
    out: Annotated[str, typer.Option("--out", "-o", callback=out_file(".safetensors", new=True), help="Thresholds file to write (.safetensors).")],
    model: Annotated[str, typer.Option("--model", "-m", help="Known name, HF folder, hub id or .gguf file.")] = "smollm2-135m",
    method: MethodOpt = "teal",
    keep: ProjKeepOpt = "0.5",
    greedy: Annotated[bool, typer.Option("--greedy", help="TEAL's greedy block-wise allocation.")] = False,
    ff_only: FfOnlyOpt = False,
    text_file: TextFileOpt = None,
    tokens: Annotated[int, typer.Option("--tokens", **TOKENS, help="Calibration tokens (e.g. 8K).")] = "8K",
    eval_tokens: Annotated[int, typer.Option("--eval-tokens", **TOKENS, help="Held-out tokens for the realized keep (0 skips).")] = "4K",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Calibrate thresholds on text, save them, and report the realized keep on held-out text.

    The calibration text is WikiText-2 validation or --text-file; the held-out text is WikiText-2
    test (from a --text-file folder, or the copy the package ships), else the calibration text after
    the tokens it used."""
    import sparsedecode
    from sparsedecode.account.units import check_keep, parse_tokens
    from sparsedecode.corpus import require_tokens, text_ids, wikitext_path
    from sparsedecode.projection.calibrate import get_calibrator, measure_keep

    apply_threads(threads)
    check_new_file(out, "--out", ".safetensors")
    params = {"keep": check_keep(keep, "--proj-keep")}
    if greedy:
        params["greedy"] = True
    if ff_only:
        params["ff_only"] = True
    calibrator = get_calibrator(method, **params)
    n_cal = parse_tokens(tokens, "--tokens")
    n_eval = 0 if str(eval_tokens).strip() == "0" else parse_tokens(eval_tokens, "--eval-tokens")
    cal_path = wikitext_path("valid", text_file)
    check_text_file(cal_path)
    check_engine_args(device, dtype)

    eng = sparsedecode.load(model, device=device, dtype=dtype, quiet=json_out)
    ids = text_ids(eng.tokenizer, cal_path)
    require_tokens(ids, n_cal, cal_path)
    cal_ids = ids[:n_cal]
    desc = f"{cal_path.name}[:{n_cal}]"
    th = calibrator.calibrate(eng, cal_ids, text=desc, progress=not json_out)
    path = th.save(out)

    result = {"out": str(path), "model": eng.name, "method": method, "target_keep": th.keep,
              "keep_metric": th.keep_metric, "calibration": th.calibration,
              "params": dict(th.extras), "realized": None}
    if n_eval:
        eval_ids, eval_desc = _held_out(eng, text_file, ids, n_cal, n_eval)
        m = measure_keep(eng, th, eval_ids, ff_only=ff_only, progress=not json_out)
        result["realized"] = {"text": eval_desc, **{k: m[k] for k in (
            "tokens", "keep", "param_keep", "ff_keep", "act_keep", "sites", "masked")}}
    if json_out:
        emit_json(result)
        return
    typer.echo(f"wrote {path}: {method} thresholds for {eng.name}, target {th.keep_metric} "
               f"{th.keep:g}, calibrated on {desc}")
    r = result["realized"]
    if r:
        sites = ", ".join(f"{s} {v:.3f}" for s, v in r["sites"].items())
        typer.echo(f"realized {th.keep_metric} on {r['text']} ({r['tokens']:,} tokens, masked "
                   f"reference): {r['keep']:.4f} (param-weighted {r['param_keep']:.4f}; {sites})")


def _held_out(eng, text_file, cal_stream, n_cal: int, n_eval: int):
    """WikiText-2 test when it is there; else the calibration file after the tokens used."""
    from sparsedecode.corpus import wikitext_ids

    try:
        ids = wikitext_ids(eng.tokenizer, "test", text_file if text_file and _is_dir(text_file) else None)
        return ids[:n_eval], f"WikiText-2 test[:{min(n_eval, len(ids))}]"
    except InputError:
        rest = cal_stream[n_cal:]
        if len(rest) < 256:
            raise InputError(
                "no held-out text for the realized keep: WikiText-2 test is absent and the "
                "calibration text has too little left after --tokens; lower --tokens or pass "
                "--eval-tokens 0"
            ) from None
        return rest[:n_eval], f"calibration text [{n_cal}:{n_cal + min(n_eval, len(rest))}]"


def _is_dir(p: str) -> bool:
    from pathlib import Path

    return Path(p).expanduser().is_dir()
