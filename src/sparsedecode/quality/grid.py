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

This module holds the settings, those checks, the loop over settings (`run_grid`, given
the functions that score dense and one setting) and the table; `sparsedecode eval grid`
(cli/eval_grid.py) supplies the engine.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from sparsedecode.account.units import check_keep
from sparsedecode.errors import InputError

DENSE_FILE = "dense.json"
# What every record of one grid shares; record fields in dotted form (protocol_params.* is
# expanded per key, text.file is compared by file name, device by its type).
IDENTITY = ("model.name", "model.init", "model.dims", "protocol", "protocol_params", "text.file",
            "text.tokens", "dtype", "device", "bootstrap.resamples", "bootstrap.seed",
            "bootstrap.level")


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
                "with the options the folder was made with, or give another --out"
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
                "rerun with the options the folder was made with (--obs, --kv), or give another --out"
            )


def check_folder(folder: str | os.PathLike, want: dict) -> None:
    """Every 'ppl_eval' record in `folder` must match `want`; other files are left alone. A
    folder that does not exist yet passes; a file in its place does not."""
    from sparsedecode.records import read_record

    folder = Path(folder)
    if not folder.exists():
        return
    if not folder.is_dir():
        raise InputError(f"--out {folder} is a file; a grid writes a folder of records")
    for p in sorted(folder.glob("*.json")):
        rec = read_record(p)
        if rec.get("kind") == "ppl_eval":
            check_identity(rec, want, str(p))


# -- the loop ------------------------------------------------------------------------
def _write(path: Path, rec: dict) -> dict:
    from sparsedecode.records import stamp, write_record

    rec = stamp(rec)
    write_record(path, rec)
    return rec


def run_grid(folder: str | os.PathLike, grid: list[Setting], want: dict,
             score_dense: Callable[[], dict],
             score: Callable[[Setting, dict], dict], *, obs: int,
             progress: bool = False) -> tuple[list[dict], list[str]]:
    """Records of every setting of `grid` in `folder`, scoring only the missing ones.

    score_dense() returns the dense setting's 'ppl_eval' record; score(setting, dense) one
    setting's record given the dense record's `dense` entry (per-window NLLs) to pair with.
    Each new record gets its wall time (`seconds`), is stamped and written atomically before
    the next setting starts. `want` holds the identity fields (see `identity`) every record
    must share; `obs` is the KV observation window of the settings. Returns the records in
    grid order and the names of the settings scored now.
    """
    from sparsedecode.records import read_record

    folder = Path(folder)
    check_folder(folder, want)
    if not grid or grid[0].name != "dense":
        raise InputError("a grid starts with its dense setting")
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / (DENSE_FILE if s.name == "dense" else s.file) for s in grid]
    have = {}  # every finished setting is checked before anything is scored
    for s, path in zip(grid, paths, strict=True):
        if path.exists():
            have[s] = read_record(path)
            check_config(have[s], s, obs, str(path))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(grid), desc="grid", unit="setting", file=sys.stderr)
    recs, scored = [], []
    try:
        for s, path in zip(grid, paths, strict=True):
            if bar is not None:
                bar.set_postfix_str(s.name)
            rec = have.get(s)
            if rec is None:
                t0 = time.perf_counter()
                rec = score_dense() if s.name == "dense" else score(s, recs[0]["dense"])
                if recs and rec["configured"]["starts"] != recs[0]["dense"]["starts"]:
                    raise InputError(f"setting {s.name} was scored on other windows than {DENSE_FILE}")
                rec["seconds"] = round(time.perf_counter() - t0, 2)
                rec = _write(path, rec)
                scored.append(s.name)
            recs.append(rec)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return recs, scored


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
    "DENSE_FILE", "IDENTITY", "Setting", "check_config", "check_folder", "check_identity",
    "expected_config", "identity", "markdown", "parse_keeps", "row", "run_grid", "settings",
    "text_table", "write_text",
]
