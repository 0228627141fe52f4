"""A default run that meets a data-dependent shape it cannot know goes on with real values.

A default run keeps values only of small tensors built without the model's arithmetic
(`vram.run.values.known`); an op whose output *shape* depends on values it does not have
(``edge_index[:, mask]`` over a large graph, ``nonzero`` of activations) cannot be answered with
a placeholder: the shapes that follow would be invented. Such a run is not stopped: ``vram run``
runs the script again from the start with ``--values real`` (every value computed on the CPU),
says so once on stderr, and does not print the script's output twice: what the first attempt
printed is recorded (`record`), and the second attempt's output is held back while it repeats
it (`skip_printed`); from the first difference on, everything is printed. A rank of a launched
run is not run again alone (the other ranks already took its messages): it stops as before.
"""
from __future__ import annotations

import os
import sys
from typing import IO, Any

__all__ = ["PRINTED_ENV", "ValuesNeeded", "forget", "record", "skip_printed"]

#: the file holding what the first attempt printed (set for the second attempt)
PRINTED_ENV = "VRAM_RUN_PRINTED"


class ValuesNeeded(RuntimeError):
    """A default run met a data-dependent shape: run the script again with real values."""


class _Stream:
    """A text stream that passes every other attribute to the stream it wraps."""

    def __init__(self, inner: IO[str]) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)


class _Tee(_Stream):
    def __init__(self, inner: IO[str], copy: IO[str]) -> None:
        super().__init__(inner)
        self._copy = copy

    def write(self, s: str) -> int:
        self._copy.write(s)
        self._copy.flush()
        return self._inner.write(s)


class _Skip(_Stream):
    def __init__(self, inner: IO[str], printed: str) -> None:
        super().__init__(inner)
        self._left = printed

    def write(self, s: str) -> int:
        if self._left:
            n = min(len(s), len(self._left))
            if s[:n] == self._left[:n]:
                self._left = self._left[n:]
                s = s[n:]
            else:   # the output differs from here on: print all of it
                self._left = ""
        return self._inner.write(s) if s else 0


def record(path: str) -> None:
    """Copy what the script prints on stdout to `path` as well."""
    sys.stdout = _Tee(sys.stdout, open(path, "w", encoding="utf-8"))  # type: ignore[assignment]


def forget(path: str | None) -> None:
    """The run ended without a second attempt: stop recording and remove `path`."""
    if isinstance(sys.stdout, _Tee):
        sys.stdout._copy.close()
        sys.stdout = sys.stdout._inner  # type: ignore[assignment]
    if path:
        try:
            os.remove(path)
        except OSError:
            pass


def skip_printed(path: str) -> None:
    """Hold back stdout while it repeats what `path` holds (the first attempt's output)."""
    try:
        with open(path, encoding="utf-8") as f:
            printed = f.read()
        os.remove(path)
    except OSError:
        return
    sys.stdout = _Skip(sys.stdout, printed)  # type: ignore[assignment]
