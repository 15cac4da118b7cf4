"""The typer app every command registers itself on. It lives apart from `cli/__init__.py`, which
imports the commands to register them, so a command module importing `app` makes no cycle."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="sparsedecode",
    help="Faster single-sequence LLM decoding by reading fewer bytes per step.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from sparsedecode import __version__

        typer.echo(f"sparsedecode {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Faster single-sequence LLM decoding by reading fewer bytes per step."""


__all__ = ["app"]
