"""Errors and bounded, printable descriptions of untrusted values.

Everything a snapshot file contains may be hostile: a value's ``repr`` can be gigabytes (a list
of shared references), raise (a tuple nested past the recursion limit, an int past
``sys.get_int_max_str_digits``) or carry terminal escape sequences. `brief` describes any value
in bounded time and space without ``repr``; `printable` escapes control characters (C0, DEL, C1,
bidi overrides, line and paragraph separators, lone surrogates) in text taken from a file, so
that printing it cannot move the cursor, set the title, clear the screen or fake a line.
"""
from __future__ import annotations

import re
from typing import Any

__all__ = ["Invalid", "SnapshotError", "brief", "int_text", "one_line", "printable"]

#: characters that must not reach a terminal raw: C0 controls, DEL, C1 controls (ESC/CSI/OSC),
#: bidi embeddings/overrides/isolates, line/paragraph separators, lone surrogates
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069"
                      "\ud800-\udfff]")
_TEXT_LIMIT = 200


class SnapshotError(ValueError):
    """A snapshot file that cannot be read: one line, ``"<file>: <what is wrong>"``."""


class Invalid(Exception):
    """Internal: a problem found while decoding or walking; `load_snapshot` adds the file name."""


def _escape(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def printable(text: str, limit: int | None = None) -> str:
    """`text` with control characters escaped (``\\x1b``, ``\\u202e``), cut to `limit` chars."""
    if limit is not None and len(text) > limit:
        text = text[:limit] + "..."
    return _CONTROL.sub(_escape, text)


def int_text(value: int) -> str:
    """An int in decimal, or its size in bits when decimal would be long (or refused)."""
    if -(10**30) < value < 10**30:
        return str(value)
    return f"{'a negative' if value < 0 else 'an'} int of {abs(value).bit_length():,} bits"


def brief(value: Any, limit: int = 40) -> str:
    """A short description of an untrusted value, in O(limit) time: never a full ``repr``."""
    kind = type(value)
    if kind is str:
        return f"'{printable(value, limit)}'"
    if kind is bool or value is None:
        return str(value)
    if kind is int:
        return int_text(value)
    if kind is float:
        return repr(value)
    if kind in (bytes, bytearray):
        return f"{kind.__name__} of length {len(value):,}"
    if kind in (list, tuple, dict, set, frozenset):
        return f"a {kind.__name__} of {len(value):,} item{'' if len(value) == 1 else 's'}"
    return f"a {printable(kind.__name__, limit)}"


def one_line(exc: BaseException, limit: int = _TEXT_LIMIT) -> str:
    """An exception's text on one printable line of at most `limit` characters."""
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - e.g. a message holding an int too long to print
        text = ""
    text = " ".join(text[:4 * limit].split()) or type(exc).__name__
    return printable(text if len(text) <= limit else text[:limit - 3] + "...")
