"""The cell processes of a campaign (timing/campaign.py): launch one with its output in a log,
stop one (SIGINT, SIGTERM, SIGKILL) so that it leaves no record and no process on the GPU, and
make SIGTERM stop a campaign as Ctrl-C does (a batch scheduler, a lease, `kill` on a job in the
background)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path


def launch(argv: list[str], log: Path, env: dict | None = None, running: set | None = None,
           nice: int | None = None) -> int:
    """Run one cell process, its output appended to `log`; its exit code. On Ctrl-C the
    child (which got the signal too) is given a moment to stop, then killed. `running`
    holds the live processes of every lane, so that the main thread can stop them. `nice`: the
    niceness the cell runs at where this process may set it (a Ray worker runs niced, and a niced
    timing cell beside a busy neighbour gets a sliver of a core: it times the neighbour)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        f.write(f"$ {' '.join(argv)}\n".encode())
        f.flush()
        proc = None
        try:
            # A signal that arrived while the child was being started, before `proc` held it,
            # would leave a cell running on (and writing its record) after its campaign stopped:
            # the campaign's interrupt waits until the child is held, then is raised here.
            with _held():
                proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env,
                                        preexec_fn=None if nice is None else lambda: _renice(nice))
                if running is not None:
                    running.add(proc)
            _raise_held()
            while True:  # short waits: Ray's cancel raises in the task's thread between bytecodes
                try:
                    return proc.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    continue
        except BaseException:
            if proc is not None:
                stop(proc)
            raise
        finally:
            if running is not None and proc is not None:
                running.discard(proc)


# The campaign's interrupt (TermAsInterrupt's handler, main thread) while a cell is being started:
# [depth of _held sections, the signal that arrived in one or None]
_HOLD = [0, None]


class _held:
    """In the main thread, while TermAsInterrupt is on: SIGTERM/SIGINT arriving inside are kept
    (not raised) until `_raise_held`; elsewhere a no-op (other threads never get the exception)."""

    def __enter__(self):
        self.on = threading.current_thread() is threading.main_thread()
        if self.on:
            _HOLD[0] += 1

    def __exit__(self, *exc):
        if self.on:
            _HOLD[0] -= 1
        return False


def _raise_held() -> None:
    if _HOLD[0] == 0 and _HOLD[1] is not None:
        signum, _HOLD[1] = _HOLD[1], None
        raise KeyboardInterrupt(f"signal {signum}")


def _renice(nice: int) -> None:
    """In the child before exec: run at `nice`, where permitted (lowering niceness needs privilege:
    without it the child keeps its parent's)."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError:
        pass


def stop(proc: subprocess.Popen) -> None:
    """Stop a cell process: SIGINT (what Ctrl-C gave it already), then SIGTERM, then SIGKILL;
    it leaves no record. A campaign started as a background job has SIGINT ignored, and so has
    its child: it gets SIGTERM at once."""
    first = () if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else ((signal.SIGINT, 2.0),)  # inherited
    for sig, grace in (*first, (signal.SIGTERM, 8.0), (signal.SIGKILL, None)):
        if proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue


class TermAsInterrupt:
    """While a campaign runs, SIGTERM raises KeyboardInterrupt in the main thread, so it stops
    the campaign as Ctrl-C does (the running cells stopped, no record, the summary says
    interrupted); SIGINT (where not ignored) does the same through the same handler. Either is
    held while `launch` starts a cell, and raised once the cell can be stopped. Outside the main
    thread signals cannot be set, and this does nothing."""

    def __enter__(self):
        self.old = {}
        if threading.current_thread() is threading.main_thread():
            _HOLD[1] = None
            self.old[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._raise)
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                self.old[signal.SIGINT] = signal.signal(signal.SIGINT, self._raise)
        return self

    @staticmethod
    def _raise(signum, frame):
        if _HOLD[0]:  # a cell is being started: raised by launch once it holds the cell
            _HOLD[1] = signum
            return
        raise KeyboardInterrupt(f"signal {signum}")

    def __exit__(self, *exc):
        for sig, old in self.old.items():
            signal.signal(sig, old)
        _HOLD[1] = None
        return False


__all__ = ["TermAsInterrupt", "launch", "stop"]
