"""Reading the text files users give (configs, records, specs, prompts, routing and calibration
text): a file that is not UTF-8, or not JSON where JSON is due, is an InputError naming the file
and what to do, never a traceback."""

from __future__ import annotations

import json
import os
from pathlib import Path

from sparsedecode.errors import InputError


def read_text(path: str | os.PathLike, what: str = "file") -> str:
    """The UTF-8 text of `path`; InputError for a missing file, a folder or other bytes."""
    path = Path(path)
    try:
        return path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise InputError(f"cannot read {what} {path}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"cannot read {what} {path}: it is a folder; give a file") from None
    except UnicodeDecodeError as e:
        raise InputError(f"cannot read {what} {path}: not UTF-8 text (byte {e.start} is "
                         f"0x{e.object[e.start]:02x}); save it as UTF-8") from None
    except OSError as e:
        raise InputError(f"cannot read {what} {path}: {e.strerror or e}") from None


def read_json(path: str | os.PathLike, what: str = "JSON file"):
    """The parsed JSON of `path` (UTF-8); InputError naming the file and the place it breaks."""
    text = read_text(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"cannot read {what} {path}: not valid JSON ({e.msg} at line {e.lineno}, "
                         f"column {e.colno})") from None


__all__ = ["read_json", "read_text"]
