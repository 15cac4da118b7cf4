"""Timing campaigns (ByteCross App. A 'Timing', App. E): spec validation, the plan (every
cell in every block, alternating sweep direction, varied order), resume after an interrupt,
failed cells kept and retried, and the local executor end to end on a tiny model."""

from __future__ import annotations

import itertools
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import run_cli
from sparsedecode.cli import app
from sparsedecode.errors import InputError
from sparsedecode.records import write_record
from sparsedecode.timing import campaign
from sparsedecode.timing.campaign import (
    CANCEL_WAIT_S,
    load_spec,
    parse_spec,
    plan,
    record_path,
    run_campaign,
)

TINY = dict(model_type="llama", hidden_size=96, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, vocab_size=100, max_position_embeddings=512,
            rope_theta=10000.0, eos_token_id=None)
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "campaigns"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def toml(model: str, top: str = "", grids: str | None = None) -> str:
    """A tiny campaign: 2 contexts x 2 modes x 2 blocks; `top` lines ('key = value') override."""
    keys = {"name": '"tiny"', "model": f'"{model}"', "init": '"random"', "dtype": '"float32"',
            "device": '"cpu"', "blocks": "2", "repeats": "2", "steps": "3", "warmup": "2",
            "fill": '"prefill"', "obs": "16"}
    for line in top.splitlines():
        key, _, value = line.partition("=")
        keys[key.strip()] = value.strip()
    grids = grids if grids is not None else (
        '[[grid]]\ngroup = "sweep"\ncontexts = [64, 128]\nmodes = ["dense", "sel0.5"]\n')
    return "".join(f"{k} = {v}\n" for k, v in keys.items()) + "\n" + grids


def write_spec(folder: Path, text: str) -> Path:
    path = folder / "spec_in.toml"
    path.write_text(text)
    return path


# -- validation -------------------------------------------------------------------
GRID3 = ('[[grid]]\ngroup = "a"\ncontexts = ["128", 64, "96"]\nmodes = ["dense", "sel0.5", "window0.5"]\n'
         '[[grid]]\ngroup = "b"\ncontexts = [128, 256]\nmodes = ["both0.5/0.5", "dense"]\n'
         'attention = "sdpa_masked"\n')


@pytest.mark.parametrize("top,grids,match", [
    ("blokcs = 2", None, "unknown key.*'blokcs'"),
    ("", '[[grid]]\ngroup = "g"\ncontexts = [64]\nmodes = ["dense"]\nmode = "x"\n', "grid.*unknown key.*'mode'"),
    ("", '[[grid]]\ngroup = "g"\ncontexts = []\nmodes = ["dense"]\n', "'contexts' is empty"),
    ("", '[[grid]]\ngroup = "g"\ncontexts = [64]\nmodes = []\n', "'modes' is empty"),
    ("", '[[grid]]\ngroup = "g"\ncontexts = [64]\nmodes = ["dense", "sel2"]\n', "modes: mode 'sel2'"),
    ("", '[[grid]]\ngroup = "g"\ncontexts = [64]\nmodes = ["sel0.5"]\n', r"\[\[grid\]\] 1 \('g'\): modes lacks 'dense'"),
    ("", '[[grid]]\ngroup = "g"\ncontexts = [505]\nmodes = ["dense"]\n', "grid 'g' contexts.*use at most 504"),
    ("", '[[grid]]\ngroup = "g"\ncontexts = ["2x"]\nmodes = ["dense"]\n', "is not a token count"),
    ("", '[[grid]]\ngroup = "g"\ncontexts = [64, 64]\nmodes = ["dense"]\n', "context twice"),
    ("", '[[grid]]\ngroup = "g"\ncontexts = [64]\nmodes = ["dense", "sel0.5", "sel0.50"]\n', "same cell"),
    ("", '[[grid]]\ngroup = "g"\ncontexts = [64]\nmodes = ["dense"]\nattention = "flash"\n', "attention 'flash'"),
    ("", '[[grid]]\ngroup = "g"\ncontexts = [64]\nmodes = ["dense"]\n' * 2, "group 'g' is used twice"),
    ("", '[[grid]]\ngroup = "a/b"\ncontexts = [64]\nmodes = ["dense"]\n', "group 'a/b' may hold only"),
    ("", "", "missing key 'grid'"),
    ('blocks = "2"', None, "'blocks' must be an integer"),
    ("blocks = 0", None, "blocks must be >= 1"),
    ('device = "tpu"', None, "device 'tpu'"),
    ('fill = "zeros"', None, "fill 'zeros'"),
    ('dtype = "int8"', None, "dtype 'int8'"),
    ("", '[[grid]]\ngroup = "g"\ncontexts = [64]\nmodes = ["dense", "proj0.5"]\nmethod = "greedy"\n', "method 'greedy'"),
    ("", '[[grid]]\ngroup = "g"\ncontexts = [64]\nmodes = ["dense", "sel0.5"]\nmethod = "cats"\n', "mode dense has none"),
    ("", '[[grid]]\ngroup = "g"\ncontexts = [64]\nmodes = ["dense", "proj0.5"]\nmethod = "cats"\nbatch = 2\n',
     "give batch 1"),
])
def test_spec_errors_name_the_field(tiny, top, grids, match):
    with pytest.raises(InputError, match=match):
        parse_spec(toml(tiny, top, grids), where="t.toml")


def test_missing_model_and_bad_toml_are_clear(tiny):
    with pytest.raises(InputError, match="missing key 'model'"):
        parse_spec(toml(tiny).replace(f'model = "{tiny}"\n', ""))
    with pytest.raises(InputError, match="not valid TOML"):
        parse_spec("name = ")


