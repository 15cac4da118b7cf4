"""`sparsedecode account` end to end, as a subprocess: JSON for scripts, one-line errors."""

import json
import subprocess
import sys

import pytest


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "sparsedecode", "account", *args], capture_output=True, text=True
    )


def test_json_has_crossovers_bounds_and_bytes():
    r = run("--model", "llama-3.1-8b", "--proj-keep", "0.5", "--kv-keep", "0.3", "--context", "128K", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["crossover_tokens"] == 76_069
    assert out["crossover_ff_tokens"] == 61_440
    assert set(out["bounds"]) == {"projection", "kv", "both"}
    assert round(out["bounds"]["kv"], 2) == 1.60
    assert set(out["bytes"]) == {"mlp", "attn", "kv", "other", "total"}
    assert round(out["bytes"]["total"] / 1e9, 1) == 32.2
    b = out["bytes"]
    assert b["total"] == pytest.approx(b["mlp"] + b["attn"] + b["kv"] + b["other"])


def test_context_spellings_agree():
    outs = {
        json.loads(run("--model", "qwen3-8b", "--context", c, "--json").stdout)["bytes"]["kv"]
        for c in ("32768", "32K", "32k")
    }
    assert len(outs) == 1


def test_batched_budget_and_traffic_in_json():
    r = run(
        "--model",
        "llama-3.1-8b",
        "--batch",
        "4",
        "--union",
        "0.92",
        "--budget",
        "4K",
        "--contexts",
        "512,32K",
        "--json",
    )
    out = json.loads(r.stdout)
    assert round(out["batched"]["crossover_exact"] / 1024, 1) == 3.0
    assert out["fixed_budget"]["budget_tokens"] == 4096
    assert [row["context"] for row in out["traffic"]] == [512, 32768]


def test_human_output_shows_crossover():
    r = run("--model", "llama-3.1-8b")
    assert r.returncode == 0
    assert "76,069" in r.stdout and "74.3K" in r.stdout


@pytest.mark.parametrize("budget, expected", [("0.2", "35.7K"), ("0.5", "48.1K"), ("1.0", "57.8K")])
def test_matched_json(budget, expected):
    r = run(
        "matched",
        "--model",
        "llama-3.1-8b",
        "--proj",
        "0.7:0.18,0.6:0.402,0.5:0.995",
        "--sel",
        "0.5:-0.007,0.3:0.004,0.2:0.004,0.1:0.06",
        "--budget",
        budget,
        "--json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert f"{out['crossover_tokens'] / 1024:.1f}K" == expected
    assert out["kv_keep"] == 0.1 and 0.5 <= out["proj_keep"] < 0.7


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--model", "llama-3.1-8b", "--proj-keep", "1.5"], "outside (0, 1]"),
        (["--model", "llama-3.1-8b", "--kv-keep", "0"], "outside (0, 1]"),
        (["--model", "lama-3.1-8b"], "did you mean 'llama-3.1-8b'"),
        (["--model", "llama-3.1-8b", "--context", "12Q"], "not a token count"),
        (["--model", "llama-3.1-8b", "--contexts", "2K,,x"], "not a token count"),
        (["--config", "/nonexistent/config.json"], "no config"),
        (
            [
                "matched",
                "--model",
                "llama-3.1-8b",
                "--proj",
                "0.7",
                "--sel",
                "0.1:0.06",
                "--budget",
                "0.2",
            ],
            "KEEP:DELTA",
        ),
        (
            [
                "matched",
                "--model",
                "llama-3.1-8b",
                "--proj",
                "1.7:0.1",
                "--sel",
                "0.1:0.06",
                "--budget",
                "0.2",
            ],
            "outside (0, 1]",
        ),
        (["--proj-keep", "0.9", "plot", "--model", "llama-3.1-8b", "--out", "x.png"], "--proj-keep before 'plot' would be ignored"),
        (["--model", "qwen3-8b", "matched", "--model", "llama-3.1-8b", "--proj", "0.5:0.1", "--sel", "0.3:0.01",
          "--budget", "0.2"], "--model before 'matched'"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, needle):
    r = run(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert needle in lines[0] and lines[0].startswith("error: ")


def test_config_missing_field(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(
        json.dumps(
            {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 10}
        )
    )
    r = run("--config", str(p))
    assert r.returncode == 2 and "missing 'intermediate_size'" in r.stderr


def test_plot_writes_png(tmp_path):
    out = tmp_path / "bounds.png"
    r = run("plot", "--model", "llama-3.2-3b", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
