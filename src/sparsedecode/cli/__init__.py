"""The one command, `sparsedecode`, with subcommands.

Each group lives in a module of its own and registers itself on `app` (`cli/app.py`);
shared options live in `cli/common.py`, how help reads in `cli/help.py`. Heavy imports (torch) happen
inside the commands that need them, so `sparsedecode account` stays instant.
"""

from __future__ import annotations

import sys

import typer

# Registration order is the order of `sparsedecode --help`.
from sparsedecode.cli import account as _account  # noqa: F401
from sparsedecode.cli import bench as _bench  # noqa: F401
from sparsedecode.cli import calibrate as _calibrate  # noqa: F401
from sparsedecode.cli import dispatch as _dispatch  # noqa: F401
from sparsedecode.cli import engine as _engine  # noqa: F401
from sparsedecode.cli import eval as _eval  # noqa: F401
from sparsedecode.cli import eval_grid as _eval_grid  # noqa: F401
from sparsedecode.cli import eval_retrieval as _eval_retrieval  # noqa: F401
from sparsedecode.cli import finetune as _finetune  # noqa: F401
from sparsedecode.cli import report as _report  # noqa: F401
from sparsedecode.cli import route as _route  # noqa: F401
from sparsedecode.cli import serve as _serve  # noqa: F401
from sparsedecode.cli.app import app  # noqa: F401 (the app the commands registered on)
from sparsedecode.errors import InputError, cli_context

# One spelling per option across commands; the old names still work, with a note.
ALIASES = {"account": {"--rp": "--proj-keep", "--rkv": "--kv-keep"}, "calibrate": {"--keep": "--proj-keep"}}


def _aliases(argv: list[str]) -> list[str]:
    """argv with the old option names of its command replaced by the current ones."""
    table = ALIASES.get(argv[0]) if argv else None
    if not table:
        return argv
    out = []
    for a in argv:
        flag, eq, value = a.partition("=")
        if flag in table:
            print(f"note: {flag} is now {table[flag]} (the old name still works)", file=sys.stderr)
            a = table[flag] + eq + value
        out.append(a)
    return out


def use_help_classes(t: typer.Typer) -> None:
    """Build every group and command of `t` with `cli.help`'s classes: summaries whole, values
    named (set here once, so a new command gets them too)."""
    from typer.core import TyperCommand

    from sparsedecode.cli.help import Command, Group

    t.info.cls = Group
    for c in t.registered_commands:
        if c.cls in (None, TyperCommand):  # typer's default; a command's own class stays
            c.cls = Command
    for g in t.registered_groups:
        use_help_classes(g.typer_instance)


use_help_classes(app)


def _check_utf8(argv: list[str]) -> None:
    """Refuse an argument that is not UTF-8 text: Python keeps such bytes as lone surrogates
    (surrogateescape), which fail later wherever the text is encoded."""
    for i, a in enumerate(argv):
        try:
            a.encode("utf-8")
        except UnicodeEncodeError as e:
            byte = ord(a[e.start]) - 0xDC00 if 0xDC80 <= ord(a[e.start]) <= 0xDCFF else ord(a[e.start])
            what = f"the value of {argv[i - 1]}" if i and argv[i - 1].startswith("-") else f"argument {i + 1}"
            raise InputError(f"{what} is not UTF-8 text (byte 0x{byte:02x} at character {e.start}); "
                             "give UTF-8 text (or put the text in a UTF-8 file)") from None


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app, turning InputError, and click's own refusals of the command line
    (an unknown option, a value that is not a number), into one line and exit code 2. Error hints
    inside name command-line flags (`errors.option`)."""
    from typer._click import (
        exceptions as click,  # typer's own copy of click (typer >= 0.2x vendors it)
    )

    argv = list(sys.argv[1:] if argv is None else argv)
    command = typer.main.get_command(app)
    try:
        with cli_context():
            _check_utf8(argv)
            code = command(args=_aliases(argv), prog_name="sparsedecode", standalone_mode=False)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except click.NoArgsIsHelpError as e:  # a bare group: its help, as click shows it
        e.show()
        raise SystemExit(e.exit_code) from None
    except click.ClickException as e:
        where = f" (see {e.ctx.command_path} -h)" if getattr(e, "ctx", None) is not None else ""
        print(f"error: {e.format_message()}{where}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    except typer.Abort:
        print("Aborted!", file=sys.stderr)
        raise SystemExit(1) from None
    # typer.Exit(code) and Ctrl-C (130) return their code; a command returns None. Exit as click's
    # standalone mode does, so callers see SystemExit either way.
    raise SystemExit(code if isinstance(code, int) and not isinstance(code, bool) else 0)
