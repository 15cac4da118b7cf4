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
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=None if nice is None else lambda: _renice(nice))
        if running is not None:
            running.add(proc)
        try:
            while True:  # short waits: Ray's cancel raises in the task's thread between bytecodes
                try:
                    return proc.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    continue
        except BaseException:
            stop(proc)
            raise
        finally:
            if running is not None:
                running.discard(proc)


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
    interrupted). Outside the main thread signals cannot be set, and this does nothing."""

    def __enter__(self):
        self.old = None
        if threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGTERM, self._raise)
        return self

    @staticmethod
    def _raise(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    def __exit__(self, *exc):
        if self.old is not None:
            signal.signal(signal.SIGTERM, self.old)
        return False


__all__ = ["TermAsInterrupt", "launch", "stop"]