def test_example_specs_validate():
    smoke, h200 = load_spec(EXAMPLES / "cpu_smoke.toml"), load_spec(EXAMPLES / "h200_sweep.toml")
    attn = load_spec(EXAMPLES / "h200_attention.toml")
    assert (smoke.model, smoke.device, smoke.blocks, len(plan(smoke))) == ("smollm2-135m", "cpu", 2, 12)
    assert [g.group for g in h200.grids] == ["sweep"]
    assert h200.grids[0].contexts == (2048, 8192, 32768, 65536, 130817)
    assert len(plan(h200)) == 2 * 5 * 4
    assert [g.group for g in attn.grids] == ["window_split_k", "window_sdpa_masked", "window_sdpa_fused"]
    assert len(plan(attn)) == 2 * 3 * 2 * 2
    campaign.check_cells(plan(smoke) + plan(h200) + plan(attn))  # every KV budget holds sinks + window


# -- the plan ------------------------------------------------------------------------
def test_plan_has_every_cell_of_every_grid_in_every_block(tiny):
    spec = parse_spec(toml(tiny, "blocks = 3", GRID3))
    cells = plan(spec)
    want = {(b, "a", n, m) for b in range(3) for n in (64, 96, 128) for m in ("dense", "sel0.5", "window0.5")}
    want |= {(b, "b", n, m) for b in range(3) for n in (128, 256) for m in ("both0.5/0.5", "dense")}
    got = [(c.block, c.group, c.context, c.mode) for c in cells]
    assert sorted(got) == sorted(want) and len(got) == len(want)
    assert [c.order for c in cells] == list(range(len(cells)))
    assert {c.attention for c in cells if c.group == "b"} == {"sdpa_masked"}
    assert all(c.campaign == "tiny" and c.repeats == 2 and c.obs == 16 for c in cells)
    assert record_path("D", cells[0]) == Path("D/cells") / cells[0].group / (
        f"{cells[0].cell}_{cells[0].context}_b0.json")


def test_a_grid_method_reaches_every_cell_and_its_command(tiny, tmp_path):
    """method = 'cats' calibrates the grid's proj<keep> cells on |SiLU(gate)| (SATS §3.1): every cell
    of that grid carries it, and the fresh process that runs one is told (`bench cell --method`)."""
    grids = ('[[grid]]\ngroup = "teal"\ncontexts = [64]\nmodes = ["dense", "proj0.5"]\n'
             '[[grid]]\ngroup = "cats"\ncontexts = [64]\nmodes = ["dense", "proj0.5"]\nmethod = "cats"\n')
    cells = plan(parse_spec(toml(tiny, "blocks = 1", grids)))
    assert {(c.group, c.mode, c.method) for c in cells} == {  # a dense cell calibrates nothing
        ("teal", "dense", "teal"), ("teal", "proj0.5", "teal"), ("cats", "dense", "teal"), ("cats", "proj0.5", "cats")}
    for c in cells:
        argv = campaign.cell_argv(c, tmp_path / "x.json")
        assert ("--method" in argv) == (c.method == "cats")
        if c.method == "cats":
            assert argv[argv.index("--method") + 1] == "cats"


def test_plan_alternates_sweep_direction_between_blocks(tiny):
    cells = plan(parse_spec(toml(tiny, "blocks = 4", GRID3)))
    for b in range(4):
        sweep = list(dict.fromkeys((c.group, c.context) for c in cells if c.block == b))
        forward = [("a", 64), ("a", 96), ("a", 128), ("b", 128), ("b", 256)]
        assert sweep == (forward if b % 2 == 0 else forward[::-1]), (b, sweep)
        blocks = [c.block for c in cells]
        assert blocks == sorted(blocks)  # a block runs whole before the next


def test_plan_is_deterministic_and_varies_the_mode_order(tiny):
    text = toml(tiny, "blocks = 5", GRID3)
    cells = plan(parse_spec(text))
    assert cells == plan(parse_spec(text))

    def orders(cs):
        out = {}
        for c in cs:
            out.setdefault((c.group, c.context, c.block), []).append(c.mode)
        return out

    o = orders(cells)
    for (g, n, b), modes in o.items():
        if b:
            assert modes != o[(g, n, b - 1)], f"{g} {n}: blocks {b - 1} and {b} run the same order"
    assert len({tuple(m) for (g, _, _), m in o.items() if g == "a"}) > 2  # shuffled, not only rotated
    other = orders(plan(parse_spec(toml(tiny, "blocks = 5\nseed = 1", GRID3))))
    assert other != o  # the order follows the seed


