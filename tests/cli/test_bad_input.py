"""Bad input on every command (issue 28, item 7): each case exits with its code and a message
naming what to change; none prints a traceback, and none loads a model before refusing.

Cases run in-process through `sparsedecode.cli.main`, as the console script does: an exception
other than the one-line InputError would escape here and fail the case. `sparsedecode.load` is
replaced by a function that fails the case, so a command that loads its model before checking
its arguments is caught (item 3, 'check before work')."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparsedecode.cli import main

PAPER = Path(__file__).resolve().parents[2] / "data/bytecross/sweep_a100"
TINY = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=100, max_position_embeddings=256)

# (argv with {t} for the tmp folder, exit code, a fragment of stderr[, "loads": the error comes from
# loading the model itself])
CASES = [
    # account
    ("account --model llama-3.1-8b --proj-keep 1.5", 2, "outside (0, 1]"),
    ("account --model llama-3.1-8b --rp 1.5", 2, "--rp is now --proj-keep"),
    ("account --model llama-3.1-8b --proj-keep abc", 2, "--proj-keep"),
    ("account --model llama-3.1-8b --kv-keep 0", 2, "--kv-keep"),
    ("account --model no-such-model", 2, "no-such-model"),
    ("account --model llama-3.1-8b --context 12Q", 2, "not a token count"),
    ("account --model llama-3.1-8b --context 0", 2, "positive number of tokens"),
    ("account --model llama-3.1-8b --batch 4", 2, "go together"),
    ("account --model llama-3.1-8b --batch 4 --union 0.3", 2, "below --proj-keep"),
    ("account --model llama-3.1-8b --batch 0 --union 0.9", 2, "batch"),
    ("account --model llama-3.1-8b --cost-proj -1 --cost-kv 0 --bandwidth 100", 2, "not a kernel cost"),
    ("account --model llama-3.1-8b --cost-proj 1", 2, "go together"),
    ("account --model llama-3.1-8b --cost-proj 1 --cost-kv 1 --bandwidth -5", 2, "--bandwidth"),
    ("account --model llama-3.1-8b --weight-bytes 0", 2, "--weight-bytes"),
    ("account --model llama-3.1-8b --kv-bytes 1e308", 2, "not an element size"),
    ("account --model llama-3.1-8b --routed 2", 2, "--routed"),
    ("account --model llama-3.1-8b --contexts 2K,abc", 2, "not a token count"),
    ("account --model llama-3.1-8b --budget -4", 2, "--budget"),
    ("account --proj-keep 0.9 plot --model llama-3.1-8b --out {t}/x.png", 2, "would be ignored"),
    ("account --config {t}/none.json", 2, "none.json"),
    ("account --config {t}/latin1.json", 2, "not UTF-8"),
    ("account --config {t}/moe.json", 2, "mixture of experts"),
    ("account --config {t}/zero_heads.json", 2, "positive whole number"),
    ("account --config {t}/string_dims.json", 2, "positive whole number"),
    ("account --config {t}/list.json", 2, "expected an object"),
    ("account --config {t}/broken.json", 2, "not valid JSON"),
    ("account matched --model llama-3.1-8b --proj x --sel 0.3:0.01 --budget 0.2", 2, "KEEP:DELTA"),
    # generate: everything checked before the model loads
    ("generate", 2, "give the prompt as --prompt TEXT"),
    ("generate --prompt hi --prompt-file {t}/latin1.txt", 2, "one of them"),
    ("generate --prompt-file {t}/none.txt", 2, "no such file"),
    ("generate --prompt-file {t}/latin1.txt", 2, "not UTF-8"),
    ("generate --prompt hi --threads 0", 2, "--threads"),
    ("generate --prompt hi --temperature nan", 2, "--temperature"),
    ("generate --prompt hi --temperature -1", 2, "--temperature"),
    ("generate --prompt hi --top-p 0", 2, "--top-p"),
    ("generate --prompt hi --seed -5", 2, "--seed"),
    ("generate --prompt hi --seed 99999999999999999999999", 2, "--seed"),
    ("generate --prompt hi --thresholds {t}/a.st --proj-keep 0.5", 2, "not both"),
    ("generate --prompt hi --kv snapkv", 2, "--kv-keep"),
    ("generate --prompt hi --kv-keep 0.3", 2, "--kv"),
    ("generate --prompt hi --kv magic --kv-keep 0.3", 2, "magic"),
    ("generate --prompt hi --kv snapkv --kv-keep 1.5", 2, "outside (0, 1]"),
    ("generate --prompt hi --proj-keep 2", 2, "outside (0, 1]"),
    ("generate --prompt hi --thresholds {t}/none.safetensors", 2, "none.safetensors"),
    ("generate --prompt hi --thresholds {t}/nan.safetensors", 2, "is nan"),
    ("generate --prompt hi --routing {t}/none.st", 2, "--thresholds"),
    ("generate --prompt hi --gate {t}/none.json", 2, "not found"),
    ("generate --prompt hi --gate {t}/gate.json --proj-keep 0.5", 2, "--gate chooses"),
    ("generate --prompt hi --attention foo", 2, "foo"),
    ("generate --prompt hi --text-file {t}/latin1.txt", 2, "nothing calibrates here"),
    ("generate --prompt hi --thresholds {t}/nan.safetensors --text-file {t}/latin1.txt", 2, "is nan"),
    ("generate --prompt hi --proj-keep 0.5 --text-file {t}/latin1.txt", 2, "not UTF-8"),
    ("generate --prompt hi --proj-keep 0.5 --text-file {t}/none.txt", 2, "no text at"),
    ("serve --init random --proj-keep 0.5 --text-file {t}/latin1.txt", 2, "--init random"),
    ("serve --text-file {t}/latin1.txt", 2, "nothing calibrates here"),
    ("generate --prompt hi --max-len 0", 2, "--max-len"),
    ("generate --prompt hi --max-new-tokens -3", 2, "new tokens"),
    ("generate --prompt hi --device tpu", 2, "tpu"),
    ("generate --prompt hi --dtype int8", 2, "int8"),
    ("generate --prompt hi --device cpu --model {t}/trunc.gguf", 2, "not a readable GGUF", "loads"),
    ("generate --prompt hi --device cpu --model {t}/no_such_folder", 2, "no_such_folder", "loads"),
    # calibrate
    ("calibrate --method nope --proj-keep 0.5 --out {t}/th.safetensors", 2, "nope"),
    ("calibrate --proj-keep 0 --out {t}/th.safetensors", 2, "--proj-keep"),
    ("calibrate --keep 0 --out {t}/th.safetensors", 2, "--keep is now --proj-keep"),
    ("calibrate --out {t}", 2, "is a folder"),
    ("calibrate --out {t}/exists.safetensors", 2, "exists"),
    ("calibrate --out {t}/th.safetensors --text-file {t}/latin1.txt", 2, "not UTF-8"),
    ("calibrate --out {t}/th.safetensors --tokens 12Q", 2, "not a token count"),
    # report
    ("report {t}/no_campaign", 2, "not found"),
    ("report {t}/empty", 2, "no timing records"),
    ("report {paper} --peak-gbps -1", 2, "--peak-gbps"),
    ("report {paper} --ceiling {t}/no_ceiling.json", 2, "--ceiling"),
    ("bench ceiling --gib 0", 2, "--gib must be > 0"),
    ("bench ceiling --replays 0", 2, "--replays"),
    ("bench ceiling --out {t}", 2, "is a folder"),
    ("campaign plan-crossing {paper} --prediction {t}/p.txt --spec {t}/c.toml", 2, "must end in .json"),
    ("report {paper} --out {t}/exists.safetensors", 2, "--out"),
    # campaign
    ("campaign run {t}/none.toml --out {t}/run", 2, "none.toml"),
    ("campaign plan-crossing {t}/no_campaign --prediction {t}/p.json --spec {t}/c.toml", 2, "not found"),
    ("campaign plan-crossing {paper} --prediction {t}/p.json --spec {t}/c.toml --spacing 16K", 2, "at most 8K"),
    ("campaign run {t}/latin1.toml --out {t}/run", 2, "not UTF-8"),
    ("campaign run {t}/broken.toml --out {t}/run", 2, "broken.toml"),
    ("campaign run {t}/cpu.toml --out {t}/run --gpus 0,1", 2, "share its cores"),
    ("campaign run {t}/cpu.toml --out {t}/run --max-cells -1", 2, "--max-cells"),
    ("campaign run {t}/cpu.toml --out {t}/run --executor foo", 2, "foo"),
    ("campaign run {t}/cpu.toml --out {t}/exists.safetensors", 2, "--out"),
    ("campaign run {t}/cpu.toml --out {t}/run --stop-after 0", 2, "--stop-after must be > 0"),
    ("campaign run {t}/cpu.toml", 2, "--out-root"),
    ("campaign run {t}/cpu.toml --out {t}/a --out-root {t}/b", 2, "--out-root"),
    ("campaign run {t}/cpu.toml {t}/cpu.toml --out {t}/run", 2, "use --out-root"),
    ("campaign run {t}/cpu.toml {t}/cpu.toml --out-root {t}/runs", 2, "share the name"),
    ("campaign run {t}/cpu.toml {t}/none.toml --out-root {t}/runs", 2, "none.toml"),
    ("campaign status {t}/no_campaign", 2, "no_campaign"),
    # bench cell
    ("bench cell --model smollm2-135m --mode foo --context 256 --out {t}/c1.json", 2, "mode 'foo'"),
    ("bench cell --model smollm2-135m --mode dense --context abc --out {t}/c2.json", 2, "not a token count"),
    # dispatch
    ("dispatch price {t}/no_campaign", 2, "no such folder"),
    ("dispatch price {paper} --select-seconds -1", 2, "--select-seconds"),
    ("dispatch price {paper} --select-seconds 0.2 --mix {t}/bad.csv", 2, "line 3"),
    ("dispatch price {paper} --select-seconds 0.2 --seed -1", 2, "--seed"),
    ("dispatch table {paper} --select-seconds 0.2 --out {t}", 2, "is a folder"),
    ("dispatch check {t}/gate.json --model llama-3.1-8b --request 2K", 2, "PROMPT:ANSWER"),
    ("dispatch check {t}/gate.json --model llama-3.1-8b --request 2K:16 --init random --text-file {t}/latin1.txt",
     2, "--init random"),
    ("dispatch check {t}/gate.json --model smollm2-135m --request 2K:16 --text-file {t}/latin1.txt", 2, "not UTF-8"),
    # eval
    ("eval admit --ppl {t}/none.json --passkey {t}/none.json --multikey {t}/none.json --budget 0.2", 2, "none.json"),
    ("eval admit --ppl {t}/rec.json --passkey {t}/rec.json --multikey {t}/rec.json --budget lots", 2, "--budget"),
    ("eval ppl --proj-keep 2", 2, "outside (0, 1]"),
    ("eval ppl --kv snapkv", 2, "--kv-keep"),
    ("eval ppl --text-file {t}/latin1.txt", 2, "not UTF-8"),
    ("eval ppl --protocol decode --length 12x", 2, "'12x' is not a token count"),
    ("eval passkey --context 4Q", 2, "'4Q' is not a token count"),
    ("eval passkey --kv snapkv --kv-keep 2", 2, "outside (0, 1]"),
    ("eval passkey --context 2048 --out {t}", 2, "--out"),
    ("eval passkey --context 2048 --out {t}/exists.safetensors", 2, "exists"),
    ("eval passkey --thresholds {t}/nan.safetensors", 2, "is nan"),
    ("eval multikey --kv magic --kv-keep 0.3", 2, "magic"),
    ("eval two-turn --variant sideways", 2, "sideways"),
    ("eval grid --out {t}/exists.safetensors", 2, "--out"),
    ("eval grid --out {t}/g --proj-keeps 0.5,2", 2, "outside (0, 1]"),
    ("eval ppl --out {t}", 2, "--out"),
    ("eval ppl --threads 0", 2, "--threads"),
    ("eval passkey --threads 0", 2, "--threads"),
    ("calibrate --out {t}/th3.safetensors --threads 0", 2, "--threads"),
    ("eval ppl --thresholds {t}/nan.safetensors", 2, "is nan"),
    # route
    ("route build --thresholds {t}/nan.safetensors --out {t}/r.st", 2, "is nan"),
    ("route build --thresholds {t}/nan.safetensors --out {t}", 2, "--out"),
    ("route build --thresholds {t}/none.st --out {t}/r2.st --text-file {t}/latin1.txt", 2, "none.st"),
    ("route build --thresholds {t}/none.st --out {t}/r2.st --unseen maybe", 2, "--unseen"),
    ("route build --thresholds {t}/none.st --out {t}/r.st", 2, "none.st"),
    ("route build --thresholds {t}/nan.safetensors --out {t}/r3.st --adapter {t}/nope", 2, "not a folder"),
    ("route calibrate --table {t}/none.st", 2, "none.st"),
    ("route calibrate --table {t}/none.st --target 2", 2, "--target"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    t = tmp_path_factory.mktemp("bad")
    (t / "latin1.json").write_bytes(b'{"name": "caf\xe9"}')
    (t / "latin1.txt").write_bytes(b"caf\xe9 " * 100)
    (t / "latin1.toml").write_bytes(b'name = "caf\xe9"\n')
    (t / "broken.json").write_text('{"hidden_size": 64,')
    (t / "broken.toml").write_text("name = [unclosed\n")
    (t / "list.json").write_text("[1, 2]")
    (t / "moe.json").write_text(json.dumps({**TINY, "num_local_experts": 8, "num_experts_per_tok": 2}))
    (t / "zero_heads.json").write_text(json.dumps({**TINY, "num_attention_heads": 0}))
    (t / "string_dims.json").write_text(json.dumps({**TINY, "hidden_size": "64"}))
    (t / "exists.safetensors").write_bytes(b"x")
    (t / "empty").mkdir()
    (t / "gate.json").write_text(json.dumps({"kind": "gate_table"}))
    (t / "rec.json").write_text(json.dumps({"kind": "ppl_eval"}))
    (t / "bad.csv").write_text("prompt_tokens,answer_tokens\n100,20\n100,twenty\n")
    (t / "trunc.gguf").write_bytes(b"GGUF\x03\x00\x00")
    (t / "cpu.toml").write_text('name = "c"\nmodel = "smollm2-135m"\ninit = "pretrained"\ndevice = "cpu"\n'
                                'dtype = "float32"\nblocks = 1\nrepeats = 2\nsteps = 3\nwarmup = 1\n'
                                'fill = "prefill"\nseed = 0\n'
                                '[[grid]]\ngroup = "g"\ncontexts = [256]\nmodes = ["dense"]\n')
    import torch

    from sparsedecode.projection.thresholds import FORMAT
    from sparsedecode.stfile import save_with_header

    save_with_header(t / "nan.safetensors", {"layers.0.q": torch.tensor(float("nan"))}, FORMAT,
                     {"method": "teal", "keep": 0.5, "model": "m", "dims": {}})
    return t


@pytest.mark.parametrize("case", CASES, ids=[c[0][:60] for c in CASES])
def test_bad_input(case, files, capsys, monkeypatch):
    argv, code, needle = case[:3]
    if "loads" not in case[3:]:  # the error must come before any model loads
        import sparsedecode

        def refuse(*a, **k):
            raise AssertionError("a model was loaded before the bad argument was refused")

        monkeypatch.setattr(sparsedecode, "load", refuse)
    if "{paper}" in argv and not PAPER.is_dir():
        pytest.skip(f"ByteCross records not found at {PAPER}")
    args = argv.format(t=files, paper=PAPER).split()
    with pytest.raises(SystemExit) as exc:
        main(args)
    err = capsys.readouterr().err
    assert exc.value.code == code, (exc.value.code, err)
    assert "Traceback" not in err
    assert needle in err, err


def test_the_suite_covers_every_command():
    commands = {c[0].split()[0] for c in CASES}
    assert commands >= {"account", "generate", "calibrate", "report", "campaign", "bench", "dispatch", "eval",
                        "route"}
    assert len(CASES) >= 60


# Every numeric option has bounds (issue 48, item 7): negative, zero, NaN and huge values are refused
# in one line, before any work. (command, flag, the values it refuses; 'big' is a 20-digit integer)
# `bench cell` checks its own numbers (a campaign's cell writes a 'failed' record), naming the field.
CELL = "bench cell --model smollm2-135m --mode dense --context 256 --device cpu"
NUMERIC = [
    ("bench ceiling", "--gib", "-1 0 nan inf 1e30"), ("bench ceiling", "--replays", "-1 0 nan big"),
    ("bench ceiling", "--calls", "-1 0 nan big"),
    (CELL, "--warmup", "-1 nan big"), (CELL, "--repeats", "-1 0 big"), (CELL, "--steps", "-1 0 big"),
    (CELL, "--seed", "-1 big"), (CELL, "--profile", "-1 big"), ("bench cell", "--context", "big"),
    ("campaign plan-crossing", "--blocks", "-1 0 2 big"), ("campaign run", "--max-cells", "-1 0 big"),
    ("campaign run", "--stop-after", "-1 0 nan inf 1e30"),
    ("dispatch price", "--seed", "-1 big"), ("dispatch check", "--seed", "-1 big"), ("dispatch check", "--repeats", "-1 0 big"),
    ("eval ppl", "--chunks", "-1 0 big"), ("eval ppl", "--windows", "-1 0 big"), ("eval ppl", "--resamples", "-1 0 big"),
    ("eval ppl", "--seed", "-1 big"), ("eval ppl", "--level", "-1 0 1 nan 2"), ("eval ppl", "--length", "big"),
    ("eval grid", "--chunks", "-1 0"), ("eval grid", "--level", "0 nan"),
    ("eval passkey", "--trials", "-1 0 big"), ("eval passkey", "--seed", "-1 big"), ("eval passkey", "--context", "big"),
    ("eval multikey", "--trials", "0"), ("eval two-turn", "--trials", "0"),
    ("account", "--batch", "-1 0 big"), ("account", "--context", "big"),
    ("generate", "--threads", "-1 0 big"), ("generate", "--max-len", "big"), ("generate", "--max-new-tokens", "big"),
    ("calibrate", "--threads", "0 big"), ("calibrate", "--tokens", "big"), ("eval ppl", "--threads", "0 big"),
    ("route build", "--threads", "0 big"), ("route build", "--tokens", "big"), ("route calibrate", "--held-out-tokens", "big"),
]


@pytest.mark.parametrize("cmd, flag, value", [(c, f, v) for c, f, vs in NUMERIC for v in vs.split()],
                         ids=[f"{c} {f} {v}" for c, f, vs in NUMERIC for v in vs.split()])
def test_a_numeric_option_out_of_bounds_is_refused(cmd, flag, value, capsys, monkeypatch):
    import sparsedecode

    monkeypatch.setattr(sparsedecode, "load", lambda *a, **k: pytest.fail("a model loaded"))
    value = "99999999999999999999" if value == "big" else value
    with pytest.raises(SystemExit) as exc:
        main([*cmd.split(), f"{flag}={value}"])  # '=': a negative value is not an option
    err = capsys.readouterr().err
    named = flag if not cmd.startswith("bench cell") else flag.removeprefix("--")  # the cell names its field
    assert exc.value.code == 2 and "Traceback" not in err and named in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_non_utf8_argv_is_refused_in_one_line():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "sparsedecode", "generate", "--prompt", b"caf\xe9"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr == ("error: the value of --prompt is not UTF-8 text (byte 0xe9 at character "
                                              "3); give UTF-8 text (or put the text in a UTF-8 file)\n")
