"""Options every command shares (issue 28, item 4): -h, --version, the prompt from a file or stdin."""

import subprocess
import sys

from sparsedecode import __version__


def sd(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "sparsedecode", *args], capture_output=True, text=True, input=stdin)


def test_version_and_short_help():
    r = sd("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"sparsedecode {__version__}"
    for args in (["-h"], ["account", "-h"], ["dispatch", "price", "-h"], ["generate", "-h"]):
        r = sd(*args)
        assert r.returncode == 0 and r.stdout.startswith("Usage:"), (args, r.stderr)


def test_prompt_from_stdin_and_file_match_the_flag(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("The capital of France is\n")
    common = ["generate", "--device", "cpu", "-n", "3", "--json"]
    import json

    a = json.loads(sd(*common, "--prompt", "The capital of France is").stdout)
    b = json.loads(sd(*common, "--prompt-file", str(f)).stdout)
    assert a["ids"] == b["ids"] and a["prompt_tokens"] == b["prompt_tokens"] and a["load_s"] > 0
    c = sd(*common[:-1], "--prompt", "-", stdin="The capital of France is\n")
    assert c.returncode == 0 and c.stdout.strip() == a["text"].strip()
    assert "[loaded smollm2-135m from" in c.stderr and f"prompt {a['prompt_tokens']} tokens" in c.stderr


def test_report_never_rewrites_a_committed_report_unasked(tmp_path):
    camp = tmp_path / "camp"
    (camp / "report").mkdir(parents=True)
    (camp / "report" / "report.md").write_text("# committed\n")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "add", "camp/report/report.md"], check=True)
    r = sd("report", str(camp))
    assert r.returncode == 2 and "holds a committed report" in r.stderr and "--out" in r.stderr
    assert (camp / "report" / "report.md").read_text() == "# committed\n"
