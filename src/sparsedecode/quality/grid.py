"""The composition grid: every projection keep crossed with every KV keep, each scored beside
one shared dense run (ByteCross §5.3, App. H).

App. H crosses projection keeps {0.7, 0.6, 0.5} with selection keeps {0.5, 0.3, 0.2} and
adds the six single-branch settings and dense decoding: 16 settings on the same checkpoint,
thresholds, tokenizer and decode-position windows, each with ΔPPL and its paired bootstrap
interval; a keep ratio of 1 disables its branch (Table 16). §5.3 then picks, within each
ΔPPL budget, the fastest setting, on point estimates.

A grid lives in one folder of records. `dense.json` is the dense setting's 'ppl_eval'
record (the format `sparsedecode eval ppl` writes), and its per-window NLLs are the dense
side of every other setting, so dense runs once. Every other setting gets its own record,
`proj0.5_snapkv0.3.json` and so on, written atomically as soon as it is scored: an
interrupted grid loses at most the setting in progress, and a rerun skips every setting
whose record exists. A rerun with another model, protocol, window shape, text, dtype,
device type or bootstrap, or a record whose configuration is not the setting its name
says (another KV observation window), is refused with the field that differs, so a
folder never mixes runs that cannot be compared.

One batch-1 decode step leaves a GPU mostly idle, so several processes may work on one
folder at once (the same command started N times, on one GPU or on hosts sharing the
filesystem): each claims a setting before scoring it (`DIR/.claims/<record>.claim`,
created atomically, deleted when the record is written or the process fails), skips the
settings others hold, and waits for them at the end; dense is scored first, by one process.

This module holds the settings, those checks, the claims, the loop over settings (`run_grid`, given
the functions that score dense and one setting) and the table; `sparsedecode eval grid`
(cli/eval_grid.py) supplies the engine.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from sparsedecode.account.units import check_keep
from sparsedecode.errors import InputError, option

DENSE_FILE = "dense.json"
# What every record of one grid shares; record fields in dotted form (protocol_params.* is
# expanded per key, text.file is compared by file name, device by its type).
IDENTITY = ("model.name", "model.init", "model.dims", "protocol", "protocol_params", "text.file",
            "text.tokens", "dtype", "device", "bootstrap.resamples", "bootstrap.seed",
            "bootstrap.level", "config.adapter.path")  # a merged LoRA adapter (None: the base weights)


@dataclass(frozen=True)
class Setting:
    """One grid point; a keep of 1 turns its branch off (App. H, Table 16)."""

    proj_keep: float = 1.0
    kv_keep: float = 1.0
    kv_method: str = "snapkv"

    @property
    def name(self) -> str:
        """File stem of the setting's record: dense, proj0.7, snapkv0.3, proj0.7_snapkv0.3."""
        parts = []
        if self.proj_keep < 1.0:
            parts.append(f"proj{self.proj_keep:g}")
        if self.kv_keep < 1.0:
            parts.append(f"{self.kv_method}{self.kv_keep:g}")
        return "_".join(parts) or "dense"

    @property
    def file(self) -> str:
        return f"{self.name}.json"


def parse_keeps(text: str, what: str) -> list[float]:
    """'0.7,0.6,0.5' -> [0.7, 0.6, 0.5]: keep ratios in (0, 1], first occurrence order; an
    empty string is no keep."""
    out: list[float] = []
    for part in str(text).split(","):
        if part.strip():
            k = check_keep(part.strip(), what)
            if k not in out:
                out.append(k)
    return out


def settings(proj_keeps: Iterable[float], kv_keeps: Iterable[float], kv_method: str = "snapkv") -> list[Setting]:
    """Dense, then each projection keep alone, each KV keep alone, then every pair (App. H:
    3 x 3 keeps give 16 settings). A keep of 1 is the branch off, already in the list."""
    p = [k for k in dict.fromkeys(proj_keeps) if k < 1.0]
    kv = [k for k in dict.fromkeys(kv_keeps) if k < 1.0]
    out = [Setting(kv_method=kv_method)]
    out += [Setting(proj_keep=a, kv_method=kv_method) for a in p]
    out += [Setting(kv_keep=b, kv_method=kv_method) for b in kv]
    out += [Setting(a, b, kv_method) for a in p for b in kv]
    return out


# -- what a grid's records share ----------------------------------------------------
def _get(rec: dict, dotted: str):
    x = rec
    for key in dotted.split("."):
        if not isinstance(x, dict) or key not in x:
            return None
        x = x[key]
    return x


def _canon(x):
    """A value as JSON would read it back (tuples become lists), for comparison."""
    return json.loads(json.dumps(x))


