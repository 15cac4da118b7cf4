"""Other processes on the GPU a timing cell runs on (ByteCross App. A: each cell has its GPU
to itself). A decode step reads HBM at nearly its peak, so a neighbor that reads memory too,
a quality run, another cell, a server, slows the step by an amount no interval shows: the
blocks only resample what was measured. A cell therefore looks before it times, refuses a
shared GPU unless told otherwise, looks again after, and its record says what it saw.

The probe asks NVML (`pynvml`, from nvidia-ml-py) for the compute processes of the device
with the cell's UUID, else `nvidia-smi --query-compute-apps`; where neither answers the
record says 'unknown', never 'alone'. The cell's own process and its ancestors (a campaign
runner that touched CUDA) are not neighbors. Callers hold a CUDA context on the device when they
look, so this process is always among those listed: where it is not listed under its own pid,
the driver sees another PID namespace (a container), and then one listed process is this one
and every further one is a neighbor.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from sparsedecode.errors import InputError

SHARED_GPU = ("refuse", "allow")
REFUSED = "the GPU is shared with"  # how a refusal's message begins


class SharedGpu(InputError):
    """A timing cell refused a GPU that other processes hold: its failed record says
    `"refused": "shared_gpu"`, on which a campaign stops scheduling that GPU's cells."""


def device_uuid(dev) -> str | None:
    """'GPU-…' of a torch CUDA device, the name NVML and nvidia-smi use (None if torch has none)."""
    import torch

    uuid = getattr(torch.cuda.get_device_properties(dev), "uuid", None)
    if uuid is None:
        return None
    text = str(uuid)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def _ancestors(pid: int) -> set[int]:
    """pid and its ancestors, read from /proc (just pid where there is no /proc)."""
    out = {pid}
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        out.add(pid)
    return out


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _nvml(uuid: str) -> list[tuple[int, float]] | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - an NVML error leaves the probe to nvidia-smi
        return None
    return [(int(p.pid), (p.usedGpuMemory or 0) / 2**20) for p in procs]


def parse_smi(text: str, uuid: str) -> list[tuple[int, float]]:
    """(pid, used MiB) of `nvidia-smi --query-compute-apps=gpu_uuid,pid,used_memory
    --format=csv,noheader,nounits` lines on the device `uuid`."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3 or parts[0] != uuid:
            continue
        try:
            mib = float(parts[2])
        except ValueError:  # '[N/A]' where the driver does not say
            mib = 0.0
        out.append((int(parts[1]), mib))
    return out


def _smi_query(*args: str) -> str | None:
    try:
        res = subprocess.run(["nvidia-smi", *args, "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout if res.returncode == 0 else None


def _smi(uuid: str, query=_smi_query) -> list[tuple[int, float]] | None:
    if uuid.startswith("MIG-"):  # nvidia-smi names the parent GPU of a MIG slice: it cannot tell
        return None
    gpus = query("--query-gpu=uuid")
    if gpus is None or uuid not in {line.strip() for line in gpus.splitlines()}:
        return None  # a GPU it does not name: no rows would match, which must not read as 'alone'
    apps = query("--query-compute-apps=gpu_uuid,pid,used_memory")
    return None if apps is None else parse_smi(apps, uuid)


def neighbors(uuid: str | None, probes=(_nvml, _smi), me: int | None = None) -> list[dict] | None:
    """The other compute processes on the device `uuid`: [{'pid', 'name', 'used_mib'}], [] when
    it is ours alone, None when no probe could tell. The caller holds a CUDA context there. In
    another PID namespace, where this process cannot be told apart, a device holding more than
    this one process gives all of them, named 'another PID namespace' (one of them is this one)."""
    if uuid is None:
        return None
    me = os.getpid() if me is None else me
    mine = _ancestors(me)
    for probe in probes:
        found = probe(uuid)
        if found is None:
            continue
        if not found or me in {pid for pid, _ in found}:
            return [{"pid": pid, "name": _name(pid), "used_mib": round(mib, 1)}
                    for pid, mib in found if pid not in mine]
        if len(found) == 1:  # listed under a pid of another namespace: this process alone
            return []
        return [{"pid": pid, "name": "another PID namespace", "used_mib": round(mib, 1)} for pid, mib in found]
    return None


def check_alone(seen: list[dict] | None, policy: str) -> None:
    """Refuse a shared GPU under the 'refuse' policy; 'allow' times anyway (the record says who
    was there)."""
    if policy not in SHARED_GPU:
        raise InputError(f"shared_gpu '{policy}' is not one of {', '.join(SHARED_GPU)}")
    if seen and policy == "refuse":
        who = ", ".join(f"pid {p['pid']} ({p['name']}, {p['used_mib']:.0f} MiB)" for p in seen)
        raise SharedGpu(f"{REFUSED} {who}: a timing cell needs it alone (stop them; "
                         "`nvidia-smi` lists them), or set shared_gpu = \"allow\" (`--shared-gpu allow`) "
                         "to time anyway, and the record names them")


def watched(dev, policy: str, fn):
    """(fn(), {'before', 'after'}): the neighbors of a CUDA `dev` just before and after `fn`
    (the timed steps), refused before under the 'refuse' policy; ([], []) off CUDA."""
    check_alone([], policy)  # the policy is checked on every device
    if dev.type != "cuda":
        return fn(), {"before": [], "after": []}
    uuid = device_uuid(dev)
    before = neighbors(uuid)
    check_alone(before, policy)
    out = fn()
    return out, {"before": before, "after": neighbors(uuid)}


__all__ = ["REFUSED", "SHARED_GPU", "SharedGpu", "check_alone", "device_uuid", "neighbors", "parse_smi", "watched"]
