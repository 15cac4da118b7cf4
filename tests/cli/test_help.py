"""Help a user can read (issue 43, item 5): every --help, built through typer's CliRunner, names
each value (no Python type name), and every listing shows each command's summary whole."""

import re

import pytest
import typer
from typer.testing import CliRunner

from conftest import cli_commands
from sparsedecode.cli import app
from sparsedecode.cli.help import summary

# What typer (`<str>`, `<list[str]>`, `<int range>`) or click (TEXT, INTEGER, ...) print for a value
# whose declaration names none.
UNNAMED = re.compile(r"<[a-z][a-z_ ,|\[\]]*>|\b(?:list|dict|tuple)\[|\b(?:TEXT|INTEGER|FLOAT|INT|BOOLEAN|PATH|"
                     r"FILENAME|DIRECTORY|UUID|DATETIME|STR)\b")


ALL = list(cli_commands())
GROUPS = [(p, c) for p, c in ALL if getattr(c, "commands", None)]


def help_of(path) -> str:
    r = CliRunner().invoke(app, [*path, "--help"])
    assert r.exit_code == 0, r.output
    return r.output


@pytest.mark.parametrize("path", [p for p, _ in ALL], ids=lambda p: " ".join(p) or "sparsedecode")
def test_help_names_every_value(path):
    text = help_of(path)
    bad = sorted({m.group(0) for m in UNNAMED.finditer(text)})
    assert not bad, f"sparsedecode {' '.join(path)} --help shows {bad}:\n{text}"


def test_the_check_catches_typers_own_names():
    """An option declared without a metavar shows typer's type name, which the check finds."""
    t = typer.Typer()

    @t.command()
    def f(gib: float = typer.Option(1.0, "--gib"), names: list[str] = typer.Option(None, "--name")):
        pass

    text = CliRunner().invoke(t, ["--help"]).output
    assert {m.group(0) for m in UNNAMED.finditer(text)} >= {"<float>", "<list[str]>"}


def listing(text: str) -> dict[str, str]:
    """The Commands section of a group's help: name -> summary, its wrapped lines joined."""
    rows: dict[str, str] = {}
    last = None
    for line in text.split("Commands:\n", 1)[1].splitlines():
        m = re.match(r"  (\S+)\s+(.*)", line)
        if m and not line.startswith("   "):
            last = m.group(1)
            rows[last] = m.group(2).strip()
        elif line.strip() and last is not None:
            rows[last] += " " + line.strip()
    return rows


@pytest.mark.parametrize("path, group", GROUPS, ids=lambda x: " ".join(x) if isinstance(x, tuple) else "")
def test_summaries_are_whole(path, group):
    shown = listing(help_of(path))
    assert set(shown) == {n for n, c in group.commands.items() if not c.hidden}
    for name, text in shown.items():
        whole = summary(group.commands[name].help)
        # the formatter may break a line at a hyphen ('per-' / 'configuration'): compare words
        assert text.replace("- ", "-") == whole.replace("- ", "-"), f"{name}: {text!r} is not {whole!r}"
        assert not text.endswith("...") and text[-1] in ".?)", f"{name}: {text!r} is cut"


def test_the_bench_summary_is_no_longer_cut_at_app():
    assert listing(help_of(()))["bench"] != "Timing: one cell of the App."
