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
#: the largest size: PyTorch's sizes are ``size_t``
MAX_SIZE = (1 << 64) - 1
#: no size is written in more characters (20 digits, a fraction, a unit and spaces)
_MAX_TEXT = 64
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


class SizeOverflow(ValueError):
    """A size larger than any PyTorch can hold (a ``size_t``)."""


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
            raise ValueError(f"{what} must not be negative, got {shown_value(value)}")
        if value > MAX_SIZE:
            raise SizeOverflow(f"{what} is {shown_value(value)}: more than a size_t holds (2**64 - 1 bytes)")
        return value
    if not isinstance(value, str):
        raise TypeError(f"{what} must be an int or a string such as '6GiB', got {type(value).__name__}")
    m = _SIZE_RE.match(value) if len(value) <= _MAX_TEXT else None
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"invalid {what} {shown_value(value)}: expected a byte count such as 24GiB, 446MiB or 1000000")
    mult = _UNITS[m.group(2).lower()]
    num = m.group(1)
    if "." in num:
        from fractions import Fraction

        exact = Fraction(num) * mult
        if exact.denominator != 1:
            raise ValueError(f"invalid {what} {shown_value(value)}: not a whole number of bytes")
        total = int(exact)
    else:
        total = int(num) * mult
    if total > MAX_SIZE:
        raise SizeOverflow(f"invalid {what} {shown_value(value)}: more than a size_t holds (2**64 - 1 bytes)")
    return total


def shown_value(value: int | str, limit: int = 40) -> str:
    """A user's value in an error message, in bounded space: a long one is cut, with its length."""
    if not isinstance(value, str):  # an int: its digits only when few (str() refuses > 4,300 of them)
        return str(value) if -(10**30) < value < 10**30 else f"an int of {abs(value).bit_length():,} bits"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(value):,} characters)"


def format_size(size: int) -> str:
    """PyTorch's C++ ``format_size`` (OOM messages, spec §15): two decimals, binary units."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1048576:
        return f"{size / 1024.0:.2f} KiB"
    if size <= 1073741824:
        return f"{size / 1048576.0:.2f} MiB"
    return f"{size / 1073741824.0:.2f} GiB"
