"""A timing cell looks for other processes on its GPU: it refuses a shared GPU by default,
records who was there under 'allow', and the report lists the cells that saw anyone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from test_report import _write

from sparsedecode.errors import InputError
from sparsedecode.timing.neighbors import check_alone, neighbors, parse_smi, watched

UUID = "GPU-1234"
SMI = ("GPU-1234, 4242, 2048\n"
       "GPU-9999, 5151, 1024\n"  # another GPU of the host: not this cell's neighbor
       "GPU-1234, 6363, [N/A]\n")


def test_parse_smi_keeps_the_cells_gpu_and_reads_unknown_memory_as_zero():
    assert parse_smi(SMI, UUID) == [(4242, 2048.0), (6363, 0.0)]
    assert parse_smi("", UUID) == []


def test_nvidia_smi_cannot_tell_for_a_mig_slice():
    from sparsedecode.timing.neighbors import _smi

    assert _smi("MIG-1234") is None  # its rows name the parent GPU; never a false 'alone'


def test_nvidia_smi_answers_only_for_a_gpu_it_names():
    from sparsedecode.timing.neighbors import _smi

    def query(*args):
        return "GPU-1234\nGPU-9999\n" if args == ("--query-gpu=uuid",) else SMI

    assert _smi(UUID, query) == [(4242, 2048.0), (6363, 0.0)]
    assert _smi("GPU-5678", query) is None  # a UUID spelled otherwise than nvidia-smi spells it
    assert _smi(UUID, lambda *args: None) is None  # nvidia-smi failed


def test_neighbors_leave_out_this_process_and_its_ancestors():
    me = os.getpid()
    found = neighbors(UUID, probes=[lambda u: [(me, 500.0), (os.getppid(), 10.0), (4242, 2048.0)]])
    assert [p["pid"] for p in found] == [4242]
    assert found[0]["used_mib"] == 2048.0 and isinstance(found[0]["name"], str)


def test_in_another_pid_namespace_one_listed_process_is_this_one():
    """A container: the driver lists host pids, so this process is not found under its own."""
    me = 10**7 + 1  # no such pid here
    assert neighbors(UUID, probes=[lambda u: [(4242, 300.0)]], me=me) == []
    found = neighbors(UUID, probes=[lambda u: [(4242, 300.0), (5151, 2048.0)]], me=me)
    assert [(p["pid"], p["name"]) for p in found] == [(4242, "another PID namespace"), (5151, "another PID namespace")]
    with pytest.raises(InputError, match="shared with pid 4242"):
        check_alone(found, "refuse")


def test_neighbors_take_the_first_probe_that_answers_and_none_when_none_can():
    calls = []

    def silent(u):
        calls.append("nvml")
        return None

    assert neighbors(UUID, probes=[silent, lambda u: []]) == []
    assert calls == ["nvml"]
    assert neighbors(UUID, probes=[silent, silent]) is None  # unknown, never 'alone'
    assert neighbors(None, probes=[lambda u: []]) is None


def test_a_shared_gpu_is_refused_unless_allowed():
    seen = [{"pid": 4242, "name": "python3", "used_mib": 2048.0}]
    with pytest.raises(InputError, match=r"shared with pid 4242 \(python3, 2048 MiB\).*shared_gpu = \"allow\""):
        check_alone(seen, "refuse")
    check_alone(seen, "allow")
    check_alone([], "refuse")
    check_alone(None, "refuse")  # no probe: the record says unknown
    with pytest.raises(InputError, match="shared_gpu 'sometimes'"):
        check_alone([], "sometimes")


def test_watched_off_cuda_runs_the_steps_and_sees_no_one():
    import torch

    assert watched(torch.device("cpu"), "refuse", lambda: [1.0]) == ([1.0], {"before": [], "after": []})
    with pytest.raises(InputError, match="shared_gpu 'nope'"):
        watched(torch.device("cpu"), "nope", lambda: pytest.fail("ran under a bad policy"))


def test_the_policy_travels_from_the_spec_to_the_cell_command(tmp_path):
    from sparsedecode.timing.campaign import cell_argv, plan
    from sparsedecode.timing.cell import CellSpec
    from sparsedecode.timing.spec import parse_spec

    body = ('name = "t"\nmodel = "smollm2-135m"\ninit = "random"\ndevice = "cpu"\nblocks = 1\n{extra}'
            '[[grid]]\ngroup = "g"\ncontexts = [64]\nmodes = ["dense"]\n')
    spec = parse_spec(body.format(extra='shared_gpu = "allow"\n'))
    cell = plan(spec)[0]
    assert cell.shared_gpu == "allow"
    argv = cell_argv(cell, tmp_path / "c.json")
    assert argv[argv.index("--shared-gpu") + 1] == "allow"
    default = plan(parse_spec(body.format(extra="")))[0]
    assert default.shared_gpu == "refuse" and "--shared-gpu" not in cell_argv(default, tmp_path / "c.json")
    with pytest.raises(InputError, match="shared_gpu 'maybe' is not one of refuse, allow"):
        parse_spec(body.format(extra='shared_gpu = "maybe"\n'))
    with pytest.raises(InputError, match="shared_gpu"):
        CellSpec(model="smollm2-135m", context=64, shared_gpu="maybe")


def test_the_report_lists_cells_that_saw_another_process(tmp_path):
    from sparsedecode.report.timing_markdown import render_markdown
    from sparsedecode.timing.analysis import build_report
    from sparsedecode.timing.cells import load_cells

    root = tmp_path / "c"
    other = {"before": [], "after": [{"pid": 77, "name": "python3", "used_mib": 900.0}]}
    for b in range(2):
        _write(root, "sweep", "dense", 2048, b, 10.0, gpu_neighbors={"before": [], "after": []})
        _write(root, "sweep", "proj50", 2048, b, 8.0, gpu_neighbors=other if b == 1 else {"before": None, "after": None})
    _write(root, "sweep", "dense", 4096, 0, 10.0)  # timed before cells looked
    rep = build_report(load_cells(root))
    nb = rep["gpu_neighbors"]
    assert (nb["probed"], nb["no_probe"], nb["unknown"]) == (4, 1, 1)
    assert [(s["cell"], s["block"], s["processes"]) for s in nb["shared"]] == [("proj50", 1, ["77 python3"])]
    md = render_markdown(rep)
    assert "## Other processes on the GPU" in md and "| 77 python3 |" in md
    assert "1 probed cell(s) could not tell" in md and "1 cell(s) carry no probe" in md
    (root / "cells/sweep/dense_4096_b0.json").unlink()
    for f in root.rglob("*.json"):  # records from before the probe: no section at all
        rec = json.loads(f.read_text())
        del rec["gpu_neighbors"]
        f.write_text(json.dumps(rec))
    rep = build_report(load_cells(root))
    assert rep["gpu_neighbors"] is None and "Other processes" not in render_markdown(rep)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_a_second_cuda_process_is_seen_and_refused():
    """On the GPU: a child that holds CUDA memory is this cell's neighbor, and gone once it exits."""
    import torch

    from sparsedecode.timing.neighbors import device_uuid

    dev = torch.device("cuda", torch.cuda.current_device())
    torch.empty(1, device=dev)
    hold = (f"import torch, time; x = torch.empty(2**28, device='cuda:{dev.index}'); "
            "print('ready', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        found = neighbors(device_uuid(dev))
        assert found is not None and child.pid in [p["pid"] for p in found]
        with pytest.raises(InputError, match=f"pid {child.pid}"):
            watched(dev, "refuse", lambda: pytest.fail("timed on a shared GPU"))
        out, seen = watched(dev, "allow", lambda: "timed")
        assert out == "timed" and child.pid in [p["pid"] for p in seen["before"]]
        from sparsedecode.timing.ceiling import measure_ceiling

        with pytest.raises(InputError, match=f"pid {child.pid}"):
            measure_ceiling(device=f"cuda:{dev.index}", dtype="bfloat16", gib=0.25, replays=2)
    finally:
        child.kill()
        child.wait()
    time.sleep(1.0)
    assert child.pid not in [p["pid"] for p in (neighbors(device_uuid(dev)) or [])]


def test_a_resume_may_change_the_shared_gpu_policy(tmp_path):
    """A policy of the run, not part of what is measured: the folder's campaign is the same."""
    from sparsedecode.timing.campaign import prepare

    body = ('name = "t"\nmodel = "smollm2-135m"\ninit = "random"\ndevice = "cpu"\nblocks = 1\n{extra}'
            '[[grid]]\ngroup = "g"\ncontexts = [64]\nmodes = ["dense"]\n')
    first, second, other = tmp_path / "a.toml", tmp_path / "b.toml", tmp_path / "c.toml"
    first.write_text(body.format(extra=""))
    second.write_text(body.format(extra='shared_gpu = "allow"\n'))
    other.write_text(body.format(extra="seed = 1\n"))
    prepare(tmp_path / "run", first)
    assert prepare(tmp_path / "run", second).shared_gpu == "allow"
    with pytest.raises(InputError, match="differs in seed"):
        prepare(tmp_path / "run", other)


def test_the_nvml_probe_reads_the_device_by_uuid_and_says_unknown_on_an_error(monkeypatch):
    import types

    from sparsedecode.timing.neighbors import _nvml

    calls = []

    def handle(uuid):
        calls.append(uuid)
        if uuid != UUID:
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return "h"

    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: calls.append("shutdown"), nvmlDeviceGetHandleByUUID=handle,
        nvmlDeviceGetComputeRunningProcesses=lambda h: [types.SimpleNamespace(pid=4242, usedGpuMemory=2**31),
                                                        types.SimpleNamespace(pid=6363, usedGpuMemory=None)])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert _nvml(UUID) == [(4242, 2048.0), (6363, 0.0)]
    assert _nvml("GPU-5678") is None and calls.count("shutdown") == 2
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert _nvml(UUID) is None
