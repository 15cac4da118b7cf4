"""Timing campaigns: every cell of a grid in blocks, each cell a fresh process
(ByteCross App. A 'Timing', §4.2, App. E).

A campaign is a small TOML file: the model and protocol at the top, and one or
more [[grid]] tables, each a group of contexts x modes under one attention
path. Every grid holds a 'dense' mode, since a speedup is the paired ratio to
the dense cell of the same group, block and context (App. A).

`plan(spec)` lists every cell of every grid in each block. Within a block the
(grid, context) sweep runs ascending in even blocks and descending in odd ones
(the alternating sweep direction of App. E), and the modes of one context run
in an order shuffled by a seeded RNG per (group, context, block), rotated by
one when it repeats the previous block's order (the varied order of App. A;
with two modes this is App. E's rotation). The plan is deterministic given the
seed. Each cell's record goes to DIR/cells/{group}/{cell}_{context}_b{block}.json.

Executors: `local` runs the pending cells one after another, each as a fresh
`python -m sparsedecode bench cell ... --out PATH` process; `ray` runs each as
a Ray task holding one GPU (none on CPU) that launches the same process. Ray
spreads the cells of one block over the GPUs it has, so the paired ratios then
also carry GPU-to-GPU variation: on a multi-GPU host prefer identical GPUs, or
the local executor, which keeps a block on one GPU as App. A does. Ray gets
only as many cells at once as it has GPUs (nodes, for CPU cells).

A cell that finds another process on its GPU refuses to time (timing.neighbors)
and its failed record says `"refused": "shared_gpu"`: a local lane then stops
there, and the Ray executor starts no further cell; what did not run stays
pending for a resume.

On a host with several GPUs, `gpus=["0", "1"]` runs one lane per GPU at once,
block b on GPU b mod len(gpus) (CUDA_VISIBLE_DEVICES), each lane one cell
after another: every block still runs whole on one GPU, so its dense and sparse
cells stay paired on the same device. `stop_after` seconds: start no cell after
that much wall time (a device lease that ends), leaving the rest pending.

Resume: a cell whose record says 'ok' is skipped; a 'failed' record is moved to
DIR/failed/ (kept, never deleted) and its cell runs again; a cell that fails
gets a 'failed' record and the campaign goes on. Ctrl-C stops the running cell
without a record, so it runs again on resume. SIGTERM does the same: a batch
scheduler ending a job, a lease running out, or `kill` on a campaign started in
the background (where the shell has SIGINT ignored, so Ctrl-C semantics cannot
reach it) stops the running cells and leaves no cell process behind on the GPU.
DIR/spec.toml keeps a copy of the spec, and a different spec is refused in an
existing DIR.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from sparsedecode.errors import InputError, option
from sparsedecode.timing.cell import CellSpec, cell_config, model_window
from sparsedecode.timing.folder import finished, retire, spec_differences, write_atomic
from sparsedecode.timing.neighbors import check_alone
from sparsedecode.timing.processes import TermAsInterrupt, launch, stop
from sparsedecode.timing.spec import (  # noqa: F401 (re-exported: the spec is part of a campaign)
    _SAFE,
    DTYPES,
    SPEC_FILE,
    CampaignSpec,
    Grid,
    _fields,
    _grid,
    _safe,
    _toml,
    load_spec,
    parse_spec,
    variant_group,
)

EXECUTORS = ("local", "ray")
CANCEL_WAIT_S = 300  # how long an interrupted Ray campaign waits for its cancelled cells to stop


# -- the plan ----------------------------------------------------------------------
def mode_orders(seed: int, group: str, context: int, modes, blocks: int) -> list[list[str]]:
    """The mode order of one (group, context) in each block: a shuffle seeded by
    (seed, group, context, block), rotated by one when it repeats the previous block's."""
    out: list[list[str]] = []
    for b in range(blocks):
        order = list(modes)
        random.Random(f"{seed}:{group}:{context}:{b}").shuffle(order)  # str seeds are stable
        if out and len(order) > 1 and order == out[-1]:
            order = order[1:] + order[:1]
        out.append(order)
    return out


