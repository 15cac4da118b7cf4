"""Checking the fields of the files users give (gate tables, verdicts, traces, records): each
helper returns the value when it is what is expected, and otherwise raises an InputError in one
line naming the file, the field, the value and what was expected. Booleans are never numbers,
NaN and infinity never pass, and null is never a value (a caller that allows a field to be
absent checks for None first)."""

from __future__ import annotations

import json
import math
import numbers

from sparsedecode.errors import InputError

_SHOWN = 60  # characters of a bad value's repr in a message (a file may hold anything)


def shown(value) -> str:
    """`value` as a message shows it: as JSON writes it (null, true, "text", NaN), cut to one
    short line."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN - 3] + "..."


_MISSING = object()


def refuse(where: str, name: str, value, expected: str) -> InputError:
    """The InputError for field `name` of `where` holding `value` where `expected` is due."""
    got = "missing" if value is _MISSING else shown(value)
    return InputError(f"{where}: field '{name}' is {got}, expected {expected}")


def _num(x) -> str:
    """12, 0.5, 16777216 (a whole float without its '.0', and never in e-notation below 1e15)."""
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        x = int(x)
    return str(x) if isinstance(x, int) else f"{x:g}"


def _range(lo, hi, integer: bool, above: bool) -> str:
    kind = "a whole number" if integer else "a finite number"
    if lo is not None and hi is not None and not above:
        return f"{kind} from {_num(lo)} to {_num(hi)}"
    parts = ([f"{'>' if above else '>='} {_num(lo)}"] if lo is not None else []) + (
        [f"<= {_num(hi)}"] if hi is not None else [])
    return " ".join([kind, " and ".join(parts)]).strip()


def require_number(value, name: str, *, lo: float | None = None, hi: float | None = None,
                   integer: bool = False, above: bool = False, where: str = "input"):
    """`value` when it is a number (an int when `integer`) with lo <= value <= hi (lo < value
    when `above`); never a bool, NaN, infinity, null or a string."""
    expected = _range(lo, hi, integer, above)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if integer else numbers.Real):
        raise refuse(where, name, value, expected)
    if not integer and not math.isfinite(value):
        raise refuse(where, name, value, expected)
    if lo is not None and (value <= lo if above else value < lo):
        raise refuse(where, name, value, expected)
    if hi is not None and value > hi:
        raise refuse(where, name, value, expected)
    return value


def require_str(value, name: str, *, where: str = "input", choices=None, empty: bool = False) -> str:
    """`value` when it is a string (non-empty unless `empty`; one of `choices` when given)."""
    if choices is not None:
        expected = "one of " + ", ".join(repr(c) for c in choices)
    else:
        expected = "a string" if empty else "a non-empty string"
    if not isinstance(value, str) or (not empty and not value) or (choices is not None and value not in choices):
        raise refuse(where, name, value, expected)
    return value


def require_bool(value, name: str, *, where: str = "input") -> bool:
    """`value` when it is true or false (never a string such as 'false', nor 0 or 1)."""
    if not isinstance(value, bool):
        raise refuse(where, name, value, "true or false")
    return value


def require_list(value, name: str, *, where: str = "input", empty: bool = False) -> list:
    """`value` when it is a JSON list (non-empty unless `empty`)."""
    if not isinstance(value, list) or (not empty and not value):
        raise refuse(where, name, value, "a list" if empty else "a non-empty list")
    return value


def require_dict(value, name: str, *, where: str = "input") -> dict:
    """`value` when it is a JSON object."""
    if not isinstance(value, dict):
        raise refuse(where, name, value, "an object")
    return value


def require_field(obj: dict, key: str, *, where: str = "input", prefix: str = ""):
    """obj[key], refused by name when the field is absent or null."""
    value = obj.get(key)
    if value is None:
        raise refuse(where, prefix + key, _MISSING if key not in obj else None, "a value (it is required)")
    return value


def require_increasing(values, name: str, *, where: str = "input") -> list:
    """`values` when each is larger than the one before (the numbers themselves are checked by
    the caller)."""
    for a, b in zip(values, values[1:], strict=False):
        if not b > a:
            raise InputError(f"{where}: field '{name}' must increase, but {shown(b)} follows {shown(a)} "
                             f"(in {shown(list(values))})")
    return list(values)


__all__ = ["refuse", "require_bool", "require_dict", "require_field", "require_increasing", "require_list",
           "require_number", "require_str", "shown"]
