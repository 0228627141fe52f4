"""Byte sizes: parsing user strings ("6GiB") and PyTorch's two size formatters.

`format_size` is the C++ formatter used in OOM messages (spec §15).
"""
from __future__ import annotations

import re

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": KiB,
    "m": 1000**2, "mb": 1000**2, "mib": MiB,
    "g": 1000**3, "gb": 1000**3, "gib": GiB,
    "t": 1000**4, "tb": 1000**4, "tib": TiB,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, what: str = "size") -> int:
    """Bytes from an int or a string such as ``"6GiB"``, ``"446MiB"``, ``"1.5 GB"``.

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB) powers
    of 1000. Raises ValueError naming ``what`` for anything else, including negative values and
    fractional byte counts.
    """
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int or a string such as '6GiB', got a bool")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what} must not be negative, got {value}")
        return value
    if not isinstance(value, str):
        raise TypeError(f"{what} must be an int or a string such as '6GiB', got {type(value).__name__}")
    m = _SIZE_RE.match(value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"invalid {what} {value!r}: expected a byte count such as 24GiB, 446MiB or 1000000")
    mult = _UNITS[m.group(2).lower()]
    num = m.group(1)
    if "." in num:
        from fractions import Fraction

        exact = Fraction(num) * mult
        if exact.denominator != 1:
            raise ValueError(f"invalid {what} {value!r}: not a whole number of bytes")
        return int(exact)
    return int(num) * mult


def format_size(size: int) -> str:
    """PyTorch's C++ ``format_size`` (OOM messages, spec §15): two decimals, binary units."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1048576:
        return f"{size / 1024.0:.2f} KiB"
    if size <= 1073741824:
        return f"{size / 1048576.0:.2f} MiB"
    return f"{size / 1073741824.0:.2f} GiB"
