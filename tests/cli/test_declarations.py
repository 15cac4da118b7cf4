"""Options several commands share are declared once (issue 43, item 5): each flag below comes from
one `typer.Option(...)` in cli/common.py, with one help text, however many commands take it."""

import ast
from collections import Counter
from pathlib import Path

import pytest

from conftest import cli_commands

CLI = Path(__file__).resolve().parents[2] / "src/sparsedecode/cli"
SHARED = ["--proj-keep", "--kv", "--kv-keep", "--thresholds", "--adapter", "--method", "--device", "--dtype", "--threads",
          "--max-len", "--text-file", "--json", "--obs"]


def declarations(sources: dict[str, str]) -> dict[str, Counter]:
    """flag -> Counter of the files declaring it: every `typer.Option(...)` or `Option(...)` call
    (Annotated or default style), its flag strings read from the call's positional arguments."""
    found: dict[str, Counter] = {}
    for name, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if not ((isinstance(f, ast.Attribute) and f.attr == "Option") or (isinstance(f, ast.Name) and f.id == "Option")):
                continue
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("--"):
                    found.setdefault(arg.value, Counter())[name] += 1
    return found


def cli_sources() -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(CLI.glob("*.py"))}


@pytest.mark.parametrize("flag", SHARED)
def test_each_shared_option_is_declared_once_in_common(flag):
    where = declarations(cli_sources()).get(flag, Counter())
    assert sum(where.values()) == 1, f"{flag} is declared {sum(where.values())} times: {dict(where)}"
    assert where["common.py"] == 1, f"{flag} is declared in {dict(where)}, not in cli/common.py"


def test_the_count_sees_both_declaration_styles():
    """A second declaration, in either style, is counted (so the test above can fail)."""
    dup = {
        "a.py": 'X = Annotated[str, typer.Option("--kv", help="one")]',
        "b.py": 'def f(kv: str = typer.Option(None, "--kv", help="two"), j: bool = Option(False, "--json")): ...',
    }
    found = declarations(dup)
    assert found["--kv"] == Counter({"a.py": 1, "b.py": 1}) and found["--json"] == Counter({"b.py": 1})


def test_every_shared_option_reaches_a_command():
    """Each shared flag is taken by some command, with the help text of its one declaration."""
    helps: dict[str, set[str]] = {}
    for _, cmd in cli_commands():
        for p in cmd.params:
            for o in getattr(p, "opts", []):
                helps.setdefault(o, set()).add(p.help)
    for flag in SHARED:
        assert len(helps.get(flag, ())) == 1, (flag, helps.get(flag))