def plan(spec: CampaignSpec) -> list[CellSpec]:
    """Every cell of every grid in each block, in run order (see the module doc). A grid's
    kernel variants are groups of their own (`variant_group`), interleaved with it block by block."""
    sweep = [(g, v, n) for g in spec.grids for v in g.variants for n in sorted(g.contexts)]
    orders = {(variant_group(g.group, v), n): mode_orders(spec.seed, variant_group(g.group, v), n, g.modes,
                                                          spec.blocks) for g, v, n in sweep}
    cells: list[CellSpec] = []
    for block in range(spec.blocks):
        for g, v, n in (sweep if block % 2 == 0 else sweep[::-1]):
            group = variant_group(g.group, v)
            for mode in orders[(group, n)][block]:
                cells.append(CellSpec(
                    model=spec.model, init=spec.init, dtype=spec.dtype, device=spec.device, context=n,
                    mode=mode, attention=g.attention, warmup=spec.warmup, repeats=spec.repeats,
                    steps=spec.steps, fill=spec.fill, compile_mode=spec.compile_mode,
                    text=spec.text or None, calib_tokens=spec.calib_tokens, obs=spec.obs, seed=spec.seed,
                    kernels=v, impl=g.impl, profile=spec.profile if g.impl == "ours" else 0,
                    shared_gpu=spec.shared_gpu, batch=g.batch, adapter=g.adapter, campaign=spec.name, block=block,
                    method=g.method if cell_config(mode).proj_method else "teal", group=group, order=len(cells)))
    return cells



def check_cells(cells: list[CellSpec]) -> None:
    """Every cell fits the model window and its KV budget holds the sinks and the
    observation window (imports torch for the selector's rule); one error per problem kind."""
    from sparsedecode.timing.cell import check_fits

    seen = set()
    for c in cells:
        key = (c.group, c.context, c.mode)
        if key in seen:
            continue
        seen.add(key)
        try:
            check_fits(c)
        except InputError as e:
            raise InputError(f"grid '{c.group}', context {c.context}, mode {c.mode}: {e}") from None


def record_path(folder: str | os.PathLike, cell: CellSpec) -> Path:
    """DIR/cells/{group}/{cell}_{context}_b{block}.json"""
    return Path(folder) / "cells" / cell.group / f"{cell.cell}_{cell.context}_b{cell.block}.json"


def cell_argv(cell: CellSpec, out: Path, python: str | None = None) -> list[str]:
    """The command that runs `cell` in a fresh process and writes its record at `out`."""
    argv = [python or sys.executable, "-m", "sparsedecode", "bench", "cell",
            "--model", str(cell.model), "--init", cell.init, "--context", str(cell.context),
            "--mode", cell.mode, "--attention", cell.attention, "--warmup", str(cell.warmup),
            "--repeats", str(cell.repeats), "--steps", str(cell.steps), "--fill", cell.fill,
            "--compile-mode", cell.compile_mode, "--device", cell.device, "--dtype", cell.dtype,
            "--calib-tokens", str(cell.calib_tokens), "--obs", str(cell.obs), "--seed", str(cell.seed),
            "--campaign", cell.campaign, "--block", str(cell.block), "--group", cell.group,
            "--cell-id", cell.cell, "--order", str(cell.order)]
    if cell.text:
        argv += ["--text-file", cell.text]
    if cell.kernels:
        argv += ["--kernels", cell.kernels]
    if cell.impl != "ours":
        argv += ["--impl", cell.impl]
    if cell.profile:
        argv += ["--profile", str(cell.profile)]
    if cell.shared_gpu != "refuse":
        argv += ["--shared-gpu", cell.shared_gpu]
    if cell.batch > 1:
        argv += ["--batch", str(cell.batch)]
    if cell.adapter:
        argv += ["--adapter", cell.adapter]
    if cell.method != "teal":
        argv += ["--method", cell.method]
    return argv + ["--out", str(out)]