def identity(rec: dict) -> dict:
    """The fields of a 'ppl_eval' record that every record of one grid shares, dotted."""
    out = {}
    for f in IDENTITY:
        v = _get(rec, f)
        if f == "protocol_params":
            out.update({f"{f}.{k}": v for k, v in (v or {}).items()})
            continue
        if f == "text.file" and v is not None:
            v = Path(v).name
        if f == "device" and v is not None:
            v = str(v).split(":")[0]
        out[f] = v
    return _canon(out)


def check_identity(rec: dict, want: dict, where: str) -> None:
    """Refuse a record that differs from `want` (dotted fields of `identity`) in any field
    `want` names; the error names the first such field."""
    have = identity(rec)
    for f, v in _canon(want).items():
        if have.get(f) != v:
            raise InputError(
                f"{where} was made with {f} = {have.get(f)!r}, this grid runs {f} = {v!r}; a grid's "
                "records share model, protocol, windows, text, dtype, device and bootstrap: rerun "
                f"with the options the folder was made with, or give another {option('folder', flag='--out')}"
            )


def expected_config(s: Setting, obs: int) -> dict:
    """The parts of a record's `config` that name setting `s` (KV observation window `obs`)."""
    return _canon({
        "config.kv": None if s.kv_keep >= 1.0 else {"method": s.kv_method, "keep": s.kv_keep,
                                                   "params": {"window": obs}},
        "config.projection.method": None if s.proj_keep >= 1.0 else "teal",
        "config.projection.keep": None if s.proj_keep >= 1.0 else s.proj_keep,
        "config.projection.source": None if s.proj_keep >= 1.0 else "cached_teal",
    })


def check_config(rec: dict, s: Setting, obs: int, where: str) -> None:
    """Refuse a record whose configuration is not setting `s`."""
    for f, v in expected_config(s, obs).items():
        got = _canon(_get(rec, f))
        if got != v:
            raise InputError(
                f"{where} holds {f} = {got!r}, but grid setting '{s.name}' has {f} = {v!r}; "
                f"rerun with the options the folder was made with ({option('obs')}, "
                f"{option('kv_method', flag='--kv')}), or give another {option('folder', flag='--out')}"
            )


def check_folder(folder: str | os.PathLike, want: dict) -> None:
    """Every 'ppl_eval' record in `folder` must match `want`; other files are left alone. A
    folder that does not exist yet passes; a file in its place does not."""
    from sparsedecode.records import read_record

    folder = Path(folder)
    if not folder.exists():
        return
    if not folder.is_dir():
        raise InputError(f"{option('folder', str(folder), flag='--out')} is a file; a grid writes a folder of records")
    for p in sorted(folder.glob("*.json")):
        rec = read_record(p)
        if rec.get("kind") == "ppl_eval":
            check_identity(rec, want, str(p))


# -- claims: several processes on one folder -------------------------------------------
CLAIMS = ".claims"


def _holder(path: Path) -> dict | None:
    """The claim at `path` ({host, pid, started}); {} while it is being written or cannot be
    read, None when there is none."""
    try:
        h = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return h if isinstance(h, dict) else {}


