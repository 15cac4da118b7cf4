"""Every record the pages cite exists in the tree (issue 25: records live in one tree by device and
campaign, and moving a folder must not leave a page pointing at nothing).

Checked in README.md, docs/**/*.md, benchmarks/records/README.md (the index), src/ and
examples/: each `benchmarks/records/...` path (globs and `{a,b}` lists expanded, at least one
match each), the arguments of a `cd benchmarks/records/... && ... speed_tables.py ...` command
relative to its folder, a folder named relative to `benchmarks/records/` (`h200/...`, `cpu/...`,
`paper/...`, as the decision logs and the index cite them), and a lab folder named bare in prose
(`sparse_gemv_20261201T0625Z_pdl/`), which must exist somewhere under the records.

Every file the pages cite exists too (issue 43): in the same pages, each path from the repository
root to a script, a doc or a test (`benchmarks/...`, `examples/...`, `docs/...`, `src/...`,
`tests/...`, `data/...`), and in the Markdown pages each relative link (`[text](kernels/x.md)`);
an `#anchor` on a Markdown target must name an `<a id>` or a heading there. A file that is gone is
cited where it last lived, `git show`'s way (`b93fd89:benchmarks/device/ablate.sh`), which is not
checked."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "benchmarks/records"

FULL = re.compile(r"benchmarks/records/[^\s`'\"()\[\]<>|:;]*")
CD = re.compile(r"`cd (benchmarks/records/[^\s`]*) &&([^`]*)`")
RELATIVE = re.compile(r"(?<![\w/.{-])(?:h200|cpu|paper)/[\w.+*{},/-]*")
FILE = re.compile(r"(?<![\w/.:-])(?:benchmarks|examples|docs|src|tests|data)/[^\s`'\"()\[\]<>|:;]*")
LINK = re.compile(r"\]\(([^()\s]+)\)")  # a Markdown link's target
ANCHOR = re.compile(r'<a id="([^"]+)"|^#+ (.+)$', re.M)
BARE = re.compile(r"(?<![\w/.-])(?:sparse_gemv|cats_gemv)_(?:profile_)?\d{8}T\d{4,6}Z\w*|(?<![\w/.-])kv_select_\d{8}\b")


def _pages() -> list[Path]:
    pages = [ROOT / "README.md", RECORDS / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for top, exts in (("src", ("*.py", "*.json", "*.toml", "*.md")), ("examples", ("*.toml", "*.md", "*.py"))):
        for ext in exts:
            pages += sorted((ROOT / top).rglob(ext))
    return pages


def _braces(pattern: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [x for alt in m.group(1).split(",") for x in _braces(pattern[:m.start()] + alt + pattern[m.end():])]


def _exists(base: Path, pattern: str) -> bool:
    for p in _braces(pattern):
        p = p.rstrip("/")
        if any(c in p for c in "*?[") and not any(base.glob(p)):
            return False
        if not any(c in p for c in "*?[") and not (base / p).exists():
            return False
    return True


def _clean(token: str) -> str:
    return token.rstrip(".,")


def missing(text: str, folders: set[str]) -> list[str]:
    """The records `text` cites that are not in the tree."""
    bad = [t for t in map(_clean, FULL.findall(text)) if not _exists(ROOT, t)]
    for where, cmd in CD.findall(text):
        if not (ROOT / where).is_dir():
            bad.append(where)
            continue
        args = cmd.split("speed_tables.py", 1)[1].split() if "speed_tables.py" in cmd else []
        bad += [f"{where}: {a}" for a in args if not _exists(ROOT / where, a)]
    bad += [t for t in map(_clean, RELATIVE.findall(text)) if not _exists(RECORDS, t)]
    bad += [t for t in BARE.findall(text) if t not in folders]
    return bad


def _anchors(page: Path) -> set[str]:
    """The `#...` targets of a Markdown page: its `<a id>`s and its headings' slugs (GitHub's)."""
    text = page.read_text(encoding="utf-8")
    return {a or re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for a, h in ANCHOR.findall(text)}


def _target_missing(base: Path, target: str) -> bool:
    path, _, anchor = target.partition("#")
    if path and not _exists(base, path):
        return True
    page = base / path if path else None
    if anchor and page is not None and page.suffix == ".md" and page.is_file():
        return anchor not in _anchors(page)
    return False


def missing_files(text: str, page: Path) -> list[str]:
    """The scripts, docs and tests `text` (the text of `page`) cites that are not in the tree."""
    bad = [t for t in map(_clean, FILE.findall(text))
           if not t.startswith("benchmarks/records/") and _target_missing(ROOT, t)]
    if page.suffix == ".md":
        for t in LINK.findall(text):
            if re.match(r"[a-z]+:", t):  # a URL
                continue
            if t.startswith("#"):
                bad += [t] if t[1:] not in _anchors(page) else []
            elif _target_missing(page.parent, t):
                bad.append(t)
    return bad


@pytest.fixture(scope="module")
def folders() -> set[str]:
    return {p.name for p in RECORDS.rglob("*") if p.is_dir()}


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_record_exists(page, folders):
    text = page.read_text(encoding="utf-8")
    assert not missing(text, folders), f"{page.relative_to(ROOT)} cites records that are not in the tree"


def test_a_missing_record_is_caught(folders):
    assert missing("`benchmarks/records/h200/campaigns/h200_sweep`, records under `benchmarks/records/`", folders) == []
    assert missing("see `benchmarks/records/h200/no_such_folder/`.", folders) == ["benchmarks/records/h200/no_such_folder/"]
    assert missing("`benchmarks/records/h200/campaigns/{h200_sweep,nope}`", folders)
    assert missing("`benchmarks/records/h200/campaigns/*.json`", folders)
    assert missing("| h200/no_such_folder |", folders) == ["h200/no_such_folder"]
    assert missing("(`sparse_gemv_20990101T0000Z_none/`)", folders) == ["sparse_gemv_20990101T0000Z_none"]
    assert missing("`cd benchmarks/records/h200 && python ../../speed_tables.py nope/*.json`", folders)


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_file_exists(page):
    bad = missing_files(page.read_text(encoding="utf-8"), page)
    assert not bad, f"{page.relative_to(ROOT)} cites files that are not in the tree: {', '.join(bad)}"


def test_a_missing_file_is_caught():
    page = ROOT / "docs/engine.md"
    assert missing_files("`benchmarks/kernels/sparse_gemv_bench.py`, [log](kernels/sparse_gemv.md#tuned)", page) == []
    assert missing_files("`benchmarks/proj_decode_h200.py` timed it", page) == ["benchmarks/proj_decode_h200.py"]
    assert missing_files("run `b93fd89:benchmarks/proj_decode_h200.py`", page) == []  # where it last lived
    assert missing_files("see docs/nope.md.", page) == ["docs/nope.md"]
    assert missing_files("[kv](kv.md) and [gone](gone.md)", page) == ["gone.md"]
    assert missing_files("[row](kernels/sparse_gemv.md#no-such-row)", page) == ["kernels/sparse_gemv.md#no-such-row"]
    assert missing_files("`docs/kernels/sparse_gemv.md#no-such-row`", page) == ["docs/kernels/sparse_gemv.md#no-such-row"]
    assert missing_files("[here](#no-such-heading)", page) == ["#no-such-heading"]
