"""Allocation history: the trace ring buffer behind ``_record_memory_history`` (spec §18.1–18.2).

Context levels, as PyTorch: NEVER < STATE < ALLOC < ALL. Stacks are gathered for allocations
when the level is ≥ STATE (shown on snapshot blocks), kept in trace entries only at ≥ ALLOC, and
gathered at free time only at ALL. On a simulated GPU the stacks are the Python frames of the
caller (innermost first, frames inside vram itself left out).
"""
from __future__ import annotations

import os
import sys
import time
from collections import deque
from types import FrameType
from typing import Any

NEVER, STATE, ALLOC, ALL = 0, 1, 2, 3

#: The ``vram`` package's directory, from the package itself: this module may be the compiled
#: build, which lives elsewhere (`vram.allocator.native`).
PACKAGE_DIR = os.path.dirname(os.path.abspath(sys.modules[__name__.partition(".")[0]].__file__ or "")) + os.sep


#: Frames from files under these prefixes are left out of recorded stacks: vram itself, and
#: whatever a front end adds while it is active (e.g. torch's mode dispatch under `vram run`).
SKIP_PREFIXES: list[str] = [PACKAGE_DIR]


def gather_frames(limit: int = 64) -> list[dict[str, Any]]:
    """The caller's Python stack as snapshot frames ({name, filename, line}), innermost first."""
    frames: list[dict[str, Any]] = []
    skip = tuple(SKIP_PREFIXES)
    # From the innermost frame: this function's own is left out with the rest of vram, and the
    # compiled build (vram.allocator.native) has no frame of its own, so ``_getframe(1)`` would
    # drop the caller's.
    f: FrameType | None = sys._getframe(0)
    while f is not None and len(frames) < limit:
        code = f.f_code
        if not code.co_filename.startswith(skip):
            frames.append({"name": code.co_name, "filename": code.co_filename, "line": f.f_lineno})
        f = f.f_back
    return frames


class TraceEntry:
    """One event of the allocator's history (spec §18.2)."""

    __slots__ = ("action", "addr", "size", "stream", "time_us", "frames", "pool_id")

    def __init__(self, action: str, addr: int, size: int, stream: int,
                 frames: list[dict[str, Any]] | None, pool_id: tuple[int, int] | None = None) -> None:
        self.action = action
        self.pool_id = pool_id  # a private pool's id (``TraceEntry::mempool_``); None: the default pool
        self.addr = addr
        self.size = size
        self.stream = stream
        self.time_us = time.time_ns() // 1000
        self.frames = frames

    def as_dict(self) -> dict[str, Any]:
        """Plain dict as in a PyTorch snapshot: `device_free` instead of `addr` for ``oom``."""
        d: dict[str, Any] = {"action": self.action}
        d["device_free" if self.action == "oom" else "addr"] = self.addr
        d["size"] = self.size
        d["stream"] = self.stream
        d["time_us"] = self.time_us
        if self.frames is not None:
            d["frames"] = self.frames
        if self.pool_id is not None:  # written for private pools only: default-pool entries keep
            d["pool_id"] = self.pool_id  # the keys of the recordings in the spec (§18.2)
        return d


class History:
    """Recording state of one device's allocator: enabled?, context level, ring buffer."""

    __slots__ = ("enabled", "context", "stacks", "entries", "skip_actions")

    def __init__(self) -> None:
        self.enabled = False
        self.context = NEVER
        self.stacks = "python"
        self.entries: deque[TraceEntry] = deque(maxlen=1)
        self.skip_actions: frozenset[str] = frozenset()

    def configure(self, enabled: bool, context: int, max_entries: int, clear: bool,
                  skip_actions: frozenset[str] = frozenset(), stacks: str = "python") -> None:
        self.enabled = enabled
        self.context = context if enabled else NEVER
        self.stacks = stacks
        self.skip_actions = skip_actions
        max_entries = max(1, max_entries)
        if not enabled or clear:
            self.entries = deque(maxlen=max_entries)
        elif self.entries.maxlen != max_entries:
            self.entries = deque(self.entries, maxlen=max_entries)

    def gather(self, level: int) -> list[dict[str, Any]] | None:
        """Frames when the context level is ≥ `level`, else None."""
        return gather_frames() if self.context >= level else None

    def record(self, action: str, addr: int, size: int, stream: int,
               frames: list[dict[str, Any]] | None, pool_id: tuple[int, int] | None = None) -> None:
        if not self.enabled or action in self.skip_actions:
            return
        self.entries.append(TraceEntry(action, addr, size, stream,
                                       frames if self.context >= ALLOC else None, pool_id))