def _alive(h: dict) -> bool:
    """False only for a claim made on this host by a pid that no longer runs: another host's
    processes cannot be seen from here, so their claims always count as live."""
    if h.get("host") != platform.node() or not isinstance(h.get("pid"), int):
        return True
    try:
        os.kill(h["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _who(h: dict) -> str:
    return f"pid {h.get('pid')} on {h.get('host')} since {h.get('started')}"


@dataclass
class Claims:
    """The settings of one grid folder that processes are scoring now (App. H's 16 settings
    shared by N workers): `DIR/.claims/<record file>.claim`, created with O_EXCL so exactly
    one process gets it, holding its host, pid and start time, and deleted by its holder once
    the record is written or the scoring fails. A claim made on this host by a pid that no
    longer runs is taken over; with `reclaim`, so is every claim present at the start (the
    way out when a worker on another host died)."""

    dir: Path
    reclaim: bool = False
    say: Callable[[str], None] = print
    mine: dict[str, dict] = field(default_factory=dict, init=False)
    found: dict[str, dict | None] = field(default_factory=dict, init=False)

    def __post_init__(self):
        if self.reclaim and self.dir.is_dir():
            self.found = {p.name: _holder(p) for p in self.dir.glob("*.claim")}
            for p in self.dir.glob("*.claim.*"):  # left by a process killed while taking over
                p.unlink(missing_ok=True)

    def path(self, name: str) -> Path:
        return self.dir / f"{name}.claim"

    def holder(self, name: str) -> dict | None:
        return _holder(self.path(name))

    def take(self, name: str) -> bool:
        """Claim record file `name`; False while another live process holds it."""
        path = self.path(name)
        while True:
            me = {"host": platform.node(), "pid": os.getpid(),
                  "started": datetime.now(timezone.utc).isoformat(timespec="microseconds")}
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileNotFoundError:  # no .claims yet, or a finishing process removed it
                self.dir.mkdir(exist_ok=True)
                continue
            except FileExistsError:
                h = self.holder(name)
                if h is None:  # released meanwhile
                    continue
                why = ("that process is no longer running" if not _alive(h) else
                       option("reclaim", True) if self.reclaim and self.found.get(path.name) == h else None)
                if why is None:
                    return False
                if self._remove(path, h):
                    self.say(f"taking over {path} ({_who(h)}): {why}")
                continue
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(me, f)
            except BaseException:
                path.unlink(missing_ok=True)
                raise
            self.mine[name] = me
            return True

    def _remove(self, path: Path, h: dict) -> bool:
        """Delete the claim `h` at `path`. Of several processes taking over one claim, only
        the one that hard-links it to a name made from its content (`os.link` refuses a name
        that exists) deletes it, and only when the link shows `h`, not a newer claim."""
        digest = hashlib.sha1(json.dumps(h, sort_keys=True).encode()).hexdigest()[:12]
        tomb = path.with_name(f"{path.name}.{digest}")
        try:
            os.link(path, tomb)
        except (FileNotFoundError, FileExistsError):  # gone, or being taken over right now
            return False
        try:
            if _holder(tomb) != h:
                return False
            path.unlink()
            return True
        finally:
            tomb.unlink()

    def release(self, name: str) -> None:
        """Delete this process's claim of `name`, unless another process has taken it over."""
        me = self.mine.pop(name, None)
        path = self.path(name)
        if me is not None and _holder(path) == me:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        """Remove `.claims` once no claim is left in it."""
        with contextlib.suppress(OSError):
            self.dir.rmdir()


# -- the loop ------------------------------------------------------------------------
def _write(path: Path, rec: dict) -> dict:
    from sparsedecode.records import stamp, write_record

    rec = stamp(rec)
    write_record(path, rec)
    return rec


def _read(path: Path, s: Setting, want: dict, obs: int) -> dict:
    """The finished record of setting `s`, refused unless it belongs to this grid."""
    from sparsedecode.records import read_record

    rec = read_record(path)
    check_identity(rec, want, str(path))
    check_config(rec, s, obs, str(path))
    return rec


def run_grid(folder: str | os.PathLike, grid: list[Setting], want: dict,
             score_dense: Callable[[], dict],
             score: Callable[[Setting, dict], dict], *, obs: int,
             progress: bool = False, reclaim: bool = False, poll: float = 5.0,
             timeout: float | None = None) -> tuple[list[dict], list[str]]:
    """Records of every setting of `grid` in `folder`, scoring only the missing ones.

    score_dense() returns the dense setting's 'ppl_eval' record; score(setting, dense) one
    setting's record given the dense record's `dense` entry (per-window NLLs) to pair with.
    Each new record gets its wall time (`seconds`), is stamped and written atomically before
    the next setting starts. `want` holds the identity fields (see `identity`) every record
    must share; `obs` is the KV observation window of the settings.

    Several processes may run this on one folder at once (App. H's grid split over workers):
    each claims a setting (`Claims`) before scoring it and skips the settings others hold;
    dense comes first, since every other setting pairs with it. Once nothing is left to
    claim, the settings others hold are polled for every `poll` seconds, and taken over if
    their claim is released without a record or goes stale; `reclaim` takes over the claims
    present at the start. After `timeout` seconds of waiting (None: no limit) TimeoutError.
    Returns the records in grid order and the names of the settings this process scored.
    """
    folder = Path(folder)
    check_folder(folder, want)
    if not grid or grid[0].name != "dense":
        raise InputError("a grid starts with its dense setting")
    folder.mkdir(parents=True, exist_ok=True)
    paths = {s: folder / (DENSE_FILE if s.name == "dense" else s.file) for s in grid}
    # every finished setting is checked before anything is scored
    have = {s: _read(p, s, want, obs) for s, p in paths.items() if p.exists()}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(grid), initial=len(have), desc="grid", unit="setting", file=sys.stderr)
    say = (lambda m: bar.write(m, file=sys.stderr)) if bar is not None else (lambda m: print(m, file=sys.stderr))
    claims = Claims(folder / CLAIMS, reclaim, say)
    scored: list[str] = []

    def done(s: Setting) -> bool:
        """Whether `s` has its record now, scoring it when no other process holds it."""
        path = paths[s]
        try:  # released in any case: an interrupted process leaves no claim behind
            if not path.exists() and not claims.take(path.name):
                return False
            if path.exists():  # finished by another process before this one could claim it
                have[s] = _read(path, s, want, obs)
                return True
            if bar is not None:
                bar.set_postfix_str(s.name)
            t0 = time.perf_counter()
            rec = score_dense() if s.name == "dense" else score(s, have[grid[0]]["dense"])
            if s.name != "dense" and rec["configured"]["starts"] != have[grid[0]]["dense"]["starts"]:
                raise InputError(f"setting {s.name} was scored on other windows than {DENSE_FILE}")
            rec["seconds"] = round(time.perf_counter() - t0, 2)
            have[s] = _write(path, rec)
            scored.append(s.name)
            return True
        finally:
            claims.release(path.name)

    noted: set[tuple[str, str]] = set()
    waited = 0.0
    try:
        while True:
            for s in grid:
                if s not in have and not done(s) and s is grid[0]:
                    break  # every other setting pairs with dense: wait for it
                if bar is not None:
                    bar.update(len(have) - bar.n)
            todo = [s for s in grid if s not in have]
            if not todo:
                break
            held = {s.name: (claims.path(paths[s].name), claims.holder(paths[s].name)) for s in todo}
            for name, (path, h) in held.items():
                if h and (name, str(h)) not in noted:
                    noted.add((name, str(h)))
                    say(f"waiting for {name}: {path} says {_who(h)} is scoring it (if that process "
                        f"is gone, stop this one and rerun with {option('reclaim', True)})")
            if timeout is not None and waited >= timeout:
                raise TimeoutError(f"waited {waited:.0f} s for {', '.join(held)}, claimed in "
                                   f"{', '.join(str(p) for p, _ in held.values())}; if those processes "
                                   f"are gone, rerun with {option('reclaim', True)}")
            if bar is not None:
                bar.set_postfix_str(f"waiting for {todo[0].name}")
            time.sleep(poll)
            waited += poll
    finally:
        if bar is not None:
            bar.close()
        claims.close()
    return [have[s] for s in grid], scored


# -- the table -------------------------------------------------------------------------
def row(rec: dict, name: str | None = None) -> dict:
    """One line of the grid table from a 'ppl_eval' record: mode, keeps (1 = branch off),
    realized projection keep when the record has one, PPL and ΔPPL with its interval."""
    cfg = rec["config"]
    proj, kv = cfg.get("projection"), cfg.get("kv")
    realized = rec.get("realized_keep", (proj or {}).get("realized_keep"))
    b = rec["bootstrap"]
    return {
        "setting": name, "mode": cfg["mode"],
        "proj_keep": 1.0 if proj is None else proj["keep"],
        "kv_method": None if kv is None else kv["method"],
        "kv_keep": 1.0 if kv is None else kv["keep"],
        "realized_keep": realized,
        "ppl": b["config"]["point"], "dense_ppl": b["dense"]["point"],
        "delta": b["delta"], "level": b["level"],
    }


def _cells(r: dict) -> list[str]:
    d = r["delta"]
    return [r["setting"] or "", r["mode"], f"{r['proj_keep']:g}", f"{r['kv_keep']:g}",
            "" if r["realized_keep"] is None else f"{r['realized_keep']:.3f}", f"{r['ppl']:.4f}",
            f"{d['point']:+.4f}", f"[{d['low']:+.4f}, {d['high']:+.4f}]"]


def _header(rows: list[dict]) -> list[str]:
    level = f"{rows[0]['level']:.0%}" if rows else "95%"
    return ["setting", "mode", "proj keep", "kv keep", "realized keep", "PPL", "ΔPPL", f"{level} interval"]


def text_table(rows: list[dict]) -> str:
    """The rows as aligned columns for a terminal."""
    lines = [_header(rows)] + [_cells(r) for r in rows]
    widths = [max(len(x[i]) for x in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in
                               enumerate(zip(x, widths, strict=True))).rstrip() for x in lines)


def markdown(rows: list[dict], title: str = "") -> str:
    """The rows as a markdown table, under `title`."""
    head = _header(rows)
    out = [title, ""] if title else []
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(out) + "\n"


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Replace the file at `path` with `text` atomically (a derived view, rebuilt every run);
    an ordinary file, readable as the umask allows."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


__all__ = [
    "CLAIMS", "DENSE_FILE", "IDENTITY", "Claims", "Setting", "check_config", "check_folder", "check_identity",
    "expected_config", "identity", "markdown", "parse_keeps", "row", "run_grid", "settings",
    "text_table", "write_text",
]
