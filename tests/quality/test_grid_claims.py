"""Several processes on one grid folder (ByteCross App. H split over workers): each setting
is scored once in all, dense first; a claim of a dead process on this host is taken over,
one from another host only with `reclaim`; an interrupted worker leaves no claim behind.
`run_grid` is driven directly with fake scorers, so no model loads."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

from sparsedecode.quality.grid import CLAIMS, Claims, Setting, run_grid, settings

OBS = 16
FAST = dict(poll=0.01, timeout=5.0)  # a test that waits longer than this has failed


def _rec(s: Setting) -> dict:
    """A 'ppl_eval' record of setting `s` as much as run_grid and its checks read."""
    w = {"protocol": "decode", "nll": [1.0, 2.0], "targets": [4, 4], "starts": [0, 10], "ppl": 1.5}
    proj = None if s.proj_keep >= 1.0 else {"method": "teal", "keep": s.proj_keep, "source": "cached_teal"}
    kv = None if s.kv_keep >= 1.0 else {"method": s.kv_method, "keep": s.kv_keep, "params": {"window": OBS}}
    return {"kind": "ppl_eval", "config": {"mode": s.name, "projection": proj, "kv": kv},
            "dense": w, "configured": w}


class Scorer:
    """Counts the settings scored (by any thread), sleeping `seconds` in each; raises
    KeyboardInterrupt on setting `interrupt`."""

    def __init__(self, folder, seconds: float = 0.0, interrupt: str | None = None):
        self.folder, self.seconds, self.interrupt = folder, seconds, interrupt
        self.calls: Counter[str] = Counter()
        self.lock = threading.Lock()

    def _score(self, s: Setting) -> dict:
        with self.lock:
            self.calls[s.name] += 1
        if s.name == self.interrupt:
            raise KeyboardInterrupt
        time.sleep(self.seconds)
        return _rec(s)

    def dense(self) -> dict:
        return self._score(Setting(kv_method="window"))

    def score(self, s: Setting, dense: dict) -> dict:
        on_disk = json.loads((self.folder / "dense.json").read_text())
        assert dense == on_disk["dense"]  # scored after dense, paired with its record
        return self._score(s)


def _run(folder, scorer, grid, **kw):
    return run_grid(folder, grid, {}, scorer.dense, scorer.score, obs=OBS, **{**FAST, **kw})


def _claim(folder, name: str, host: str, pid: int):
    (folder / CLAIMS).mkdir(parents=True, exist_ok=True)
    path = folder / CLAIMS / f"{name}.claim"
    path.write_text(json.dumps({"host": host, "pid": pid, "started": "2025-01-01T00:00:00.000+00:00"}))
    return path


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", ""])
    p.wait()
    return p.pid


GRID = settings([0.7, 0.5], [0.3], "window")  # dense, 2 proj, 1 kv, 2 pairs


def test_two_workers_score_every_setting_once_and_return_the_same_records(tmp_path):
    scorer = Scorer(tmp_path, seconds=0.1)
    start = threading.Barrier(2)
    results, errors = [None, None], []

    def worker(i):
        try:
            start.wait()
            results[i] = _run(tmp_path, scorer, GRID)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and all(r is not None for r in results), errors
    assert scorer.calls == Counter({s.name: 1 for s in GRID})  # once each, in all
    (a, scored_a), (b, scored_b) = results
    assert [r["config"]["mode"] for r in a] == [s.name for s in GRID]  # grid order
    assert json.dumps(a) == json.dumps(b)
    assert scored_a and scored_b and not set(scored_a) & set(scored_b)  # the work was shared
    assert sorted(scored_a + scored_b) == sorted(s.name for s in GRID)
    assert not (tmp_path / CLAIMS).exists()


def test_a_claim_of_a_dead_process_on_this_host_is_taken_over(tmp_path, capsys):
    pid = _dead_pid()
    path = _claim(tmp_path, "proj0.5.json", platform.node(), pid)
    scorer = Scorer(tmp_path)
    recs, scored = _run(tmp_path, scorer, GRID, timeout=0.0)  # no waiting: taken over at once
    assert scored == [s.name for s in GRID] and len(recs) == len(GRID)
    err = capsys.readouterr().err
    assert f"taking over {path} (pid {pid} on {platform.node()}" in err and "no longer running" in err
    assert not (tmp_path / CLAIMS).exists()


def test_a_claim_from_another_host_holds_until_reclaim(tmp_path, capsys):
    path = _claim(tmp_path, "proj0.5.json", "other-host", 1)
    scorer = Scorer(tmp_path)
    with pytest.raises(TimeoutError, match=r"waited .* for proj0\.5, claimed in .*proj0\.5\.json\.claim.*reclaim=True"):
        _run(tmp_path, scorer, GRID, timeout=0.05)
    err = capsys.readouterr().err
    assert f"waiting for proj0.5: {path} says pid 1 on other-host" in err and "reclaim=True" in err
    assert scorer.calls == Counter({s.name: 1 for s in GRID if s.name != "proj0.5"})  # the rest is done
    assert path.exists()  # another process's claim stays

    recs, scored = _run(tmp_path, scorer, GRID, reclaim=True)
    assert scored == ["proj0.5"] and scorer.calls["proj0.5"] == 1 and len(recs) == len(GRID)
    assert "taking over" in capsys.readouterr().err and not (tmp_path / CLAIMS).exists()


def test_no_setting_is_scored_while_another_process_holds_dense(tmp_path):
    path = _claim(tmp_path, "dense.json", "other-host", 1)
    scorer = Scorer(tmp_path)
    with pytest.raises(TimeoutError, match="for dense"):
        _run(tmp_path, scorer, GRID, timeout=0.05)
    assert not scorer.calls and not list(tmp_path.glob("*.json"))

    # a claim released without its record (that worker was interrupted) is picked up
    threading.Timer(0.1, path.unlink).start()
    recs, scored = _run(tmp_path, scorer, GRID)
    assert scored == [s.name for s in GRID] and scorer.calls == Counter({s.name: 1 for s in GRID})


def test_an_interrupted_worker_leaves_no_claim_and_a_rerun_scores_its_setting(tmp_path):
    scorer = Scorer(tmp_path, interrupt="window0.3")
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, scorer, GRID)
    assert not (tmp_path / CLAIMS).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense.json", "proj0.5.json", "proj0.7.json"]

    scorer.interrupt = None
    recs, scored = _run(tmp_path, scorer, GRID, timeout=0.0)
    assert scored == ["window0.3", "proj0.7_window0.3", "proj0.5_window0.3"]
    assert scorer.calls["window0.3"] == 2 and scorer.calls["dense"] == 1


def test_of_several_processes_taking_over_one_stale_claim_exactly_one_gets_it(tmp_path):
    """Each round, 6 threads find the same dead process's claim and take it over at once:
    one claim results, whatever the interleaving of their links, deletes and creates."""
    pid, n = _dead_pid(), 6

    def take(c, start, won):
        start.wait()
        if c.take("dense.json"):
            won.append(c)

    for _ in range(30):
        path = _claim(tmp_path, "dense.json", platform.node(), pid)
        start, won = threading.Barrier(n), []
        threads = [threading.Thread(target=take, args=(Claims(tmp_path / CLAIMS, say=lambda m: None), start, won))
                   for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(won) == 1 and json.loads(path.read_text()) == won[0].mine["dense.json"]
        won[0].release("dense.json")
        assert list((tmp_path / CLAIMS).iterdir()) == []  # no claim and no link left