# -- the folder --------------------------------------------------------------------
def prepare(folder: str | os.PathLike, spec_path: str | os.PathLike,
            spec: CampaignSpec | None = None) -> CampaignSpec:
    """Bind the spec at `spec_path` (validated, or `spec` if already read) to `folder`: write
    DIR/spec.toml at the first run, refuse a different spec (compared after parsing) in an
    existing folder."""
    spec_path, folder = Path(spec_path), Path(folder)
    spec = spec or load_spec(spec_path)
    saved = folder / SPEC_FILE
    if saved.is_file():
        diff = spec_differences(load_spec(saved), spec)  # a resume may change shared_gpu
        if diff:
            raise InputError(
                f"{folder} holds another campaign ({saved}; differs in {', '.join(diff)}): "
                f"run {spec_path} into a new --out folder, or run {saved} to resume this one"
            )
        return spec
    if (folder / "cells").is_dir() and any((folder / "cells").rglob("*.json")):
        raise InputError(f"{folder} holds cell records but no {SPEC_FILE}: use a new {option('folder', flag='--out')}")
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(saved, spec_path.read_bytes())
    return spec


# -- running ----------------------------------------------------------------------
@dataclass
class Summary:
    """What a `run_campaign` call did: cells ok, failed, skipped (already ok), retried
    (failed records moved away), left pending (stopped early) and whether Ctrl-C stopped it."""

    ok: int = 0
    failed: int = 0
    skipped: int = 0
    retried: int = 0
    pending: int = 0
    interrupted: bool = False
    failures: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        out = f"ok {self.ok}, failed {self.failed}, skipped {self.skipped}"
        if self.pending:
            out += f", pending {self.pending}"
        if self.interrupted:
            out += " (interrupted: run the same command again to resume)"
        return out


def _check_gpus(gpus: list[str], spec) -> None:
    """Lanes on GPUs need a CUDA spec and those GPUs: two CPU cells at once would share the
    cores of one timing run, and a lane on a missing GPU would time nothing."""
    if spec.device == "cpu":
        raise InputError(f"{option('gpus')} runs lanes of cells at once, and this spec times on the CPU: two cells "
                         "would share its cores; drop --gpus (CPU cells run one after another)")
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have == 0:
        raise InputError(f"{option('gpus')} needs CUDA GPUs and this machine has none; drop {option('gpus')} or run "
                         "on a GPU host")
    missing = [g for g in gpus if int(g) >= have]
    if missing:
        raise InputError(f"{option('gpus', ','.join(gpus))}: this machine has {have} GPU(s) (ids 0-{have - 1}); "
                         f"{','.join(missing)} do not exist")


