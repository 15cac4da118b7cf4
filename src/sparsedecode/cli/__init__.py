"""The one command, `sparsedecode`, with subcommands.

Each group lives in a module of its own and registers itself on `app` (`cli/app.py`);
shared option parsing lives in `cli/common.py`. Heavy imports (torch) happen
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
from sparsedecode.cli import report as _report  # noqa: F401
from sparsedecode.cli import route as _route  # noqa: F401
from sparsedecode.cli import serve as _serve  # noqa: F401
from sparsedecode.cli.app import app  # noqa: F401 (the app the commands registered on)
from sparsedecode.errors import InputError

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


# Numbers arrive as strings (our parsers give one-line errors), so help would say <str>: name them.
METAVARS = {
    "--proj-keep": "KEEP", "--kv-keep": "KEEP", "--union": "KEEP", "--proj-keeps": "KEEP,...",
    "--kv-keeps": "KEEP,...", "--routed": "FRACTION", "--target": "FRACTION", "--tolerance": "FRACTION",
    "--context": "TOKENS", "--contexts": "TOKENS,...", "--max-context": "TOKENS", "--tokens": "TOKENS",
    "--eval-tokens": "TOKENS", "--held-out-tokens": "TOKENS", "--window": "TOKENS", "--length": "TOKENS",
    "--select-seconds": "SECONDS", "--cost-proj": "MS", "--cost-kv": "MS", "--bandwidth": "GB/S",
    "--peak-gbps": "GB/S", "--weight-bytes": "BYTES", "--kv-bytes": "BYTES", "--temperature": "FLOAT",
    "--top-p": "FLOAT", "--seed": "INT", "--threads": "INT", "--max-new-tokens": "INT", "--max-len": "TOKENS",
    "--model": "MODEL", "--config": "CONFIG", "--out": "PATH", "--text-file": "PATH", "--thresholds": "FILE",
    "--routing": "FILE", "--gate": "FILE", "--prompt": "TEXT", "--prompt-file": "FILE", "--device": "DEVICE",
    "--dtype": "DTYPE", "--attention": "BACKEND", "--kv": "METHOD", "--method": "METHOD", "--mode": "MODE",
    "--mix": "MIX", "--admit": "FILE", "--select-record": "FILE", "--request": "PROMPT:ANSWER",
    "--budget": "BUDGET", "--calib-tokens": "TOKENS", "--compile-mode": "MODE", "--depths": "DEPTH,...",
    "--executor": "EXECUTOR", "--fill": "FILL", "--gpus": "ID,...", "--init": "INIT", "--kv-param": "KEY=VALUE",
    "--multikey": "FILE", "--passkey": "FILE", "--ppl": "FILE", "--plot": "PNG", "--proj": "KEEP:DELTA,...",
    "--sel": "KEEP:DELTA,...", "--protocol": "PROTOCOL", "--table": "FILE", "--unseen": "dense|sparse", "--variant": "VARIANT",
    "--ready-file": "FILE", "--host": "ADDRESS", "--port": "PORT", "--max-queue": "INT",
    "--url": "URL", "--clients": "INT", "--requests": "INT", "--max-tokens": "INT", "--pid": "PID",
    "--timeout": "SECONDS", "--cells": "FOLDER", "--vocab": "INT", "--kernels": "KEY=VALUE,...",
}


def _metavars(cmd) -> None:
    """Give string-typed number options of every command the metavar of `METAVARS`."""
    for p in getattr(cmd, "params", []):
        for name in getattr(p, "opts", []):
            if name in METAVARS and getattr(p, "metavar", None) is None:
                p.metavar = METAVARS[name]
    for sub in getattr(cmd, "commands", {}).values():
        _metavars(sub)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app, turning InputError into one line and exit code 2."""
    argv = _aliases(list(sys.argv[1:] if argv is None else argv))
    command = typer.main.get_command(app)
    _metavars(command)
    try:
        command(args=argv, prog_name="sparsedecode", standalone_mode=True)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
