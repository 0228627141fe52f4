"""Progress on stderr for work that takes a moment: a bar on a terminal; elsewhere (a log file, a
CI job, a notebook's captured stderr) a plain line now and then, so long work is never silent."""
from __future__ import annotations

import sys
import time

#: off a terminal: the first line after this many seconds, then one at most every `LINE_EVERY`
FIRST_LINE = 5.0
LINE_EVERY = 10.0


class Progress:
    """Progress of `total` units of work (replays, runs) on stderr (see the module doc)."""

    def __init__(self, label: str, unit: str = "events") -> None:
        self.label, self.unit = label, unit
        self.start = time.perf_counter()
        self.shown = False
        self.terminal = sys.stderr.isatty()
        self.last_line = 0.0

    def __call__(self, done: int, total: int) -> None:
        if total == 0:
            return
        elapsed = time.perf_counter() - self.start
        if not self.terminal:
            self._line(done, total, elapsed)
            return
        if not self.shown and elapsed < 0.5:
            return
        self.shown = True
        width = 30
        filled = width * done // total
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{' ' * (width - filled)}] "
                         f"{100 * done // total:3d}% {done:,}/{total:,} {self.unit}")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    def _line(self, done: int, total: int, elapsed: float) -> None:
        """A plain line: the first after `FIRST_LINE` s, then every `LINE_EVERY` s, and the last."""
        due = elapsed >= FIRST_LINE if not self.shown else elapsed - self.last_line >= LINE_EVERY
        if not (due or (self.shown and done >= total)):
            return
        self.shown, self.last_line = True, elapsed
        sys.stderr.write(f"{self.label}: {100 * done // total}% ({done:,}/{total:,} {self.unit}, "
                         f"{elapsed:.0f} s)\n")
        sys.stderr.flush()