def run_campaign(spec_path: str | os.PathLike, folder: str | os.PathLike, executor: str = "local", *,
                 python: str | None = None, max_cells: int | None = None, progress: bool = True,
                 echo: Callable[[str], None] | None = None, gpus: list[str] | None = None,
                 stop_after: float | None = None, shared_gpu: str | None = None) -> Summary:
    """Run the pending cells of the campaign `spec_path` into `folder` (see the module doc).
    `python`: the interpreter of the cell processes; `max_cells`: stop after this many;
    `gpus`: run one lane of blocks per GPU id (local executor); `stop_after`: seconds after
    which no new cell starts; `shared_gpu`: this run's policy on a GPU other processes hold,
    in place of the spec's (each record keeps the policy it ran under and what it saw)."""
    if executor not in EXECUTORS:
        raise InputError(f"executor '{executor}' is not one of {', '.join(EXECUTORS)}")
    if max_cells is not None and max_cells < 0:
        raise InputError(f"{option('max_cells')} must be >= 0, got {max_cells}")
    if gpus is not None:
        if executor != "local":
            raise InputError(f"{option('gpus')} is for the local executor; Ray places cells on its own GPUs")
        if not gpus or len(set(gpus)) != len(gpus) or not all(g.strip().isdigit() for g in gpus):
            raise InputError(f"{option('gpus')} takes distinct GPU ids like 0,1; got {','.join(gpus)!r}")
    if stop_after is not None and stop_after <= 0:
        raise InputError(f"{option('stop_after')} must be > 0 seconds, got {stop_after}")
    folder = Path(folder)
    spec = load_spec(spec_path)
    if shared_gpu is not None:  # a policy of this run, not of what is measured: see prepare()
        check_alone([], shared_gpu)
        spec = replace(spec, shared_gpu=shared_gpu)
    if gpus is not None:
        _check_gpus(gpus, spec)
    cells = plan(spec)
    check_cells(cells)  # before the folder is bound to the spec: a fixed spec can still use it
    prepare(folder, spec_path, spec)
    summary = Summary()
    todo = []
    for c in cells:
        path = record_path(folder, c)
        if path.exists():
            if finished(path)[1] is None:
                summary.skipped += 1
                continue
            retire(folder, path)
            summary.retried += 1
        todo.append(c)
    if max_cells is not None and max_cells < len(todo):
        summary.pending = len(todo) - max_cells
        todo = todo[:max_cells]
    stop_at = None if stop_after is None else time.monotonic() + stop_after
    with TermAsInterrupt():
        if executor == "local":
            if todo and spec.device.startswith("cuda"):
                try:
                    _measure_ceiling(spec, folder, python, echo or print)
                except KeyboardInterrupt:  # stopped before any cell: every one stays pending
                    summary.interrupted, summary.pending = True, summary.pending + len(todo)
                    return summary
            _run_local(spec, folder, todo, summary, python=python, progress=progress, echo=echo, gpus=gpus,
                       stop_at=stop_at)
        else:
            _run_ray(spec, folder, todo, summary, python=python, progress=progress, echo=echo)
    return summary


def run_chain(specs: list, folders: list, *, max_cells: int | None = None, stop_after: float | None = None,
              **kw) -> list[Summary | None]:
    """`run_campaign` of each spec into its folder, one after another (a device lease, a batch
    job): `max_cells` and `stop_after` count over the whole chain, a spec they no longer reach
    is not started (None in its place), an interruption (Ctrl-C, SIGTERM) ends the chain (the
    list stops at the interrupted spec) and a failed cell does not. `kw` goes to every
    `run_campaign`."""
    start, done, out = time.monotonic(), 0, []
    for i, (spec, folder) in enumerate(zip(specs, folders, strict=True)):
        left = None if stop_after is None else stop_after - (time.monotonic() - start)
        cells = None if max_cells is None else max_cells - done
        if i and ((left is not None and left <= 0) or cells == 0):
            out.append(None)  # not started: the budget went to earlier specs
            continue
        summary = run_campaign(spec, folder, max_cells=cells, stop_after=left, **kw)
        done += summary.ok + summary.failed
        out.append(summary)
        if summary.interrupted:
            break
    return out


def _measure_ceiling(spec, folder: Path, python: str | None, echo) -> None:
    """DIR/ceiling.json, the measured bandwidth ceiling (`bench ceiling`), in the same run as a
    CUDA campaign's first cells, so `report` gives each cell's share of it; kept on a resume."""
    out = folder / "ceiling.json"
    if out.exists():
        return
    argv = [python or sys.executable, "-m", "sparsedecode", "bench", "ceiling", "--device", spec.device,
            "--dtype", spec.dtype, "--shared-gpu", spec.shared_gpu, "--out", str(out)]
    if launch(argv, folder / "logs" / "ceiling.log") != 0 or not out.exists():
        echo(f"the bandwidth ceiling was not measured (see {folder / 'logs' / 'ceiling.log'}): "
             "% of ceiling stays blank in the report")


def _log_path(folder: Path, cell: CellSpec) -> Path:
    return folder / "logs" / cell.group / f"{cell.cell}_{cell.context}_b{cell.block}.log"


