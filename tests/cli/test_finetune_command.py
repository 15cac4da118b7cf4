"""`sparsedecode finetune` and `--adapter` on the command line (issue 45 items 1-2): bad input is one
line and exit code 2, and a run stopped by SIGTERM is checkpointed and resumed by the same command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require_embedded, run_cli
from shapes import tiny_llama

TINY = tiny_llama()
SRC = str(Path(__file__).resolve().parents[2] / "src")


def _one_line_error(r, *fragments):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for f in fragments:
        assert f in lines[0], (f, lines[0])


def _smollm2_thresholds(path: Path) -> Path:
    """A CATS thresholds file of smollm2-135m's dims (values made up: these tests never score it)."""
    from sparsedecode.account.dims import ModelDims
    from sparsedecode.account.known import known_model
    from sparsedecode.projection.thresholds import Thresholds

    dims = ModelDims.from_config(known_model("smollm2-135m").config, name="smollm2-135m")
    th = Thresholds({f"layers.{i}.act": 0.02 for i in range(dims.n_layers)}, "cats", 0.5, dims.name,
                    dims.to_dict(), keep_metric="act_keep")
    return th.save(path)


@pytest.mark.parametrize("argv, fragments", [
    (["--rank", "0"], ["--rank 0: the LoRA rank must be a whole number >= 1"]),
    (["--rank", "-3"], ["--rank -3"]),
    (["--targets", "ffn"], ["--targets ffn: LoRA targets are one of mlp, all"]),
    (["--steps", "0"], ["--steps must be >= 1"]),
    (["--tokens", "64", "--seq-len", "256"], ["--tokens 64 holds less than one step"]),
])
def test_bad_options_are_one_line(capsys, tmp_path, argv, fragments):
    r = run_cli(capsys, "finetune", "--thresholds", str(tmp_path / "t.safetensors"), "--out", str(tmp_path / "a"), *argv)
    _one_line_error(r, *fragments)


def test_thresholds_are_required(capsys, tmp_path):
    _one_line_error(run_cli(capsys, "finetune", "--out", str(tmp_path / "a")), "give --thresholds FILE")


def test_text_shorter_than_the_tokens_is_refused_before_the_model_loads(capsys, tmp_path):
    require_embedded("smollm2-135m")
    th = _smollm2_thresholds(tmp_path / "t.safetensors")
    text = tmp_path / "short.txt"
    text.write_text("A short text of a few words.\n")
    r = run_cli(capsys, "finetune", "--thresholds", str(th), "--text-file", str(text), "--tokens", "4K",
                "--out", str(tmp_path / "a"))
    _one_line_error(r, "fewer than --tokens 4,096", "give a longer --text-file or a smaller --tokens")


def test_a_missing_adapter_is_refused_before_the_model_loads(capsys, tmp_path):
    r = run_cli(capsys, "generate", "--prompt", "hi", "--adapter", str(tmp_path / "nope"))
    _one_line_error(r, "not a folder", "sparsedecode finetune --out DIR")


def test_an_adapter_of_other_dims_is_one_line(capsys, tmp_path):
    """bench cell of a random model (no download) with an adapter made for other dims."""
    import torch

    import sparsedecode
    from sparsedecode.projection.lora import (
        LoraFactor,
        LoraSpec,
        projection_shape,
        save_adapter,
        site_of,
    )

    other = sparsedecode.load({**TINY, "intermediate_size": 96}, init="random", max_len=32)
    spec = LoraSpec(rank=2, alpha=4)
    factors = {}
    for i in range(2):
        for m in spec.modules:
            o, n = projection_shape(other.dims, m)
            factors[site_of(i, m)] = LoraFactor(torch.zeros(2, n), torch.zeros(o, 2), 2.0)
    adapter = save_adapter(tmp_path / "ad", spec, factors, {"model": other.name, "dims": other.dims.to_dict()})
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    r = run_cli(capsys, "bench", "cell", "--model", str(model), "--init", "random", "--context", "32",
                "--device", "cpu", "--adapter", str(adapter))
    _one_line_error(r, "dims differ", "d_ff 96 (adapter) vs 128 (model)")


@pytest.mark.slow
def test_sigterm_checkpoints_and_the_same_command_resumes(tmp_path):
    """SIGTERM once the run has started: the step under way finishes and is checkpointed, the
    command exits 130 saying how to resume; the same command then finishes the run."""
    require_embedded("smollm2-135m")
    th = _smollm2_thresholds(tmp_path / "t.safetensors")
    out = tmp_path / "ad"
    cmd = [sys.executable, "-m", "sparsedecode", "finetune", "--thresholds", str(th), "--out", str(out),
           "--tokens", "256", "--seq-len", "8", "--steps", "4", "--warmup", "1", "--threads", "2"]
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    for line in p.stderr:  # the header comes once the handlers are installed
        if line.startswith("fine-tuning smollm2-135m"):
            p.send_signal(signal.SIGTERM)
            break
    err = p.stderr.read()
    assert p.wait(timeout=300) == 130, err
    assert "interrupted: stopped by SIGTERM after step 1 of 4" in err and "run the same command again" in err
    assert (out / ".finetune_checkpoint.pt").exists() and not (out / "finetune.json").exists()
    import torch

    first = torch.load(out / ".finetune_checkpoint.pt", weights_only=True)["losses"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    rec = json.loads((out / "finetune.json").read_text())
    assert len(rec["loss"]) == 4 and rec["loss"][:1] == [round(x, 6) for x in first]
    assert not (out / ".finetune_checkpoint.pt").exists()


def test_a_rank_above_the_projections_width_is_refused_before_the_model_loads(capsys, tmp_path):
    """r = 100,000 on smollm2-135m once asked peft for tens of GB and was killed by the OOM killer."""
    require_embedded("smollm2-135m")
    th = _smollm2_thresholds(tmp_path / "t.safetensors")
    r = run_cli(capsys, "finetune", "--thresholds", str(th), "--out", str(tmp_path / "a"), "--rank", "100000",
                "--targets", "all")
    _one_line_error(r, "--rank 100000 is above 192", "give a rank of at most 192")
    r = run_cli(capsys, "finetune", "--thresholds", str(th), "--out", str(tmp_path / "a"), "--rank", "577")
    _one_line_error(r, "--rank 577 is above 576")
