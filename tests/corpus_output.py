"""What a corpus program printed (tests/corpus/): each line's first word is its key."""
from __future__ import annotations


def printed_values(out: str) -> dict[str, str]:
    """``{first word: the rest of the line}`` for each line of `out`; the first line of a key wins."""
    values: dict[str, str] = {}
    for line in out.splitlines():
        key, _, rest = line.partition(" ")
        values.setdefault(key, rest)
    return values