def _settle(folder: Path, cell: CellSpec, rc: int, start: int) -> dict:
    """The record of a finished cell process; when it died without one (killed, out of
    memory), a 'failed' record with its exit code and the end of its log. An 'ok' record
    without its timings counts as failed (its file stays, and a resume retries it)."""
    from sparsedecode.records import stamp, write_record

    path = record_path(folder, cell)
    rec, why = finished(path) if path.exists() else (None, None)
    if rec is not None:
        return rec if why is None or rec.get("status") != "ok" else {**rec, "status": "failed", "error": why}
    log = _log_path(folder, cell)
    tail = log.read_bytes()[start:].decode(errors="replace").rstrip().splitlines()[-20:] if log.exists() else []
    rec = stamp({"kind": "timing_cell", "status": "failed", "campaign": cell.campaign, "block": cell.block,
                 "group": cell.group, "cell": cell.cell, "order": cell.order, "context": cell.context,
                 "mode_spec": cell.mode, "mode": cell.parsed.kind, "attention": cell.attention,
                 "model_name": model_window(cell.model, cell.init)[0],
                 "error": f"the cell process exited with code {rc} without writing a record",
                 "traceback": "\n".join(tail)}, with_torch=False)
    write_record(path, rec)
    return rec


def _tally(summary: Summary, cell: CellSpec, rec: dict, echo) -> None:
    where = f"{cell.group} {cell.cell} n={cell.context} b{cell.block}"
    if rec.get("status") == "ok":
        summary.ok += 1
        bound = "" if rec.get("byte_bound") is None else f", bound {rec['byte_bound']:.3f}x"
        echo(f"{where}: {rec['ms_per_token']:.3f} ms/token, {rec['tokens_per_sec']:.1f} tok/s{bound}")
    else:
        error = _first_line(rec.get("error"))
        summary.failed += 1
        summary.failures.append(f"{where}: {error}")
        echo(f"{where}: FAILED: {error}")


def _recount(folder: Path, todo: list[CellSpec], summary: Summary, echo) -> int:
    """After an interruption the records on disk are the truth: a cell that wrote its whole 'ok'
    record as the signal arrived is done (a resume skips it), though its process was stopped
    before it was tallied. Sets `summary.ok` from disk; returns how many that adds."""
    ok = 0
    for cell in todo:
        path = record_path(folder, cell)
        rec, why = finished(path) if path.exists() else (None, None)
        ok += rec is not None and why is None and rec.get("status") == "ok"
    gained = max(0, ok - summary.ok)
    if gained:
        echo(f"{gained} cell(s) finished as the campaign was stopped: their records are kept")
    summary.ok += gained
    return gained


def refused(rec: dict) -> bool:
    """A cell that refused a shared GPU (timing.neighbors.SharedGpu): its GPU would refuse the next too."""
    return rec.get("status") != "ok" and rec.get("refused") == "shared_gpu"


def _first_line(error) -> str:
    """The first line of an error message (torch.compile errors run to pages)."""
    lines = str(error or "no error message").strip().splitlines()
    return lines[0][:300] if lines else "no error message"


