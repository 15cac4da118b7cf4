"""`sparsedecode route`: token routing tables (SATS paper §3.2).

    sparsedecode route build --model smollm2-135m --thresholds cats.st --out route.st
    sparsedecode route calibrate --table route.st --target 0.5
    sparsedecode generate -p "..." --thresholds cats.st --routing route.st

`build` scores every token id by the mean excess next-token loss of the CATS
path over the dense MLP on routing text (WikiText-2 validation, or
--text-file); `calibrate` picks the threshold tau whose routed fraction on
held-out text (by default the routing text after the tokens `build` used) is
closest to the target, and writes it into the table (atomically). torch is
imported inside the commands.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sparsedecode.cli.app import app
from sparsedecode.cli.common import (
    TOKENS,
    AdapterOpt,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    TextFileOpt,
    ThreadsOpt,
    ThresholdsOpt,
    apply_threads,
    emit_json,
    out_file,
    parse_float,
)
from sparsedecode.errors import InputError

route_app = typer.Typer(
    help="Token routing (SATS §3.2): per token id, the dense MLP or the CATS path.",
    no_args_is_help=True,
)
app.add_typer(route_app, name="route")

ModelArg = Annotated[str, typer.Option("--model", "-m", help="Known name, HF folder, hub id or .gguf file.")]


@route_app.command("build")
def build(
    thresholds: ThresholdsOpt,
    out: Annotated[str, typer.Option("--out", "-o", callback=out_file(), help="Routing table to write (.safetensors).")],
    model: ModelArg = "smollm2-135m",
    text_file: TextFileOpt = None,
    tokens: Annotated[int, typer.Option("--tokens", **TOKENS, help="Routing tokens (e.g. 16K).")] = "16K",
    window: Annotated[int, typer.Option("--window", **TOKENS, help="Tokens per teacher-forced window.")] = "2K",
    unseen: Annotated[str, typer.Option("--unseen", help="Path of ids absent from the routing text: dense or sparse.")] = "dense",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    threads: ThreadsOpt = None,
    adapter: AdapterOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Score every token id on routing text: mean excess loss of the CATS path over dense.

    The routing text is WikiText-2 validation or --text-file; --thresholds is a cats or sats file.
    With --adapter the scores are the fine-tuned model's (SATS Table 7), and the table asks for
    the same adapter wherever it routes."""
    import sparsedecode
    from sparsedecode.account.units import parse_tokens
    from sparsedecode.corpus import require_tokens, text_ids, wikitext_path
    from sparsedecode.projection.routing import UNSEEN, build_routing_table, check_cats, file_sha256
    from sparsedecode.projection.thresholds import Thresholds

    if unseen not in UNSEEN:
        raise InputError(f"--unseen '{unseen}' must be dense or sparse")
    from sparsedecode.cli.common import check_adapter, check_engine_args, check_out_file

    check_out_file(out, "--out")
    lora = check_adapter(adapter)
    check_engine_args(device, dtype)
    apply_threads(threads)
    n = parse_tokens(tokens, "--tokens")
    w = parse_tokens(window, "--window")
    th = Thresholds.load(thresholds)
    check_cats(th)  # before loading the model
    path = wikitext_path("valid", text_file)
    from sparsedecode.cli.common import check_text_file

    check_text_file(path)
    eng = sparsedecode.load(model, device=device, dtype=dtype, quiet=json_out, adapter=lora)
    ids = text_ids(eng.tokenizer, path)
    require_tokens(ids, n, path)
    table = build_routing_table(eng, th, ids[:n], window=w, unseen=unseen, thresholds_file=thresholds,
                                text=f"{path.name}[:{n}]", text_path=str(path.resolve()),
                                text_sha256=file_sha256(path), text_start=0, progress=not json_out)
    written = table.save(out)
    if json_out:
        emit_json({"out": str(written), **table.header()})
        return
    st = table.stats
    typer.echo(
        f"wrote {written}: routing table for {table.model}{'' if lora is None else f' + adapter {lora.path}'} "
        f"({th.method} keep {th.keep:g} thresholds), "
        f"{n:,} tokens of {path.name}, {st['distinct_tokens']:,} distinct ids; mean loss dense "
        f"{st['loss_dense']:.4f}, sparse {st['loss_sparse']:.4f}; sparse worse at "
        f"{100 * st['sparse_worse']:.1f}% of positions"
    )
    typer.echo(f"next: sparsedecode route calibrate --table {written} --target 0.5")


def _tokenizer(model: str, quiet: bool):
    """The tokenizer of `model` alone (calibration runs no model)."""
    from sparsedecode.models.load import load_tokenizer, resolve

    tok = load_tokenizer(resolve(model, quiet=quiet))
    if tok is None:
        raise InputError(f"'{model}' has no tokenizer; routing calibration tokenizes held-out text")
    return tok


@route_app.command("calibrate")
def calibrate(
    table_path: Annotated[str, typer.Option("--table", "-t", help="Routing table from `route build`; tau is written into it.")],
    target: Annotated[str, typer.Option("--target", help="Target routed fraction in [0, 1] (e.g. 0.25, 0.5, 0.75).")] = "0.5",
    model: Annotated[str | None, typer.Option("--model", "-m", help="Model whose tokenizer reads the text (default: the table's).")] = None,
    text_file: TextFileOpt = None,
    held_out_tokens: Annotated[int, typer.Option("--held-out-tokens", **TOKENS, help="Held-out tokens (e.g. 32K).")] = "32K",
    json_out: JsonOpt = False,
) -> None:
    """Choose tau so the routed fraction on held-out text is closest to the target.

    The held-out text is --text-file, or by default the routing text after the tokens the
    table used."""
    from sparsedecode.account.units import parse_tokens
    from sparsedecode.corpus import text_ids, wikitext_path
    from sparsedecode.projection.calibrate import MIN_TOKENS
    from sparsedecode.projection.routing import (
        RoutingTable,
        calibrate_routing,
        file_sha256,
        held_out_start,
    )

    r = parse_float(target, "--target")
    if not 0.0 <= r <= 1.0:
        raise InputError(f"--target {target} is outside [0, 1]: it is the fraction of tokens routed sparse")
    n = parse_tokens(held_out_tokens, "--held-out-tokens")
    table = RoutingTable.load(table_path)
    recorded = table.text.get("path")
    if text_file is not None:
        path = wikitext_path("valid", text_file)
    elif recorded and Path(recorded).is_file():
        path = Path(recorded)
    else:
        path = wikitext_path("valid")
    skip, why = held_out_start(table, path, explicit=text_file is not None)  # before any tokenizing
    tok = _tokenizer(model or table.model, json_out)
    ids = text_ids(tok, path)
    held = ids[skip : skip + n]
    if len(held) < MIN_TOKENS:
        raise InputError(
            f"only {len(held):,} tokens of {path} are left after the {skip:,} routing tokens, fewer "
            f"than {MIN_TOKENS}; pass --text-file with other held-out text"
        )
    source = f"{path.name}[{skip}:{skip + len(held)}]"
    table = calibrate_routing(table, tok, held, r, text=source,
                              held_out={"path": str(path.resolve()), "sha256": file_sha256(path), "start": skip,
                                        "why": why})
    written = table.save(table_path)
    result = {"table": str(written), "model": table.model, "tau": table.tau, "target": table.target,
              "routed": table.routed, "held_out": table.held_out}
    if json_out:
        emit_json(result)
        return
    typer.echo(
        f"tau = {table.tau:.6g}: routes {100 * table.routed:.2f}% of {len(held):,} held-out tokens "
        f"({source}) to the sparse path (target {100 * r:g}%); wrote {written}"
    )