# -- the executor, with a stand-in for the cell process ----------------------------------
class FakeCells:
    """Stands in for `launch`: writes the record a cell process would, or fails, or stops."""

    def __init__(self, fail=(), crash=(), interrupt_at=None, interrupt_after=None):
        self.fail, self.crash, self.interrupt_at, self.calls = set(fail), set(crash), interrupt_at, []
        self.interrupt_after = interrupt_after  # this call writes its whole record, then the signal comes
        self.gpu = {}  # record name -> CUDA_VISIBLE_DEVICES it ran under

    def __call__(self, argv, log, env=None, running=None, nice=None):
        out = Path(argv[argv.index("--out") + 1])
        self.calls.append(out.name)
        self.gpu[out.name] = (env or {}).get("CUDA_VISIBLE_DEVICES")
        if argv[3:5] == ["bench", "ceiling"]:  # a CUDA campaign measures the ceiling first
            if "ceiling" in self.crash:
                return 1
            write_record(out, {"kind": "bandwidth_ceiling", "gpu": "NVIDIA H200", "gbps": 4000.0, "method": "fake"})
            return 0
        if self.interrupt_at == len(self.calls):
            raise KeyboardInterrupt
        if out.name in self.crash:
            return 3
        val = lambda k: argv[argv.index(k) + 1]  # noqa: E731
        rec = {"kind": "timing_cell", "group": val("--group"), "cell": val("--cell-id"),
               "block": int(val("--block")), "context": int(val("--context"))}
        if out.name in self.fail:
            write_record(out, {**rec, "status": "failed", "error": "InputError: boom"})
            return 2
        from sparsedecode.config import SparsityConfig

        mode = SparsityConfig.parse(val("--mode"))  # every field a finished record holds
        write_record(out, {**rec, "status": "ok", "mode": mode.kind, "mode_spec": val("--mode"),
                           "projection_keep": mode.proj_keep, "kv_keep": mode.kv_keep, "ms_per_token": 1.0,
                           "tokens_per_sec": 1e3, "tokens_per_sec_runs": [1e3, 1e3], "byte_bound": 1.0,
                           "model_name": Path(val("--model")).stem, "gpu": "CPU", "device": val("--device")})
        if self.interrupt_after == len(self.calls):
            raise KeyboardInterrupt
        return 0


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): (p.stat().st_mtime_ns, p.read_bytes())
            for p in (folder / "cells").rglob("*.json")}


def test_interrupted_campaign_resumes_without_redoing_finished_cells(tiny, tmp_path, monkeypatch):
    spec_path = write_spec(tmp_path, toml(tiny))
    out = tmp_path / "run"
    names = [record_path(out, c).name for c in plan(load_spec(spec_path))]
    fake = FakeCells(interrupt_at=3)
    monkeypatch.setattr(campaign, "launch", fake)
    s = run_campaign(spec_path, out, progress=False, echo=lambda line: None)
    assert s.interrupted and (s.ok, s.failed, s.pending) == (2, 0, 6)
    done = snapshot(out)
    assert sorted(Path(k).name for k in done) == sorted(names[:2])  # the interrupted cell left no record
    assert (out / "spec.toml").read_text() == spec_path.read_text()

    fake = FakeCells()
    monkeypatch.setattr(campaign, "launch", fake)
    s = run_campaign(spec_path, out, progress=False, echo=lambda line: None)
    assert (s.ok, s.failed, s.skipped, s.interrupted) == (6, 0, 2, False)
    assert fake.calls == names[2:]  # only the rest ran, in plan order
    after = snapshot(out)
    assert {k: after[k] for k in done} == done  # finished records untouched (mtime and bytes)
    assert len(after) == 8


def test_a_cell_that_finishes_as_the_signal_arrives_counts_as_done(tiny, tmp_path, monkeypatch):
    """The race a loaded host showed: the running cell wrote its whole record just before SIGTERM
    stopped it. The summary agrees with the records on disk (the resume skips that cell), instead
    of calling it pending."""
    spec_path = write_spec(tmp_path, toml(tiny))
    out = tmp_path / "run"
    said = []
    monkeypatch.setattr(campaign, "launch", FakeCells(interrupt_after=3))
    s = run_campaign(spec_path, out, progress=False, echo=said.append)
    assert s.interrupted and (s.ok, s.failed, s.pending) == (3, 0, 5)
    assert len(snapshot(out)) == 3 and any("finished as the campaign was stopped" in line for line in said)
    monkeypatch.setattr(campaign, "launch", FakeCells())
    s = run_campaign(spec_path, out, progress=False, echo=lambda line: None)
    assert (s.ok, s.skipped, s.interrupted) == (5, 3, False)


def _six_gpus(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 6)


def test_gpu_lanes_run_each_block_whole_on_one_gpu(tiny, tmp_path, monkeypatch):
    spec_path = write_spec(tmp_path, toml(tiny, 'device = "cuda"'))
    out = tmp_path / "run"
    fake = FakeCells()
    monkeypatch.setattr(campaign, "launch", fake)
    _six_gpus(monkeypatch)
    s = run_campaign(spec_path, out, progress=False, echo=lambda line: None, gpus=["3", "5"])
    assert (s.ok, s.failed, s.pending) == (8, 0, 0)
    cells = plan(load_spec(spec_path))
    for c in cells:  # block b on gpus[b % 2], so a block's dense and sparse cells share a device
        assert fake.gpu[record_path(out, c).name] == ["3", "5"][c.block % 2]
    assert fake.calls[0] == "ceiling.json"  # measured once, before the lanes start
    for b in (0, 1):  # each lane keeps its block's plan order
        lane = [n for n in fake.calls[1:] if fake.gpu[n] == ["3", "5"][b]]
        assert lane == [record_path(out, c).name for c in cells if c.block == b]


def test_a_cuda_campaign_measures_the_ceiling_once_before_its_cells(tiny, tmp_path, monkeypatch):
    spec_path = write_spec(tmp_path, toml(tiny, 'device = "cuda"'))
    out = tmp_path / "run"
    fake = FakeCells(interrupt_at=3)
    monkeypatch.setattr(campaign, "launch", fake)
    run_campaign(spec_path, out, progress=False, echo=lambda line: None)
    assert fake.calls[0] == "ceiling.json" and (out / "ceiling.json").is_file()
    fake = FakeCells()
    monkeypatch.setattr(campaign, "launch", fake)
    run_campaign(spec_path, out, progress=False, echo=lambda line: None)
    assert "ceiling.json" not in fake.calls and fake.calls  # kept on a resume

    said = []
    fake = FakeCells(crash={"ceiling"})
    monkeypatch.setattr(campaign, "launch", fake)
    s = run_campaign(spec_path, tmp_path / "other", progress=False, echo=said.append)
    assert s.ok == 8 and any("ceiling was not measured" in line for line in said), said
    fake = FakeCells()
    monkeypatch.setattr(campaign, "launch", fake)
    (tmp_path / "cpu").mkdir()
    run_campaign(write_spec(tmp_path / "cpu", toml(tiny)), tmp_path / "cpu_run", progress=False, echo=lambda line: None)
    assert "ceiling.json" not in fake.calls  # a CPU campaign has no GPU ceiling to measure


