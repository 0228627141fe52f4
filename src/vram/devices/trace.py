"""Layer 1: a device that hands out the segment addresses a recorded run got (spec §23).

`TraceDevice` is a `SimulatedDevice` (capacity, context, other processes as usual) whose
``cudaMalloc`` returns the address of the next recorded ``segment_alloc`` when that event asks
for the same size. So a replay under the recorded config makes the same lowest-address
tie-breaks as the real run and reproduces it exactly; when the replay asks for a different
segment (another config, a smaller GPU), it gets a synthetic address far from every recorded one
and the mismatch is logged as a divergence.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .simulated import SimulatedDevice, VirtualAddressSpace

#: synthetic addresses live far below the 0x7f… range real drivers hand out
SYNTHETIC_BOTTOM = 0x4000_0000_0000
SYNTHETIC_TOP = 0x6000_0000_0000


class TraceDevice(SimulatedDevice):
    """A simulated GPU that replays recorded ``cudaMalloc`` addresses (see module docstring)."""

    def __init__(self, recorded: Sequence[tuple[int, int]], total_memory: int | str = 1 << 40,
                 context: int | str = 0, index: int = 0, **kwargs: Any) -> None:
        super().__init__(total_memory, context, index, event_completion="on_sync", **kwargs)
        self._va = VirtualAddressSpace(SYNTHETIC_BOTTOM, SYNTHETIC_TOP)
        self.recorded = list(recorded)  # (address, size) of each recorded segment_alloc, in order
        self.cursor = 0
        #: every successful cudaMalloc: (address, size, recorded index or None)
        self.mallocs: list[tuple[int, int, int | None]] = []
        self.frees: list[tuple[int, int]] = []
        #: (our malloc number, size asked, recorded size or None) for each mismatch
        self.divergences: list[tuple[int, int, int | None]] = []
        self.fail_mallocs = False  # set while replaying a recorded OOM in verification mode

    def malloc(self, size: int) -> int | None:
        if self.fail_mallocs or size <= 0 or not self._fits(size):
            return None
        rec = self.recorded[self.cursor] if self.cursor < len(self.recorded) else None
        if rec is not None and rec[1] == size and rec[0] not in self._allocations:
            addr = rec[0]
            index: int | None = self.cursor
            self.cursor += 1
            self._va.take(addr, size)
        else:
            synthetic = self._va.allocate(size)
            if synthetic is None:
                return None
            self.divergences.append((len(self.mallocs), size, rec[1] if rec else None))
            addr = synthetic
            index = None
        self._allocations[addr] = size
        self.used += size
        self.mallocs.append((addr, size, index))
        return addr

    def free(self, ptr: int) -> None:
        size = self._allocations.get(ptr, 0)
        super().free(ptr)
        self.frees.append((ptr, size))

    def complete_events(self, stream: int) -> None:
        """Complete the events recorded on `stream` (the recording says the free completed)."""
        self.synchronize(stream)
