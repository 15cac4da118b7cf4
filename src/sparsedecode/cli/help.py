"""How the CLI's help reads: metavars a user understands, summaries never cut.

Left to itself, typer names an option's value by its Python type (`--gib <float>`,
`SPEC <list[str]>`), and click cuts a command's summary at the listing's width or at
the first period ("bench: Timing: one cell of the App."). Every group and command of
`sparsedecode` is built with the classes here (`cli.use_help_classes`), so every way
of building the app, the console script and typer's CliRunner alike, reads the same.
A summary is its help's first paragraph, whole: write that paragraph as one sentence.
The classes also run every command in `errors.cli_context`, so an error's hint names flags
however the app is invoked (`errors.option`).
"""

from __future__ import annotations

from typer.core import TyperCommand, TyperGroup

from sparsedecode.errors import cli_context

# The value names of options whose declaration gives none (the shared options of
# `cli/common.py` and token counts declare theirs).
METAVARS = {
    "--union": "KEEP", "--proj-keeps": "KEEP,...", "--kv-keeps": "KEEP,...", "--routed": "FRACTION",
    "--target": "FRACTION", "--tolerance": "FRACTION", "--contexts": "TOKENS,...",
    "--select-seconds": "SECONDS", "--cost-proj": "MS", "--cost-kv": "MS", "--bandwidth": "GB/S",
    "--peak-gbps": "GB/S", "--weight-bytes": "BYTES", "--kv-bytes": "BYTES", "--temperature": "TEMP",
    "--top-p": "MASS", "--seed": "SEED", "--model": "MODEL", "--config": "CONFIG", "--out": "FILE",
    "--routing": "FILE", "--gate": "FILE", "--prompt": "PROMPT", "--prompt-file": "FILE",
    "--attention": "BACKEND", "--mode": "MODE", "--mix": "MIX", "--admit": "FILE", "--select-record": "FILE",
    "--request": "PROMPT:ANSWER", "--budget": "BUDGET", "--compile-mode": "MODE", "--depths": "DEPTH,...",
    "--executor": "EXECUTOR", "--fill": "FILL", "--gpus": "ID,...", "--init": "INIT", "--kv-param": "KEY=VALUE",
    "--multikey": "FILE", "--passkey": "FILE", "--ppl": "FILE", "--plot": "PNG", "--proj": "KEEP:DELTA,...",
    "--sel": "KEEP:DELTA,...", "--protocol": "PROTOCOL", "--table": "FILE", "--unseen": "dense|sparse",
    "--variant": "VARIANT", "--ready-file": "FILE", "--host": "ADDRESS", "--port": "PORT", "--max-queue": "N",
    "--url": "URL", "--clients": "N", "--requests": "N", "--pid": "PID", "--timeout": "SECONDS",
    "--cells": "DIR", "--vocab": "N", "--kernels": "KEY=VALUE,...", "--trials": "N", "--windows": "N",
    "--chunks": "N", "--resamples": "N", "--level": "LEVEL", "--repeats": "N", "--warmup": "STEPS",
    "--steps": "STEPS", "--profile": "STEPS", "--impl": "IMPL", "--shared-gpu": "refuse|allow",
    "--gib": "GIB", "--replays": "N", "--calls": "N", "--prediction": "FILE", "--spec": "FILE",
    "--group": "GROUP", "--name": "NAME", "--blocks": "N", "--keep-campaign": "DIR",
    "--max-cells": "N", "--stop-after": "SECONDS", "--into": "DIR", "--batch": "N",
    "--ceiling": "FILE", "--manifest": "FILE",
}


def summary(help: str | None) -> str | None:
    """The first paragraph of a help text on one line: the command's summary in its group's listing."""
    if not help:
        return None
    return " ".join(help.split("\n\n")[0].split())


def _name_values(params) -> None:
    """Give each option that takes a value and declares no metavar its name from `METAVARS`."""
    for p in params:
        if p.param_type_name != "option" or p.is_flag or p.metavar is not None:
            continue
        p.metavar = next((METAVARS[o] for o in p.opts if o in METAVARS), None)


def _argument_name(p) -> str:
    """An argument as its usage line shows it (FOLDER, SPEC...), without typer's `<str>`."""
    return (p.metavar or p.name.upper()) + ("..." if p.nargs != 1 else "")


class _InCli:
    """Run under `errors.cli_context`: hints name `--flags`, not keywords."""

    def main(self, *args, **kwargs):
        with cli_context():
            return super().main(*args, **kwargs)


class Command(_InCli, TyperCommand):
    """A command whose summary is its first paragraph and whose values have names."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["short_help"] = kwargs.get("short_help") or summary(kwargs.get("help"))
        super().__init__(*args, **kwargs)
        _name_values(self.params)

    def format_options(self, ctx, formatter) -> None:
        args, opts = [], []
        for p in self.get_params(ctx):
            record = p.get_help_record(ctx)
            if record is None:
                continue
            if p.param_type_name == "argument":
                args.append((_argument_name(p), record[1]))
            else:
                opts.append(record)
        for title, rows in (("Arguments", args), ("Options", opts)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


class Group(_InCli, TyperGroup):
    """A group whose summary is its first paragraph and whose own options' values have names."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["short_help"] = kwargs.get("short_help") or summary(kwargs.get("help"))
        super().__init__(*args, **kwargs)
        _name_values(self.params)