@pytest.mark.parametrize("gpus", [[], ["0", "0"], ["a"], ["7"]])
def test_bad_gpu_lists_are_refused(tiny, tmp_path, gpus, monkeypatch):
    _six_gpus(monkeypatch)
    with pytest.raises(InputError, match="gpus="):
        run_campaign(write_spec(tmp_path, toml(tiny, 'device = "cuda"')), tmp_path / "run", progress=False,
                     gpus=gpus)


def test_gpu_lanes_never_share_a_cpu_or_run_without_cuda(tiny, tmp_path, monkeypatch):
    """Two CPU cells at once would share the cores of one timing run: refused, not run."""
    fake = FakeCells()
    monkeypatch.setattr(campaign, "launch", fake)
    with pytest.raises(InputError, match="share its cores"):
        run_campaign(write_spec(tmp_path, toml(tiny)), tmp_path / "run", progress=False, gpus=["0", "1"])
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(InputError, match="has none"):
        run_campaign(write_spec(tmp_path, toml(tiny, 'device = "cuda"')), tmp_path / "run", progress=False,
                     gpus=["0"])
    assert fake.calls == []


def test_stop_after_leaves_the_rest_pending_for_a_resume(tiny, tmp_path, monkeypatch):
    spec_path = write_spec(tmp_path, toml(tiny))
    out = tmp_path / "run"
    fake = FakeCells()
    monkeypatch.setattr(campaign, "launch", fake)
    s = run_campaign(spec_path, out, progress=False, echo=lambda line: None, stop_after=1e-9)
    assert (s.ok, s.pending, fake.calls) == (0, 8, [])
    s = run_campaign(spec_path, out, progress=False, echo=lambda line: None)
    assert (s.ok, s.skipped, s.pending) == (8, 0, 0)


class Shared(FakeCells):
    """A cell that refuses its GPU (timing.neighbors.SharedGpu), as `bench cell` records it."""

    def __init__(self, name, **kw):
        super().__init__(**kw)
        self.shared = name

    def __call__(self, argv, log, env=None, running=None, nice=None):
        path = Path(argv[argv.index("--out") + 1])
        if path.name != self.shared:
            return super().__call__(argv, log, env, running)
        from sparsedecode.timing.cell import failed_record
        from sparsedecode.timing.neighbors import SharedGpu, check_alone

        self.calls.append(path.name)
        try:
            check_alone([{"pid": 77, "name": "python3", "used_mib": 900.0}], "refuse")
        except SharedGpu as e:
            write_record(path, failed_record({"group": "sweep"}, e))
        return 2


def test_a_failure_that_only_mentions_a_shared_gpu_is_not_a_refusal(tiny, tmp_path, monkeypatch):
    """The lane stops on the record's 'refused' field, never on words in an error message."""
    from sparsedecode.timing.neighbors import REFUSED

    spec_path = write_spec(tmp_path, toml(tiny))
    out = tmp_path / "run"
    names = [record_path(out, c).name for c in plan(load_spec(spec_path))]

    class Mentions(FakeCells):
        def __call__(self, argv, log, env=None, running=None, nice=None):
            path = Path(argv[argv.index("--out") + 1])
            if path.name == names[1]:
                self.calls.append(path.name)
                write_record(path, {"kind": "timing_cell", "status": "failed", "error": f"RuntimeError: {REFUSED} x"})
                return 1
            return super().__call__(argv, log, env, running)

    monkeypatch.setattr(campaign, "launch", Mentions())
    s = run_campaign(spec_path, out, progress=False, echo=lambda line: None)
    assert (s.ok, s.failed, s.pending) == (len(names) - 1, 1, 0)


def test_a_cell_refused_on_a_shared_gpu_stops_its_lane_and_the_rest_stay_pending(tiny, tmp_path, monkeypatch):
    """Every later cell would be refused too: the lane stops rather than failing them one by one."""
    spec_path = write_spec(tmp_path, toml(tiny))
    out = tmp_path / "run"
    names = [record_path(out, c).name for c in plan(load_spec(spec_path))]
    fake = Shared(names[2])
    monkeypatch.setattr(campaign, "launch", fake)
    lines = []
    s = run_campaign(spec_path, out, progress=False, echo=lines.append)
    assert fake.calls == names[:3] and (s.ok, s.failed, s.pending) == (2, 1, len(names) - 3)
    assert "this lane stops" in lines[-1]
    monkeypatch.setattr(campaign, "launch", FakeCells())
    s = run_campaign(spec_path, out, progress=False, echo=lambda line: None)  # the GPU is free again
    assert (s.ok, s.skipped, s.retried, s.pending) == (len(names) - 2, 2, 1, 0)


