"""Parsing and printing of token counts, keep ratios and quality curves.

K means 1,024 tokens throughout, as in the ByteCross paper (§3); bytes are
printed in decimal GB and MB.
"""

from __future__ import annotations

import re

from sparsedecode.errors import InputError

K = 1024
_TOKENS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")


def parse_tokens(text: str | int, what: str = "context") -> int:
    """'32768', '32K', '32k', '1.5K', '1M' -> tokens (K = 1024, M = 1024 K)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _TOKENS.match(str(text))
        if not m:
            raise InputError(
                f"{what} '{text}' is not a token count: write 32768, 32K or 32k (K = 1024 tokens)"
            )
        mult = {"": 1, "k": K, "m": K * K}[m.group(2).lower()]
        num = float(m.group(1)) * mult
        if num != int(num):
            raise InputError(f"{what} '{text}' is not a whole number of tokens")
        value = int(num)
    if value <= 0:
        raise InputError(f"{what} must be a positive number of tokens, got {text}")
    return value


def parse_token_list(text: str, what: str = "contexts") -> list[int]:
    """'2K,8K,32K' -> [2048, 8192, 32768]."""
    parts = [p for p in str(text).split(",") if p.strip()]
    if not parts:
        raise InputError(f"{what} is empty: write a comma-separated list such as 2K,8K,32K")
    return [parse_tokens(p, what=f"{what} entry") for p in parts]


def check_keep(value: float, what: str) -> float:
    """A keep ratio must lie in (0, 1]; 1 disables the branch."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{what} '{value}' is not a number: give a keep ratio in (0, 1]") from None
    if not 0.0 < v <= 1.0:
        raise InputError(
            f"{what} {value} is outside (0, 1]: it is the fraction kept, e.g. 0.5 keeps half "
            "(1 disables the branch)"
        )
    return v


def parse_curve(text: str, what: str) -> dict[float, float]:
    """'0.7:0.18,0.6:0.402' -> {0.7: 0.18, 0.6: 0.402} (keep: quality increase)."""
    curve: dict[float, float] = {}
    for part in [p for p in str(text).split(",") if p.strip()]:
        keep, sep, delta = part.partition(":")
        if not sep:
            raise InputError(
                f"{what} entry '{part}' is not KEEP:DELTA; write e.g. 0.7:0.18,0.6:0.402"
            )
        k = check_keep(keep.strip(), f"{what} keep")
        try:
            d = float(delta)
        except ValueError:
            raise InputError(f"{what} entry '{part}': '{delta}' is not a number") from None
        if k in curve:
            raise InputError(f"{what} lists keep {k} twice")
        curve[k] = d
    if not curve:
        raise InputError(f"{what} is empty: write KEEP:DELTA pairs such as 0.7:0.18,0.6:0.402")
    return curve


def fmt_k(tokens: float, digits: int = 1) -> str:
    """76069 -> '74.3K' (K = 1024)."""
    return f"{tokens / K:.{digits}f}K"


def fmt_bytes(n: float) -> str:
    """Decimal units, as the paper prints them."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}" if abs(n) < 100 * scale else f"{n / scale:.0f} {unit}"
    return f"{n:.0f} B"
