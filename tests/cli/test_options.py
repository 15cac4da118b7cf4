"""Options every command shares (issue 28, item 4): -h, --version, the prompt from a file or stdin,
and a report that never rewrites a committed one unasked."""

import io
import json
import subprocess
import sys

import pytest

from conftest import run_cli
from sparsedecode import __version__


def sd(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "sparsedecode", *args], capture_output=True, text=True, input=stdin)


def run(capsys, *args):
    """(exit code, stdout, stderr) of the CLI run in this process (no interpreter start-up)."""
    r = run_cli(capsys, *args)
    return r.returncode, r.stdout, r.stderr


def test_version_and_short_help():
    r = sd("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"sparsedecode {__version__}"
    r = sd("dispatch", "price", "-h")
    assert r.returncode == 0 and r.stdout.startswith("Usage: sparsedecode dispatch price")


@pytest.mark.parametrize("args, shown", [
    (["-h"], []),
    (["account", "-h"], ["--proj-keep KEEP", "--context TOKENS", "--bandwidth GB/S", "--model MODEL"]),
    (["generate", "-h"], ["--temperature TEMP", "--seed SEED", "--kv-keep KEEP", "--prompt PROMPT"]),
    (["eval", "passkey", "-h"], ["--context TOKENS", "--kv-keep KEEP", "--threads N"]),
])
def test_short_help_and_metavars(capsys, args, shown):
    code, out, _ = run(capsys, *args)
    assert code == 0 and out.startswith("Usage: sparsedecode")
    for s in shown:
        assert s in out, s
    assert "<str>" not in out.split("Options:")[-1].split("Commands:")[0] or args == ["-h"]


def test_prompt_from_stdin_and_file_match_the_flag(tmp_path, capsys, monkeypatch):
    f = tmp_path / "p.txt"
    f.write_text("The capital of France is\n")
    common = ["generate", "--device", "cpu", "-n", "3", "--json"]
    a = json.loads(run(capsys, *common, "--prompt", "The capital of France is")[1])
    b = json.loads(run(capsys, *common, "--prompt-file", str(f))[1])
    assert a["ids"] == b["ids"] and a["prompt_tokens"] == b["prompt_tokens"] and a["load_s"] > 0
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"The capital of France is\n")))
    code, out, err = run(capsys, *common[:-1], "--prompt", "-")
    assert code == 0 and out.strip() == a["text"].strip()
    assert "[loaded smollm2-135m from" in err and f"prompt {a['prompt_tokens']} tokens" in err


def test_report_never_rewrites_a_committed_report_unasked(tmp_path, capsys):
    camp = tmp_path / "camp"
    (camp / "report").mkdir(parents=True)
    (camp / "report" / "report.md").write_text("# committed\n")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "add", "camp/report/report.md"], check=True)
    code, _, err = run(capsys, "report", str(camp))
    assert code == 2 and "holds a committed report" in err and "--out" in err
    assert (camp / "report" / "report.md").read_text() == "# committed\n"