def test_failed_cells_are_recorded_the_campaign_goes_on_and_they_are_retried(tiny, tmp_path, monkeypatch):
    spec_path = write_spec(tmp_path, toml(tiny))
    out = tmp_path / "run"
    names = [record_path(out, c).name for c in plan(load_spec(spec_path))]
    fake = FakeCells(fail={names[1]}, crash={names[4]})
    monkeypatch.setattr(campaign, "launch", fake)
    lines = []
    s = run_campaign(spec_path, out, progress=False, echo=lines.append)
    assert (s.ok, s.failed, s.skipped) == (6, 2, 0) and fake.calls == names  # went on after both
    assert sum("FAILED" in line for line in lines) == 2 and len(lines) == 8
    crashed = json.loads(next((out / "cells").rglob(names[4])).read_text())
    assert crashed["status"] == "failed" and "exited with code 3" in crashed["error"]
    st = campaign.status(out)
    assert st["groups"]["sweep"] == {"done": 6, "failed": 2, "pending": 0}

    fake = FakeCells()
    monkeypatch.setattr(campaign, "launch", fake)
    s = run_campaign(spec_path, out, progress=False, echo=lambda line: None)
    assert (s.ok, s.failed, s.skipped, s.retried) == (2, 0, 6, 2)
    assert sorted(fake.calls) == sorted([names[1], names[4]])
    kept = sorted(p.name for p in (out / "failed").rglob("*.json"))
    assert kept == sorted([f"{Path(names[1]).stem}.1.json", f"{Path(names[4]).stem}.1.json"])
    assert all(json.loads(p.read_text())["status"] == "failed" for p in (out / "failed").rglob("*.json"))
    assert campaign.status(out)["groups"]["sweep"] == {"done": 8, "failed": 0, "pending": 0}


