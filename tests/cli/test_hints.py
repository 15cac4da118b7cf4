"""An error names only options its caller has (issue 48, item 2): on the command line every
`--flag` a refusal prints is a flag of the command that printed it (or of the command a hint says
to run), and from Python the same hint names the keyword (`max_len=`), never a flag."""

from __future__ import annotations

import pytest
from test_bad_input import CASES, PAPER, files  # noqa: F401 (files: the bad inputs' fixture)

from conftest import command_of, flags_of, foreign_flags
from sparsedecode.cli import main


def test_the_helpers_read_the_commands_flags():
    words, cmd = command_of(["eval", "passkey", "--context", "2K"])
    assert words == ("eval", "passkey") and "--context" in flags_of(words, cmd)
    assert "--rp" in flags_of(*command_of(["account"]))  # an old name still accepted
    assert foreign_flags("give --config PATH", ["generate"]) == ["--config"]
    assert foreign_flags("make one with sparsedecode dispatch table RECORDS --out gate.json; or --gate",
                         ["generate"]) == []
    assert foreign_flags("use --out-root", ["generate", "--prompt", "x"]) == ["--out-root"]


@pytest.mark.parametrize("case", CASES, ids=[c[0][:60] for c in CASES])
def test_every_flag_an_error_names_is_one_of_its_command(case, files, capsys, monkeypatch):  # noqa: F811
    argv = case[0]
    if "loads" not in case[3:]:
        import sparsedecode

        monkeypatch.setattr(sparsedecode, "load", lambda *a, **k: pytest.fail("a model loaded"))
    if "{paper}" in argv and not PAPER.is_dir():
        pytest.skip(f"ByteCross records not found at {PAPER}")
    args = argv.format(t=files, paper=PAPER).split()
    with pytest.raises(SystemExit):
        main(args)
    err = capsys.readouterr().err
    assert not foreign_flags(err, args), f"{err.strip()} names {foreign_flags(err, args)}, not flags of {args[:2]}"


def test_a_hint_names_a_keyword_from_python_and_a_flag_under_the_cli():
    from sparsedecode.account.dims import resolve_dims
    from sparsedecode.account.known import known_model
    from sparsedecode.errors import InputError, cli_context, option

    assert (option("max_len"), option("device", "cpu"), option("config", "PATH", placeholder=True)) == \
        ("max_len=", "device='cpu'", "config=PATH")
    assert option("verdicts", flag="--admit") == "verdicts=" and option("text_file", python="text") == "text"
    with cli_context():
        assert (option("max_len"), option("device", "cpu"), option("verdicts", flag="--admit")) == \
            ("--max-len", "--device cpu", "--admit")
        assert option("reclaim", True) == "--reclaim" and option("text_file", python="text") == "--text-file"
    with pytest.raises(InputError, match=r"give exactly one of model=NAME or config=PATH$"):
        resolve_dims()
    with pytest.raises(InputError, match=r"or pass config=PATH to a config.json$"):
        known_model("nope")


def test_generate_names_no_config_flag_for_an_unknown_model(capsys):
    from conftest import run_cli

    r = run_cli(capsys, "generate", "--prompt", "hi", "--model", "llama-3.1-8bb")
    assert r.returncode == 2 and "did you mean 'llama-3.1-8b'" in r.stderr and "HF folder, a .gguf file" in r.stderr
    assert not foreign_flags(r.stderr, ["generate"])
