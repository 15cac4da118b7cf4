"""The package works alone, on a fresh clone or a wheel with nothing beside it (issue 48): no
source reads `../shared` or any path above the package, and the default text ships inside it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src/sparsedecode"
TEXT_FILES = ("*.py", "*.json", "*.md", "*.toml")
UP = re.compile(r"\.parents\[(\d+)\]|\.parent\b|\.with_name\(")


def _sources():
    for pattern in TEXT_FILES:
        yield from sorted(PACKAGE.rglob(pattern))


def test_no_source_names_a_place_beside_the_repository():
    bad = [f"{f.relative_to(ROOT)}:{i}" for f in _sources()
           for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1)
           if "../shared" in line or "shared/data" in line or "'../" in line or '"../' in line]
    assert not bad, f"these lines name a place outside the package: {bad}"


def test_no_path_from_a_module_file_climbs_above_the_package():
    """A path built from `__file__` goes up at most to `src/sparsedecode` (one `.parent` or
    `.with_name` per folder between the module and the package root)."""
    bad = []
    for f in PACKAGE.rglob("*.py"):
        allowed = len(f.relative_to(PACKAGE).parts)  # corpus.py: 1 (its parent is the package)
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if "__file__" not in line:
                continue
            ups = sum(int(m.group(1)) + 1 if m.group(1) else 1 for m in UP.finditer(line))
            if ups > allowed:
                bad.append(f"{f.relative_to(ROOT)}:{i} climbs {ups} folders, at most {allowed} stay inside")
    assert not bad, bad


def test_the_default_text_ships_inside_the_package_and_is_not_ignored():
    from sparsedecode.corpus import PACKAGED, SHIPPED

    assert PACKAGED.is_relative_to(PACKAGE)
    files = [PACKAGED / f"{name}.xz" for name in SHIPPED] + [PACKAGED / "SOURCE.md"]
    assert all(p.is_file() for p in files), files
    # the wheel ships every file git carries under the package; an ignored one would be left out
    ignored = subprocess.run(["git", "check-ignore", *map(str, files)], cwd=ROOT, capture_output=True, text=True)
    assert ignored.stdout == "", f"git ignores {ignored.stdout}"
    source = (PACKAGED / "SOURCE.md").read_text(encoding="utf-8")
    assert "CC BY-SA 3.0" in source and "Pointer Sentinel Mixture Models" in source
    assert all(sha in source for sha in SHIPPED.values())


def test_the_shipped_text_unpacks_into_the_cache_once_checked(tmp_path, monkeypatch):
    from sparsedecode import corpus
    from sparsedecode.cache import sha256_of

    monkeypatch.setenv("SPARSEDECODE_CACHE", str(tmp_path))
    path = corpus.wikitext_path("valid")
    assert path == tmp_path / "data/wikitext-2-raw/wiki.valid.raw"
    assert sha256_of(path) == corpus.SHIPPED["wiki.valid.raw"]
    assert path.read_text(encoding="utf-8").startswith(" \n = Homarus gammarus = \n")
    path.write_text("damaged")  # a changed cache copy is unpacked again, not read
    corpus._CHECKED.discard(path)
    assert sha256_of(corpus.wikitext_path("valid")) == corpus.SHIPPED["wiki.valid.raw"]