def _run_local(spec, folder: Path, todo: list[CellSpec], summary: Summary, *, python, progress, echo,
               gpus: list[str] | None = None, stop_at: float | None = None):
    from tqdm.auto import tqdm

    lanes = [(None, todo)] if not gpus else [
        (g, [c for c in todo if c.block % len(gpus) == i]) for i, g in enumerate(gpus)]
    bar = tqdm(total=len(todo), unit="cell", desc=spec.name, disable=not progress)
    echo = echo or bar.write
    lock, halt, running = threading.Lock(), threading.Event(), set()
    finished = [0]

    def lane(gpu: str | None, cells: list[CellSpec]) -> None:
        env = None if gpu is None else {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
        for cell in cells:
            if halt.is_set() or (stop_at is not None and time.monotonic() > stop_at):
                return
            with lock:
                bar.set_postfix_str(f"{cell.group} {cell.cell} n={cell.context} b{cell.block}"
                                    + (f" gpu{gpu}" if gpu is not None else ""))
            log = _log_path(folder, cell)
            start = log.stat().st_size if log.exists() else 0
            rc = launch(cell_argv(cell, record_path(folder, cell), python), log, env, running)
            if halt.is_set():  # stopped by Ctrl-C: whatever it wrote stays, a missing record reruns
                return
            with lock:
                rec = _settle(folder, cell, rc, start)
                _tally(summary, cell, rec, echo)
                finished[0] += 1
                bar.update()
            if refused(rec):  # every later cell of this lane would be refused too: leave them pending
                echo(f"{'GPU ' + gpu if gpu is not None else 'the GPU'} is shared with another process: "
                     "this lane stops and its cells stay pending; resume when the GPU is free")
                return

    threads = [threading.Thread(target=lane, args=lane_args, daemon=True) for lane_args in lanes]
    try:
        if len(threads) == 1:
            lane(*lanes[0])
        else:
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                for t in threads:
                    t.join(0.2)
    except KeyboardInterrupt:  # the running cells have no record: they run again on resume
        summary.interrupted = True
        halt.set()
        for proc in list(running):
            stop(proc)
        for t in threads:
            if t.is_alive():
                t.join()
        finished[0] += _recount(folder, todo, summary, echo)
    finally:
        bar.close()
    summary.pending += len(todo) - finished[0]


def _ray_cell(argv: list[str], log: str, nice: int) -> int:
    return launch(argv, Path(log), nice=nice)  # at the campaign's niceness, not the Ray worker's


def _run_ray(spec, folder: Path, todo: list[CellSpec], summary: Summary, *, python, progress, echo):
    try:
        import ray
    except ModuleNotFoundError:
        raise InputError("the ray executor needs Ray: pip install 'ray[default]', or use --executor local") from None
    if not ray.is_initialized():
        # A local Ray's processes are this process's children. Ray cancels a running task with
        # SIGINT, so they must not inherit an ignored SIGINT (a campaign run as a background job).
        ignored = (threading.current_thread() is threading.main_thread()
                   and signal.getsignal(signal.SIGINT) is signal.SIG_IGN)
        if ignored:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            ray.init()  # RAY_ADDRESS (e.g. ray://head:10001) joins an existing cluster, else a local one
        finally:
            if ignored:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
    with TermAsInterrupt():  # ray.init installs its own SIGTERM handler, which would just exit
        _ray_cells(ray, spec, folder, todo, summary, python=python, progress=progress, echo=echo)


def _ray_cells(ray, spec, folder: Path, todo: list[CellSpec], summary: Summary, *, python, progress, echo):
    from tqdm.auto import tqdm

    resources = ray.cluster_resources()
    gpus = 0 if spec.device == "cpu" else 1
    if spec.device == "auto" and not resources.get("GPU"):
        gpus = 0
    alive = [n for n in ray.nodes() if n.get("Alive")]
    # A GPU cell takes one GPU. A CPU cell takes every CPU of the smallest node, so no two CPU
    # timing runs ever share the cores of one machine (as the local executor runs them).
    cpus = 1 if gpus else min(n["Resources"].get("CPU", 1) for n in alive)
    # Only as many cells in flight as the cluster runs at once: the rest wait here, not in
    # Ray's queue, so a refused GPU (another process on it) can hold them back.
    slots = max(1, int(resources.get("GPU", 0)) if gpus else len(alive))
    task = ray.remote(num_gpus=gpus, num_cpus=cpus)(_ray_cell)
    nice = os.getpriority(os.PRIO_PROCESS, 0)  # Ray's workers run niced; the cells run as the campaign does
    bar = tqdm(total=len(todo), unit="cell", desc=spec.name, disable=not progress)
    echo = echo or bar.write
    queue, starts, refs, halted = list(todo), {}, {}, False

    def submit() -> None:
        while queue and len(refs) < slots and not halted:
            cell = queue.pop(0)
            log = _log_path(folder, cell)
            starts[cell.order] = log.stat().st_size if log.exists() else 0
            refs[task.remote(cell_argv(cell, record_path(folder, cell), python), str(log), nice)] = cell

    try:
        submit()
        while refs:
            done, _ = ray.wait(list(refs), num_returns=1, timeout=0.5)  # short: signals run between waits
            if not done:
                continue
            cell = refs.pop(done[0])
            rec = _settle(folder, cell, ray.get(done[0]), starts[cell.order])
            _tally(summary, cell, rec, echo)
            bar.update()
            if refused(rec) and not halted:
                halted = True
                echo("a GPU of the cluster is shared with another process: no further cell starts, the "
                     "running ones finish and the rest stay pending; resume when it is free")
            submit()
    except KeyboardInterrupt:
        # Not force=True: that ends a worker at once and orphans the cell process it launched,
        # which would run on (on the GPU) after the campaign says it stopped. Without force a
        # running task gets KeyboardInterrupt, and `launch` stops its cell before it returns.
        # Wait for them (bounded): on a loaded host stopping a cell can take well over 30 s, and a
        # campaign that exits first leaves its cells running behind its summary.
        for ref in refs:
            ray.cancel(ref)
        ray.wait(list(refs), num_returns=len(refs), timeout=CANCEL_WAIT_S)
        summary.interrupted = True
        summary.pending += len(refs) - _recount(folder, todo, summary, echo)
    finally:
        bar.close()
    summary.pending += len(queue)


# -- status --------------------------------------------------------------------------
def status(folder: str | os.PathLike) -> dict:
    """Done, failed and pending cells per group of the campaign in `folder`, and the
    pending and failed cells in run order."""
    folder = Path(folder)
    saved = folder / SPEC_FILE
    if not saved.is_file():
        raise InputError(f"{folder} is not a campaign folder (no {SPEC_FILE}); "
                         "start one with `sparsedecode campaign run SPEC --out DIR`")
    spec = load_spec(saved)
    pending, failed = [], []
    cells = plan(spec)
    groups = {c.group: {"done": 0, "failed": 0, "pending": 0} for c in cells}  # a variant is a group
    stamps = []
    for c in cells:
        path = record_path(folder, c)
        rec, why = finished(path) if path.exists() else (None, None)
        what = {"group": c.group, "cell": c.cell, "context": c.context, "block": c.block,
                "mode": c.mode, "order": c.order, "path": str(path)}
        if path.exists() and why is None:
            groups[c.group]["done"] += 1
            stamps.append(rec.get("timestamp"))
        elif path.exists():
            groups[c.group]["failed"] += 1
            failed.append({**what, "error": _first_line(why)})
        else:
            groups[c.group]["pending"] += 1
            pending.append(what)
    cell_s, seen = cell_seconds(stamps)
    return {"name": spec.name, "folder": str(folder), "total": len(cells), "groups": groups,
            "pending": pending, "failed": failed,
            "estimate": None if cell_s is None else {"cell_s": cell_s, "intervals": seen,
                                                     "remaining_s": round(cell_s * len(pending))}}


GAP_S = 600  # a longer pause between two records is a break between runs, not a cell


def cell_seconds(stamps) -> tuple[float | None, int]:
    """(median seconds a cell takes, how many intervals it rests on), from the finishing times
    of the records: the gaps between consecutive ones, leaving out breaks between runs (over
    GAP_S). Every cell runs in a fresh process, so the gap holds its whole cost (start, load,
    compile, timed steps), which is what planning device time needs. (None, 0) below one gap."""
    import datetime as dt

    times = []
    for s in stamps:
        try:
            times.append(dt.datetime.fromisoformat(s).timestamp())
        except (TypeError, ValueError):
            continue
    times.sort()
    gaps = [b - a for a, b in zip(times[:-1], times[1:], strict=True) if 0 < b - a <= GAP_S]
    return (statistics.median(gaps), len(gaps)) if gaps else (None, 0)


__all__ = ["CampaignSpec", "EXECUTORS", "Grid", "Summary", "cell_argv", "check_cells", "load_spec",
           "mode_orders", "parse_spec", "plan", "prepare", "record_path", "retire", "run_campaign",
           "run_chain", "status"]
