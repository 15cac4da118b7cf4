"""`sparsedecode dispatch price|table` end to end, as a subprocess: Table 5, traces, bad input."""

import json
import shutil
import subprocess
import sys

import pytest
from _tables import paper

from conftest import require_embedded, run_cli


def run(*args):
    return subprocess.run([sys.executable, "-m", "sparsedecode", "dispatch", *args], capture_output=True, text=True)


def one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    for n in needles:
        assert n in r.stderr, r.stderr


@pytest.mark.parametrize("folder, select_s, want", [
    ("sweep_a100", "0.24", {"proj": 1.27, "both": 1.40, "gate": 1.40}),
    ("sweep_a6000", "0.32", {"proj": 1.52, "both": 1.69, "gate": 1.72}),
])
def test_table_5_on_the_command_line(folder, select_s, want):
    r = run("price", str(paper(folder)), "--select-seconds", select_s, "--mix", "mixed", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for k, v in want.items():
        assert abs(out["speedup"][k] - v) <= 0.01, (k, out["speedup"][k])
    assert set(out["speedup"]) >= {"proj", "sel", "both", "gate"}
    assert sum(out["shares"]["gate"].values()) == pytest.approx(1.0)
    assert out["mix"]["requests"] == 2000 and out["inputs"]["gpu"].startswith("NVIDIA")


def test_rich_table_and_plot(tmp_path):
    png = tmp_path / "gate.png"
    r = run("price", str(paper("sweep_a100")), "--select-seconds", "0.24", "--plot", str(png))
    assert r.returncode == 0, r.stderr
    assert "calibrated" not in r.stderr and "gate" in r.stdout and "long_doc" in r.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_trace_prices_through_the_same_path(tmp_path):
    trace = tmp_path / "traffic.jsonl"
    trace.write_text("\n".join(json.dumps({"prompt_tokens": p, "answer_tokens": a})
                               for p, a in [(300, 64), (2000, 512), (90000, 128), (40000, 1024)]) + "\n")
    r = run("price", str(paper("sweep_a100")), "--select-seconds", "0.24", "--mix", str(trace), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["mix"]["requests"] == 4 and out["mix"]["name"] == "traffic"
    assert set(out["workloads"]) == {"traffic", "mixed", "chat", "long_doc", "agent"}
    bad = tmp_path / "bad.csv"
    bad.write_text("prompt_tokens,answer_tokens\n100,20\n100,twenty\n")
    one_line_error(run("price", str(paper("sweep_a100")), "--select-seconds", "0.24", "--mix", str(bad)), "line 3")


def test_a_gate_table_prices_as_its_records(tmp_path):
    gate = tmp_path / "gate.json"
    r = run("table", str(paper("sweep_a6000")), "--select-seconds", "0.32", "--out", str(gate))
    assert r.returncode == 0, r.stderr
    assert json.loads(gate.read_text())["kind"] == "gate_table"
    a = json.loads(run("price", str(paper("sweep_a6000")), "--select-seconds", "0.32", "--json").stdout)
    b = json.loads(run("price", str(gate), "--json").stdout)
    assert a["speedup"] == b["speedup"]
    assert run("table", str(paper("sweep_a6000")), "--select-seconds", "0.32", "--out", str(gate)).returncode == 0


def test_bad_input_is_one_line_with_exit_2(tmp_path):
    a100 = str(paper("sweep_a100"))
    one_line_error(run("price", a100, "--select-seconds", "-0.2"), "--select-seconds")
    one_line_error(run("price", a100), "--select-seconds")  # the paper's records hold only the gather
    one_line_error(run("price", str(tmp_path / "nowhere")), "no such folder")
    one_line_error(run("table", a100, "--select-seconds", "0.2", "--out", str(tmp_path)), "is a folder")
    one_line_error(run("price", a100, "--select-seconds", "0.2", "--plot", str(tmp_path / "x.pdf")), ".png")
    no_dense = tmp_path / "sel_only"
    no_dense.mkdir()
    for f in paper("sweep_a100").glob("*_sel30.json"):
        shutil.copy(f, no_dense)
    one_line_error(run("price", str(no_dense), "--select-seconds", "0.2"), "no dense curve")
    mixed = tmp_path / "two_gpus"
    for name in ("sweep_a100", "sweep_a6000"):
        shutil.copytree(paper(name), mixed / name)
    one_line_error(run("price", str(mixed / "sweep_a100"), str(mixed / "sweep_a6000"), "--select-seconds", "0.2"),
                   "one model on one device")
    verdict = tmp_path / "v.json"
    verdict.write_text(json.dumps({"kind": "ppl_eval"}))
    one_line_error(run("price", a100, "--select-seconds", "0.2", "--admit", str(verdict)), "'admissibility'")


def test_generate_refuses_a_gate_of_another_model(tmp_path, capsys):
    require_embedded("smollm2-135m")  # the model is loaded before its name is checked against the gate's
    gate = tmp_path / "a100.json"
    assert run("table", str(paper("sweep_a100")), "--select-seconds", "0.24", "--out", str(gate)).returncode == 0
    r = run_cli(capsys, "generate", "--model", "smollm2-135m", "--device", "cpu", "--gate", str(gate),
              "--prompt", "Hello", "-n", "2")
    one_line_error(r, "timed on Llama-3.1-8B-Instruct", "the engine runs smollm2-135m")
    r = run_cli(capsys, "generate", "--gate", str(gate), "--kv", "snapkv", "--kv-keep", "0.3", "--prompt", "Hello")
    one_line_error(r, "--gate chooses the configuration per request")


def test_generate_under_a_cpu_gate_reports_its_choice(tmp_path, capsys):
    from _tables import CPU_CELLS

    if not CPU_CELLS.is_dir():
        pytest.skip("CPU cell records not committed")
    require_embedded("smollm2-135m")  # a GPU machine without network skips; CI fetches it
    gate = tmp_path / "cpu.json"
    r = run("table", str(CPU_CELLS), "--assume-admissible", "--out", str(gate))
    assert r.returncode == 0 and "assumed admissible" in r.stdout, r.stdout + r.stderr
    r = run_cli(capsys, "generate", "--model", "smollm2-135m", "--device", "cpu", "--gate", str(gate),
              "--prompt", "The capital of France is", "-n", "4", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    g = out["gate"]
    assert g["mode"] in json.loads(gate.read_text())["configs"] and out["kv"] is None  # 5 tokens hold no KV budget
    assert g["predicted_ms_per_token"] > 0 and g["ms_per_token"] > 0 and 0 <= g["choose_ms"] < 100.0
