"""The one exception type that means "the user's input is wrong", and how its hints name options.

The CLI turns InputError into a single line on stderr and exit code 2; anything else
is a bug and keeps its traceback. A hint names an option the way the caller gives it:
`--max-len` on the command line, `max_len=` from Python (`option`); `cli.main` says which.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar


class InputError(ValueError):
    """Bad input: the message says what is wrong and how to fix it."""


_CLI: ContextVar[bool] = ContextVar("sparsedecode_cli", default=False)


def option(name: str, value=None, *, placeholder: bool = False, flag: str | None = None,
           python: str | None = None) -> str:
    """How the caller names keyword `name` (e.g. 'max_len'): '--max-len' under the CLI, 'max_len='
    from Python; with `value`, '--device cpu' or "device='cpu'" (a `placeholder` value such as
    'PATH' is shown as written: '--config PATH', 'config=PATH'). `flag`: the command line's
    spelling where it is not the keyword's (keyword `verdicts`, flag '--admit'); `python`: what to
    say from Python where no keyword matches the flag ('text' for '--text-file')."""
    if _CLI.get():
        flag = flag or "--" + name.replace("_", "-")
        return flag if value is None or value is True else f"{flag} {value}"  # a switch has no value
    if python is not None:
        return python
    return f"{name}=" if value is None else f"{name}={value if placeholder else repr(value)}"


@contextlib.contextmanager
def cli_context():
    """Hints inside name command-line flags (`option`); `cli.main` runs every command in it."""
    token = _CLI.set(True)
    try:
        yield
    finally:
        _CLI.reset(token)


__all__ = ["InputError", "cli_context", "option"]
