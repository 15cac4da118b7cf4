"""Evaluation and calibration text: the WikiText-2 raw token streams.

The token stream of a split is the whole raw file tokenized as one string,
without special tokens (ByteCross App. A 'Quality protocols'; issue 7 item 1),
so window i of a protocol is the same text for every configuration. The files
come from `--text-file` (a folder holding `wiki.test.raw` / `wiki.valid.raw`,
or any text file), and by default from `../shared/data/wikitext-2-raw` beside
the repository. Tokenized streams are kept in memory per (file, tokenizer).

It sits below `projection/` (docs/architecture.md): calibration and evaluation read the
same text, and a calibrator reading it does not import `quality/`.
"""

from __future__ import annotations

import os
from pathlib import Path

from sparsedecode.errors import InputError

# src/sparsedecode/corpus.py -> parents[2] is the checkout; shared/ sits beside it.
DEFAULT_WIKITEXT = Path(__file__).resolve().parents[2].parent / "shared/data/wikitext-2-raw"
SPLITS = {"test": "wiki.test.raw", "valid": "wiki.valid.raw", "validation": "wiki.valid.raw"}

_CACHE: dict[tuple, list[int]] = {}


def wikitext_path(split: str = "test", source: str | os.PathLike | None = None) -> Path:
    """The raw file of `split` ('test' or 'valid') in `source` (a folder or a text file)."""
    if split not in SPLITS:
        raise InputError(f"unknown WikiText-2 split '{split}': use 'test' or 'valid'")
    root = Path(source).expanduser() if source is not None else DEFAULT_WIKITEXT
    path = root / SPLITS[split] if root.is_dir() else root
    if not path.is_file():
        where = "the default folder" if source is None else "--text-file"
        raise InputError(
            f"no text at {path} ({where}); pass --text-file FILE (any text file) or a folder "
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


__all__ = ["DEFAULT_WIKITEXT", "text_ids", "wikitext_ids", "wikitext_path"]