def test_a_different_spec_is_refused_in_an_existing_folder(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(campaign, "launch", FakeCells())
    out = tmp_path / "run"
    run_campaign(write_spec(tmp_path, toml(tiny)), out, progress=False, max_cells=1, echo=lambda line: None)
    other = tmp_path / "other.toml"
    other.write_text(toml(tiny, "blocks = 3"))
    with pytest.raises(InputError, match="holds another campaign.*differs in blocks"):
        run_campaign(other, out, progress=False)
    same = tmp_path / "same.toml"  # the same campaign, reformatted: accepted
    same.write_text("# a comment\n" + toml(tiny))
    s = run_campaign(same, out, progress=False, max_cells=0, echo=lambda line: None)
    assert (s.skipped, s.pending) == (1, 7)
    with pytest.raises(InputError, match="executor 'slurm'"):
        run_campaign(same, out, executor="slurm")


def test_a_spec_failing_the_cell_checks_does_not_bind_the_folder(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(campaign, "launch", FakeCells())
    out = tmp_path / "run"
    bad = write_spec(tmp_path, toml(tiny, grids='[[grid]]\ngroup = "sweep"\ncontexts = [64]\n'
                                             'modes = ["dense", "sel0.3"]\n'))
    with pytest.raises(InputError, match="grid 'sweep', context 64, mode sel0.3: snapkv budget"):
        run_campaign(bad, out, progress=False)
    assert not (out / "spec.toml").exists()
    s = run_campaign(write_spec(tmp_path, toml(tiny)), out, progress=False, echo=lambda line: None)
    assert s.ok == 8


def test_a_run_may_allow_a_shared_gpu_the_spec_refuses(tiny, tmp_path, monkeypatch, capsys):
    """--shared-gpu is this run's policy: its cells get it, the folder's spec.toml stays the spec,
    and a resume under the spec's own policy is the same campaign."""
    spec_path = write_spec(tmp_path, toml(tiny))
    out = tmp_path / "run"
    fake = FakeCells()
    argvs = []
    monkeypatch.setattr(campaign, "launch", lambda argv, *a, **k: (argvs.append(argv), fake(argv, *a, **k))[1])
    res = CliRunner().invoke(app, ["campaign", "run", str(spec_path), "--out", str(out), "--max-cells", "2",
                                   "--shared-gpu", "allow", "--json"])
    assert res.exit_code == 0, res.output
    assert [a[a.index("--shared-gpu") + 1] for a in argvs] == ["allow", "allow"]
    assert "shared_gpu" not in (out / "spec.toml").read_text()
    s = run_campaign(spec_path, out, progress=False, echo=lambda line: None)
    assert (s.skipped, s.ok) == (2, 6) and all("--shared-gpu" not in a for a in argvs[2:])
    bad = run_cli(capsys, "campaign", "run", str(spec_path), "--out", str(out), "--shared-gpu", "sometimes")
    assert bad.returncode == 2 and "shared_gpu 'sometimes' is not one of refuse, allow" in bad.stderr


def test_campaign_cli_exit_codes_and_status(tiny, tmp_path, monkeypatch):
    spec_path = write_spec(tmp_path, toml(tiny))
    out = tmp_path / "run"
    names = [record_path(out, c).name for c in plan(load_spec(spec_path))]
    monkeypatch.setattr(campaign, "launch", FakeCells(fail={names[0]}))
    res = CliRunner().invoke(app, ["campaign", "run", str(spec_path), "--out", str(out), "--max-cells", "3", "--json"])
    assert res.exit_code == 1, res.output  # a failed cell makes the run fail
    assert json.loads(res.stdout)["failed"] == 1
    res = CliRunner().invoke(app, ["campaign", "status", str(out), "--json"])
    assert res.exit_code == 0
    st = json.loads(res.stdout)
    assert st["groups"]["sweep"] == {"done": 2, "failed": 1, "pending": 5}
    assert [Path(p["path"]).name for p in st["pending"]] == names[3:]
    assert st["estimate"] is None  # these records carry no timestamps
    res = CliRunner().invoke(app, ["campaign", "status", str(out)])
    assert "sweep" in res.stdout and "pending:" in res.stdout and res.exit_code == 0
    assert "no time estimate yet" in res.stdout
    for name, stamp in zip(names[1:3], ("2026-12-04T17:00:00+00:00", "2026-12-04T17:00:40+00:00"), strict=True):
        rec = record_path(out, plan(load_spec(spec_path))[names.index(name)])
        rec.write_text(json.dumps({**json.loads(rec.read_text()), "timestamp": stamp}))
    res = CliRunner().invoke(app, ["campaign", "status", str(out)])
    assert "about 3 min for the 5 pending cells (40 s a cell: the median of 1 gaps" in res.stdout, res.stdout
    res = CliRunner().invoke(app, ["campaign", "status", str(tmp_path)])
    assert res.exit_code != 0 and "not a campaign folder" in str(res.exception)


def test_ray_executor_without_ray_says_how_to_get_it(tiny, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(InputError, match="needs Ray"):
        run_campaign(write_spec(tmp_path, toml(tiny)), tmp_path / "run", executor="ray", progress=False)


class StandInRay:
    """Just what the Ray executor calls, run in this process: a task 'runs' when `wait` takes
    it, oldest first; `in_flight` is the most tasks submitted and not yet taken at once."""

    def __init__(self, gpus: int):
        self.gpus, self.refs, self.in_flight, self.ran = gpus, [], 0, []

    def cluster_resources(self):
        return {"CPU": 8.0, "GPU": float(self.gpus)}

    def nodes(self):
        return [{"Alive": True, "Resources": self.cluster_resources()}]

    def is_initialized(self):
        return True

    def remote(self, **_):
        ray = self

        class Task:
            def __init__(self, fn):
                self.fn = fn

            def remote(self, *args):
                fn = self.fn
                ref = (len(ray.ran) + len(ray.refs), lambda: fn(*args))
                ray.refs.append(ref)
                ray.in_flight = max(ray.in_flight, len(ray.refs))
                return ref

        return Task

    def wait(self, refs, num_returns=1, timeout=None):
        ref = self.refs.pop(0)
        self.ran.append(ref[1]())
        return [ref], []

    def get(self, ref):
        return self.ran[ref[0]]

    def cancel(self, ref):
        raise AssertionError("nothing is cancelled unless interrupted")


def test_ray_gets_a_cell_per_gpu_at_a_time_and_starts_none_after_a_refusal(tiny, tmp_path, monkeypatch):
    """Two GPUs: two cells in flight; the third refuses its GPU, so the fourth (already
    running) finishes and the other four stay pending; a resume, the GPU free, runs them."""
    spec_path = write_spec(tmp_path, toml(tiny, 'device = "auto"'))
    out = tmp_path / "run"
    names = [record_path(out, c).name for c in plan(load_spec(spec_path))]
    fake, ray, lines = Shared(names[2]), StandInRay(gpus=2), []
    monkeypatch.setattr(campaign, "launch", fake)
    monkeypatch.setitem(sys.modules, "ray", ray)
    s = run_campaign(spec_path, out, executor="ray", progress=False, echo=lines.append)
    assert ray.in_flight == 2 and fake.calls == names[:4]
    assert (s.ok, s.failed, s.pending) == (3, 1, 4) and "no further cell starts" in lines[-2]
    monkeypatch.setattr(campaign, "launch", FakeCells())
    monkeypatch.setitem(sys.modules, "ray", StandInRay(gpus=2))
    s = run_campaign(spec_path, out, executor="ray", progress=False, echo=lines.append)
    assert (s.ok, s.skipped, s.retried, s.pending) == (5, 3, 1, 0)


# -- end to end: real cell processes ------------------------------------------------------
@pytest.fixture(scope="module")
def e2e(tiny, tmp_path_factory):
    """The tiny campaign through the local executor in three runs: stopped after 3 cells;
    then with one cell crashing (no record) and one failing inside `bench cell`; then again."""
    tmp = tmp_path_factory.mktemp("e2e")
    spec_path = write_spec(tmp, toml(tiny))
    out = tmp / "run"
    cells = plan(load_spec(spec_path))
    quiet = dict(progress=False, echo=lambda line: None)
    runs = {"first": run_campaign(spec_path, out, max_cells=3, **quiet)}
    snaps = {"first": snapshot(out)}
    crash, broken = record_path(out, cells[3]).name, record_path(out, cells[5]).name
    wrapper = tmp / "python"
    wrapper.write_text(f'#!/bin/sh\ncase "$*" in\n  *{crash}*) echo "simulated crash" >&2; exit 3 ;;\n'
                       f'  *{broken}*) exec "{sys.executable}" "$@" --steps 0 ;;\nesac\n'
                       f'exec "{sys.executable}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    runs["second"] = run_campaign(spec_path, out, python=str(wrapper), **quiet)
    snaps["second"] = snapshot(out)
    runs["third"] = run_campaign(spec_path, out, **quiet)
    snaps["third"] = snapshot(out)
    return dict(out=out, cells=cells, runs=runs, snaps=snaps, crash=crash, broken=broken)


def test_e2e_every_cell_ends_with_an_ok_record_paired_with_dense(e2e):
    out, cells = e2e["out"], e2e["cells"]
    assert len(e2e["snaps"]["third"]) == len(cells) == 8
    for c in cells:
        rec = json.loads(record_path(out, c).read_text())
        assert rec["status"] == "ok", rec.get("error")
        assert (rec["group"], rec["cell"], rec["block"], rec["context"], rec["order"], rec["campaign"]) == (
            c.group, c.cell, c.block, c.context, c.order, "tiny")
        assert rec["ms_per_token"] > 0 and rec["byte_bound"] >= 1.0 and rec["generated"] == 8
    for b, n in itertools.product(range(2), (64, 128)):  # each sparse cell has its dense partner
        assert record_path(out, next(c for c in cells if (c.block, c.context, c.mode) == (b, n, "dense"))).exists()
    assert (out / "logs" / "sweep").is_dir()


def test_e2e_resume_leaves_finished_records_untouched(e2e):
    first, second, third = (e2e["snaps"][k] for k in ("first", "second", "third"))
    assert len(first) == 3 and e2e["runs"]["first"].pending == 5
    assert {k: second[k] for k in first} == first
    ok2 = {k: v for k, v in second.items() if json.loads(v[1])["status"] == "ok"}
    assert len(ok2) == 6 and {k: third[k] for k in ok2} == ok2
    r2, r3 = e2e["runs"]["second"], e2e["runs"]["third"]
    assert (r2.ok, r2.failed, r2.skipped) == (3, 2, 3)  # the campaign went on past both failures
    assert (r3.ok, r3.failed, r3.skipped, r3.retried) == (2, 0, 6, 2)


def test_several_specs_run_as_one_chain_into_out_root(tiny, tmp_path):
    """`campaign run A B --out-root DIR`: each spec into DIR/NAME, one after another, with
    --max-cells counted over the chain (a spec the budget does not reach is 'not started'),
    and a rerun of the chain resumes both folders."""
    one = '[[grid]]\ngroup = "g"\ncontexts = [64]\nmodes = ["dense", "sel0.5"]\n'
    a = tmp_path / "a.toml"
    b = tmp_path / "b.toml"
    a.write_text(toml(tiny, 'name = "chain_a"\nblocks = 1', one))
    b.write_text(toml(tiny, 'name = "chain_b"\nblocks = 1', one))
    root = tmp_path / "runs"
    cmd = ["campaign", "run", str(a), str(b), "--out-root", str(root), "--json"]
    first = CliRunner().invoke(app, [*cmd, "--max-cells", "1"])
    assert first.exit_code == 0, first.output
    rows = json.loads(first.stdout)["campaigns"]
    assert [(r["folder"], r["started"]) for r in rows] == [(str(root / "chain_a"), True), (str(root / "chain_b"), False)]
    assert (rows[0]["ok"], rows[0]["pending"]) == (1, 1)
    second = CliRunner().invoke(app, cmd)
    assert second.exit_code == 0, second.output
    rows = json.loads(second.stdout)["campaigns"]
    assert [(r["ok"], r["skipped"], r["failed"]) for r in rows] == [(1, 1, 0), (2, 0, 0)]
    for name in ("chain_a", "chain_b"):
        assert sorted(p.name for p in (root / name / "cells" / "g").glob("*.json")) == ["dense_64_b0.json",
                                                                                    "sel50_64_b0.json"]


def test_e2e_failures_are_recorded_then_kept_in_failed(e2e):
    out = e2e["out"]
    kept = {p.name.split(".")[0]: json.loads(p.read_text()) for p in (out / "failed").rglob("*.json")}
    crash, broken = Path(e2e["crash"]).stem, Path(e2e["broken"]).stem
    assert set(kept) == {crash, broken}
    assert "exited with code 3" in kept[crash]["error"] and "simulated crash" in kept[crash]["traceback"]
    assert "steps must be" in kept[broken]["error"]  # written by `bench cell` itself
    c = e2e["cells"][5]
    assert (kept[broken]["cell"], kept[broken]["block"], kept[broken]["context"]) == (c.cell, c.block, c.context)
    assert "Traceback" in kept[broken]["traceback"]


def _cell_pids(out: Path, root: int) -> list[int]:
    """Live `bench cell` processes under `root` (the campaign's pid) writing into `out` whose record
    is not written yet (Linux /proc). Command lines stay bytes: a neighbour's need not be UTF-8."""
    pids, mine = [], os.fsencode(str(out))
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"cell" in argv and b"--out" in argv[:-1] and mine in argv[argv.index(b"--out") + 1]:
            record = Path(os.fsdecode(argv[argv.index(b"--out") + 1]))
            pid = int(cmdline.parent.name)
            if not record.exists() and _descends(pid, root):
                pids.append(pid)
    return pids


def _descends(pid: int, root: int) -> bool:
    """`pid` is `root` or one of its descendants (parents read from /proc/PID/stat)."""
    while pid > 1:
        if pid == root:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
    return False


def _alive(pid: int) -> bool:
    try:
        stat_ = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat_.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads processes from /proc")
@pytest.mark.parametrize("executor", ["local", "ray"])
def test_sigterm_stops_a_background_campaign_and_its_cell(tmp_path, executor):
    """A campaign started as a background job (SIGINT ignored, as `cmd &` in a script leaves it)
    and ended by SIGTERM (a lease or a scheduler's end): it stops its running cell, which leaves
    no record and no process, says it was interrupted (exit 130), and a resume finishes the rest.
    On Ray too, whose own SIGTERM handler would exit and leave the cell running."""
    if executor == "ray":
        pytest.importorskip("ray")
    # a cell process lives seconds (Python and torch start, the model builds, 2 x (40 + 2) steps): long enough to be
    # caught running at a 50 ms poll, short enough that the resume's cells cost little (a 32-layer, 302-step
    # cell made this test 8 of CI's minutes)
    slow = tmp_path / "slow" / "config.json"
    slow.parent.mkdir()
    slow.write_text(json.dumps({**TINY, "num_hidden_layers": 4, "max_position_embeddings": 2048}))
    spec = write_spec(tmp_path, toml(str(slow), "steps = 40\nblocks = 1",
                                     '[[grid]]\ngroup = "sweep"\ncontexts = [704, 768]\nmodes = ["dense", "sel0.5"]\n'))
    out = tmp_path / "run"

    def as_background_job():
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    proc = subprocess.Popen([sys.executable, "-m", "sparsedecode", "campaign", "run", str(spec), "--out", str(out),
                             "--executor", executor, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=as_background_job,
                            env={**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"})
    running, deadline = [], time.monotonic() + 420  # generous: Ray starts slowly on a loaded machine
    while time.monotonic() < deadline and proc.poll() is None:
        done = list((out / "cells").rglob("*.json")) if (out / "cells").exists() else []
        running = _cell_pids(out, proc.pid)
        if done and running:
            break
        time.sleep(0.05)
    if not (done and running):
        proc.kill()  # not left running (with its local Ray) after the test
        proc.communicate(timeout=60)
    assert done and running, f"no cell was running after the first record ({len(done)} records, exit {proc.poll()})"
    assert all(os.getpriority(os.PRIO_PROCESS, p) == os.getpriority(os.PRIO_PROCESS, 0) for p in running), \
        "a cell runs at another niceness than its campaign (Ray's workers run niced)"
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=CANCEL_WAIT_S + 60)  # Ray waits that long for its cells
    assert proc.returncode == 130, stderr
    summary = json.loads(stdout)
    assert summary["interrupted"] and summary["ok"] >= 1 and summary["pending"] >= 1 and summary["failed"] == 0
    deadline = time.monotonic() + 60  # a stopped cell's last moments (and its reaping) on a loaded host
    while [p for p in running if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in running if _alive(p)], "a cell process outlived its campaign"
    assert len(list((out / "cells").rglob("*.json"))) == summary["ok"]  # the stopped cell left no record
    again = run_campaign(spec, out, progress=False, echo=lambda line: None)
    assert (again.skipped, again.ok + again.skipped, again.failed, again.interrupted) == (summary["ok"], 4, 0, False)


# -- the Ray executor on a local Ray --------------------------------------------------------
RAY_SAME = ("group", "cell", "mode", "context", "block", "order", "campaign", "status", "label", "generated")


def test_ray_executor_resumes_and_matches_the_local_cells(e2e, tiny, tmp_path):
    """`--executor ray` on a local Ray: the tiny campaign interrupted after 3 cells and resumed
    ends with the local executor's cells (the e2e run), one for one, and the resume leaves the
    finished records alone."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        spec = write_spec(tmp_path, toml(tiny))
        out = tmp_path / "ray"
        quiet = dict(progress=False, echo=lambda line: None)
        first = run_campaign(spec, out, executor="ray", max_cells=3, **quiet)
        assert (first.ok, first.failed, first.pending) == (3, 0, 5)
        done = snapshot(out)
        second = run_campaign(spec, out, executor="ray", **quiet)
        assert (second.ok, second.failed, second.pending, second.skipped) == (5, 0, 0, 3)
    finally:
        ray.shutdown()
    after = snapshot(out)
    assert {k: after[k] for k in done} == done
    assert sorted(after) == sorted(snapshot(e2e["out"]))
    for c in e2e["cells"]:
        a = json.loads(record_path(out, c).read_text())
        b = json.loads(record_path(e2e["out"], c).read_text())
        assert {k: a.get(k) for k in RAY_SAME} == {k: b.get(k) for k in RAY_SAME}, c.cell
        assert a["status"] == "ok" and a["ms_per_token"] > 0


def test_status_estimates_the_time_left_from_the_gaps_between_records():
    """A cell's whole cost (fresh process, load, compile, timed steps) is the gap between its
    record and the one before; a break between runs is not a cell."""
    from sparsedecode.timing.campaign import cell_seconds

    stamps = ["2026-12-04T17:00:00+00:00", "2026-12-04T17:00:30+00:00", "2026-12-04T17:01:10+00:00",
              "2026-12-04T18:30:00+00:00", None, "not a time"]
    assert cell_seconds(stamps) == (35.0, 2)
    assert cell_seconds(stamps[:1]) == (None, 0)
    assert cell_seconds(["2026-12-04T17:00:00+00:00", "2026-12-04T17:20:00+00:00"]) == (None, 0)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_a_cell_starts_stops_that_cell(tmp_path, monkeypatch, sig):
    """The race a loaded host showed (a cell that ran on and wrote its record after its campaign
    stopped): the campaign's signal arrives while `launch` is starting the cell, before it holds
    the process. The interrupt is held until the cell can be stopped, then raised: the cell is
    stopped with it, never left running."""
    from sparsedecode.timing import processes
    from sparsedecode.timing.processes import TermAsInterrupt, launch

    started = []
    real = subprocess.Popen

    def popen_then_signal(*a, **k):  # the child exists; the signal comes before Popen returns
        started.append(real(*a, **k))
        os.kill(os.getpid(), sig)
        time.sleep(0.2)  # the handler runs here, inside the start
        return started[-1]

    monkeypatch.setattr(processes.subprocess, "Popen", popen_then_signal)
    running = set()
    # Ctrl-C's Python handler, as in a terminal (a pytest-xdist worker ignores SIGINT, and
    # TermAsInterrupt leaves an ignored SIGINT ignored)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with TermAsInterrupt(), pytest.raises(KeyboardInterrupt):
            launch([sys.executable, "-c", "import time; time.sleep(120)"], tmp_path / "cell.log", running=running)
    finally:
        signal.signal(signal.SIGINT, before)
    child = started[0]
    assert child.poll() is not None, "the cell started as the signal arrived was left running"
    assert not running
    assert signal.getsignal(signal.SIGTERM) is not TermAsInterrupt._raise  # the handlers are put back
