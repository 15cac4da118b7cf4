"""Token counts (issue 43, item 5): every option whose value is a token count takes 32768, 32K or
32k, and refuses a bad one in one line with exit code 2 before any model loads."""

import re

import pytest

from conftest import cli_commands
from sparsedecode.cli import main

ALL = list(cli_commands())


# Options whose value is a token count; each takes 32K (K = 1,024 tokens). `--budget` is one only
# in `account` (a KV budget); in `account matched` and `eval admit` it is a quality budget.
TOKEN_FLAGS = {"--max-len", "--max-new-tokens", "--context", "--tokens", "--calib-tokens", "--eval-tokens",
               "--held-out-tokens", "--window", "--length", "--scored", "--new", "--obs", "--budget",
               "--max-context", "--spacing", "--half-width", "--max-tokens", "--seq-len"}


def token_options():
    for path, cmd in ALL:
        for p in cmd.params:
            flags = set(getattr(p, "opts", ())) & TOKEN_FLAGS
            if flags and not (flags == {"--budget"} and path != ("account",)):
                yield path, cmd, p, sorted(flags)[0]


TOKEN_OPTIONS = list(token_options())


def test_every_token_flag_is_found():
    assert {f for *_, f in TOKEN_OPTIONS} == TOKEN_FLAGS
    # and no option whose help speaks of tokens is missing from the list
    found = {id(p) for _, _, p, _ in TOKEN_OPTIONS}
    others = {o for _, c in ALL for p in c.params for o in getattr(p, "opts", ())
              if p.help and re.search(r"\btokens\b", p.help, re.I) and id(p) not in found}
    assert others <= {"--contexts", "--request", "--routing", "--chunks", "--protocol", "--gate"}, others


@pytest.mark.parametrize("path, cmd, param, flag", TOKEN_OPTIONS,
                         ids=[" ".join(p) + " " + f for p, _, _, f in TOKEN_OPTIONS])
def test_token_counts_take_32k(path, cmd, param, flag):
    ctx = cmd.make_context(" ".join(path), [flag, "32K"], resilient_parsing=True)
    assert ctx.params[param.name] == 32768
    assert param.metavar == "TOKENS"


@pytest.mark.parametrize("path, cmd, param, flag", TOKEN_OPTIONS,
                         ids=[" ".join(p) + " " + f for p, _, _, f in TOKEN_OPTIONS])
def test_a_bad_token_count_fails_in_one_line(path, cmd, param, flag, capsys, monkeypatch):
    import sparsedecode

    monkeypatch.setattr(sparsedecode, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as exc:
        main([*path, flag, "12Q"])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert err.count("\n") == 1 and err.startswith(f"error: {flag} '12Q' is not a token count"), err
