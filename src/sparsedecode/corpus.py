"""Evaluation and calibration text: the WikiText-2 raw token streams.

The token stream of a split is the whole raw file tokenized as one string,
without special tokens (ByteCross App. A 'Quality protocols'; issue 7 item 1),
so window i of a protocol is the same text for every configuration. The files
come from `--text-file` (a folder holding `wiki.test.raw` / `wiki.valid.raw`,
or any text file), and by default from the copy shipped in the package
(`src/sparsedecode/data/wikitext-2-raw/*.xz`, CC BY-SA 3.0, its SOURCE.md), unpacked into the
cache on first use and checked against the pinned sha256 (`SHIPPED`). Tokenized
streams are kept in memory per (file, tokenizer).

It sits below `projection/` (docs/architecture.md): calibration and evaluation read the
same text, and a calibrator reading it does not import `quality/`.
"""

from __future__ import annotations

import lzma
import os
import shutil
import tempfile
from pathlib import Path

from sparsedecode.cache import cache_dir, sha256_of
from sparsedecode.errors import InputError, option

SPLITS = {"test": "wiki.test.raw", "valid": "wiki.valid.raw", "validation": "wiki.valid.raw"}
# sha256 of each shipped file once unpacked (the canonical wikitext-2-raw files; SOURCE.md)
SHIPPED = {
    "wiki.test.raw": "173c87a53759e0201f33e0ccf978e510c2042d7f2cb78229d9a50d79b9e7dd08",
    "wiki.valid.raw": "4cd0f6876d07a413aa911261ff6d363c72d757d47f0fdd6015702014c89cb9c7",
}
PACKAGED = Path(__file__).resolve().parent / "data" / "wikitext-2-raw"

_CACHE: dict[tuple, list[int]] = {}
_CHECKED: set[Path] = set()  # unpacked files whose sha256 this process has checked


def shipped_text(name: str) -> Path:
    """The unpacked shipped file `name` (a key of `SHIPPED`) under the cache: unpacked from the
    package's .xz on first use, or again where the cached copy is not the pinned one."""
    dest = cache_dir() / "data" / "wikitext-2-raw" / name
    if dest in _CHECKED:
        return dest
    pinned = SHIPPED[name]
    if not (dest.is_file() and sha256_of(dest) == pinned):
        packed = PACKAGED / f"{name}.xz"
        if not packed.is_file():
            raise InputError(f"the package's copy of {name} ({packed}) is missing: reinstall sparsedecode, "
                             f"or pass {option('text_file', 'FILE', placeholder=True, python='text=FILE')}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=dest.parent, prefix=f".{name}-", delete=False) as tmp:
            with lzma.open(packed) as src:
                shutil.copyfileobj(src, tmp)
        got = sha256_of(tmp.name)
        if got != pinned:
            os.unlink(tmp.name)
            raise InputError(f"{packed} unpacks to sha256 {got[:12]}..., not the pinned {pinned[:12]}...: "
                             "the package is damaged; reinstall sparsedecode")
        os.chmod(tmp.name, 0o644)  # a temporary file is private; the text is not
        os.replace(tmp.name, dest)  # whole or not at all: a second process sees no half file
    _CHECKED.add(dest)
    return dest


def wikitext_path(split: str = "test", source: str | os.PathLike | None = None) -> Path:
    """The raw file of `split` ('test' or 'valid') in `source` (a folder or a text file), by
    default the shipped one (`shipped_text`)."""
    if split not in SPLITS:
        raise InputError(f"unknown WikiText-2 split '{split}': use 'test' or 'valid'")
    if source is None:
        return shipped_text(SPLITS[split])
    root = Path(source).expanduser()
    path = root / SPLITS[split] if root.is_dir() else root
    if not path.is_file():
        raise InputError(
            f"no text at {path} ({option('text_file', python='text=')}); pass "
            f"{option('text_file', 'FILE', placeholder=True, python='text=FILE')} (any text file) or a folder "
            "holding wiki.test.raw and wiki.valid.raw (WikiText-2 raw)"
        )
    return path


def text_ids(tokenizer, path: str | os.PathLike) -> list[int]:
    """Token ids of a whole text file tokenized as one string, without special tokens."""
    path = Path(path)
    if tokenizer is None:
        raise InputError("this model was loaded without a tokenizer; text needs one")
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, id(tokenizer))
    if key not in _CACHE:
        from sparsedecode.textfile import read_text

        text = read_text(path, "text file")
        if not text.strip():
            raise InputError(f"{path} is empty: give a text file with some text in it")
        _CACHE[key] = list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
    return _CACHE[key]


def require_tokens(ids, n: int, path: str | os.PathLike, option: str = "--tokens") -> None:
    """Refuse a text (ids of `path`) shorter than the n tokens `option` asks for."""
    if len(ids) < n:
        raise InputError(
            f"{path} has {len(ids):,} tokens, fewer than {option} {n:,}; "
            f"give a longer --text-file or a smaller {option}"
        )


def wikitext_ids(tokenizer, split: str = "test", source: str | os.PathLike | None = None) -> list[int]:
    """The token stream of a WikiText-2 raw split (or of the text file `source`)."""
    return text_ids(tokenizer, wikitext_path(split, source))


__all__ = ["SHIPPED", "require_tokens", "shipped_text", "text_ids", "wikitext_ids", "wikitext_path"]
