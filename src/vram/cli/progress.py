"""A progress bar on stderr, shown only on a terminal and only for work that takes a moment."""
from __future__ import annotations

import sys
import time


class Progress:
    """A progress bar on stderr for replays that take more than a moment (only on a terminal)."""

    def __init__(self, label: str, unit: str = "events") -> None:
        self.label, self.unit = label, unit
        self.start = time.perf_counter()
        self.shown = False
        self.enabled = sys.stderr.isatty()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total == 0:
            return
        if not self.shown and time.perf_counter() - self.start < 0.5:
            return
        self.shown = True
        width = 30
        filled = width * done // total
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{' ' * (width - filled)}] "
                         f"{100 * done // total:3d}% {done:,}/{total:,} {self.unit}")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()
