"""The corpus programs (tests/corpus/): loading one as a module, and what one printed (each line's
first word is its key)."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

CORPUS = Path(__file__).resolve().parent / "corpus"


def load_program(name: str) -> Any:
    """The corpus program `name` (e.g. ``"fabric_lm.py"``) imported as a module, without running
    its ``__main__`` part: its model builders are then called on the CPU."""
    spec = importlib.util.spec_from_file_location(f"corpus_{name[:-3]}", CORPUS / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def printed_values(out: str) -> dict[str, str]:
    """``{first word: the rest of the line}`` for each line of `out`; the first line of a key wins."""
    values: dict[str, str] = {}
    for line in out.splitlines():
        key, _, rest = line.partition(" ")
        values.setdefault(key, rest)
    return values
