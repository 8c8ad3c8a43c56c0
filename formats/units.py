"""Byte-size parsing shared by the CLI, the writer and the cache ("64MB", "20GiB", 1024)."""

from __future__ import annotations

import re

__all__ = ["format_size", "parse_size", "plural"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_size(value: int | str) -> int:
    """Return a byte count from an int or a string such as "64MB", "1.5GiB", "4096"."""
    if isinstance(value, bool):
        raise TypeError("size must be an int or a string like '64MB', not a bool")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse size {value!r}: use bytes or a unit like '64MB', '20GiB'")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_size(n: float) -> str:
    """Human-readable size with binary units."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def plural(n: int, word: str, many: str | None = None) -> str:
    """`'1 shard'`, `'2 shards'`, `'1,000 samples'` (`many` for irregular plurals)."""
    return f"{n:,} {word if n == 1 else (many or word + 's')}"
