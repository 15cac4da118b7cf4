"""`campaign merge`: bring the records of a campaign run elsewhere (another lease, a node of a
cluster, a copy sent back from a GPU machine) into one campaign folder, losing nothing.

A campaign resumes wherever its folder is, so one campaign often runs as several folders of the
same spec. `merge_campaigns(sources, into)` checks that every source holds the same campaign as
`into` (its spec.toml, compared after parsing, as a resume compares it; `into` takes the
sources' spec when it has none), then plans every record before it writes any:

- a cell `into` lacks is copied (ok or failed: a failed one is retried on the next run there);
- a cell whose record is byte-for-byte the one `into` holds is left alone;
- an ok record over a failed one: the failed one moves to DIR/failed/ (as a retry moves it), the
  ok one takes its place;
- a failed record beside an ok one goes to DIR/failed/, kept as history;
- two different ok records of one cell are two measurements of it: nothing is written, and the
  merge is refused with the list, for a person to decide which run stands.

A source's DIR/failed/ records join `into`'s (under new names where names clash), a
ceiling.json is copied where `into` has none and otherwise kept as it is (the first run's,
as a resume keeps it). Logs stay in the sources. Every file is written atomically.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from sparsedecode.errors import InputError, option
from sparsedecode.timing.folder import failed_path, finished, spec_differences, write_atomic
from sparsedecode.timing.spec import SPEC_FILE, load_spec

CEILING = "ceiling.json"


@dataclass
class MergeSummary:
    """What a merge did, by record: copied, identical (already there), replaced (an ok record
    over a failed one), to_failed (records added to DIR/failed/) and the ceiling's fate."""

    copied: int = 0
    identical: int = 0
    replaced: int = 0
    to_failed: int = 0
    ceiling: str = "none"  # none, copied, identical or kept (into's differs: kept)
    spec: str = "kept"  # kept, or written (into had none)
    sources: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (f"copied {self.copied}, identical {self.identical}, ok over failed {self.replaced}, "
                f"to failed/ {self.to_failed}; ceiling {self.ceiling}; spec {self.spec}")


def _status(path: Path) -> str | None:
    """'ok' (a finished cell, its timing fields checked), 'failed' (any other status, or an
    'ok' record that lacks or spoils its timings), or None for a file that is not a JSON record."""
    rec, why = finished(path)
    return None if rec is None else ("ok" if why is None else "failed")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _records(folder: Path, sub: str) -> list[Path]:
    root = folder / sub
    return sorted(p for p in root.rglob("*.json") if not p.name.startswith(".")) if root.is_dir() else []


def merge_campaigns(sources, into) -> MergeSummary:
    """Merge the campaign folders `sources` into the campaign folder `into` (module doc)."""
    into = Path(into)
    sources = [Path(s) for s in sources]
    if not sources:
        raise InputError("give at least one campaign folder to merge")
    if into.exists() and not into.is_dir():
        raise InputError(f"{option('into', into, placeholder=True)} is a file; give a campaign folder (or a new folder's path)")
    for s in sources:
        if not (s / SPEC_FILE).is_file():
            raise InputError(f"{s} is not a campaign folder (no {SPEC_FILE})")
        if s.resolve() == into.resolve():
            raise InputError(f"{s} is the folder merged into; give the other runs' folders")
    spec_file = into / SPEC_FILE
    summary = MergeSummary(sources=[str(s) for s in sources])
    ref = spec_file if spec_file.is_file() else sources[0] / SPEC_FILE
    if not spec_file.is_file() and _records(into, "cells"):
        raise InputError(f"{into} holds cell records but no {SPEC_FILE}: merge into a campaign folder")
    ref_spec = load_spec(ref)
    for s in sources:
        diff = spec_differences(load_spec(s / SPEC_FILE), ref_spec)
        if diff:
            raise InputError(f"{s} holds another campaign than {ref} (differs in {', '.join(diff)}): "
                             "only runs of one spec merge")

    # plan every write first: a conflict anywhere leaves `into` as it was
    copies: list[tuple[Path, Path]] = []  # (from, to)
    moves: list[tuple[Path, Path]] = []  # into's failed records making way for ok ones
    conflicts: list[str] = []
    planned: dict[Path, Path] = {}  # into's cell path -> the source record planned there
    taken: set[Path] = set()

    def to_failed(group: str, stem: str) -> Path:  # a name free on disk and in this plan
        p = failed_path(into, group, stem, taken)
        taken.add(p)
        return p

    history = {_digest(p) for p in _records(into, "failed")}  # failed records into keeps, by content
    for s in sources:
        for src in _records(s, "cells"):
            rel = src.relative_to(s)
            dest = into / rel
            have = planned.get(dest, dest if dest.exists() else None)
            status = _status(src)
            if status is None:
                raise InputError(f"{src} is not a JSON record; move it away and merge again")
            if have is None:
                copies.append((src, dest))
                planned[dest] = src
                summary.copied += 1
            elif have.read_bytes() == src.read_bytes():
                summary.identical += 1
            elif status == "failed":
                copies.append((src, to_failed(rel.parent.name, src.stem)))
                summary.to_failed += 1
            elif _status(have) == "ok":
                conflicts.append(f"{rel}: {have} and {src} are two measurements of one cell")
            else:  # ok over failed
                if have == dest:
                    moves.append((dest, to_failed(rel.parent.name, dest.stem)))
                else:  # a failed record planned from an earlier source goes to failed/ instead
                    copies.remove((have, dest))
                    copies.append((have, to_failed(rel.parent.name, have.stem)))
                    summary.copied -= 1
                    summary.to_failed += 1
                copies.append((src, dest))
                planned[dest] = src
                summary.replaced += 1
        for src in _records(s, "failed"):
            rel = src.relative_to(s / "failed")
            if _digest(src) in history:
                summary.identical += 1
                continue
            history.add(_digest(src))
            stem = src.stem.rsplit(".", 1)[0] if src.stem.rsplit(".", 1)[-1].isdigit() else src.stem
            copies.append((src, to_failed(rel.parent.name, stem)))
            summary.to_failed += 1
    if conflicts:
        raise InputError(f"{len(conflicts)} cell(s) measured in two runs, nothing merged: " + "; ".join(conflicts[:5])
                         + (" ..." if len(conflicts) > 5 else "") + " (remove the record that should not "
                         "stand from its source, then merge again)")

    if not spec_file.is_file():
        write_atomic(spec_file, ref.read_bytes())
        summary.spec = "written"
    for old, new in moves:
        new.parent.mkdir(parents=True, exist_ok=True)
        os.rename(old, new)
    for src, dest in copies:
        write_atomic(dest, src.read_bytes())
    ceilings = [s / CEILING for s in sources if (s / CEILING).is_file()]
    if ceilings:
        mine = into / CEILING
        if not mine.exists():
            write_atomic(mine, ceilings[0].read_bytes())
            summary.ceiling = "copied"
        else:
            summary.ceiling = ("identical" if all(c.read_bytes() == mine.read_bytes() for c in ceilings)
                               else "kept")
    return summary


__all__ = ["MergeSummary", "merge_campaigns"]
