"""Layer 1: a device that hands out the segment addresses a recorded run got (spec §23).

`TraceDevice` is a `SimulatedDevice` (capacity, context, other processes as usual) whose
``cudaMalloc`` returns the address of the next recorded ``segment_alloc`` when that event asks
for the same size. So a replay under the recorded config makes the same lowest-address
tie-breaks as the real run and reproduces it exactly; when the replay asks for a different
segment (another config, a smaller GPU), it gets a synthetic address far from every recorded one
and the mismatch is logged as a divergence.

Expandable segments (spec §14) reserve a virtual range and map pages into it. A new range gets
the address of the next recorded ``segment_map`` (a fresh segment's first map is at its base:
``find_expandable_block`` then ``map_block`` in CUDACachingAllocator.cpp); every map and unmap is
kept for verification.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .base import DriverError
from .simulated import SimulatedDevice, VirtualAddressSpace

#: synthetic addresses live far below the 0x7f… range real drivers hand out
SYNTHETIC_BOTTOM = 0x4000_0000_0000
SYNTHETIC_TOP = 0x6000_0000_0000
#: where synthetic reservations go once that window is full, on a GPU of unlimited size: each
#: expandable segment reserves 1 1/8 of the card (spec §14), and the stand-in size of an
#: unlimited card is arbitrary, so its address space is unlimited too (far above any recorded
#: address, which the loader keeps below 2**64 but real drivers below 2**48)
UNBOUNDED_BOTTOM = 1 << 60
UNBOUNDED_TOP = 1 << 63


class TraceDevice(SimulatedDevice):
    """A simulated GPU that replays recorded ``cudaMalloc`` addresses (see module docstring)."""

    def __init__(self, recorded: Sequence[tuple[int, int]], total_memory: int | str = 1 << 40,
                 context: int | str = 0, index: int = 0, *,
                 recorded_maps: Sequence[tuple[int, int]] = (), **kwargs: Any) -> None:
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
        self.recorded_maps = list(recorded_maps)  # (address, size) of each recorded segment_map
        self.map_cursor = 0
        #: every successful map / unmap of expandable-segment pages: (address, size)
        self.maps: list[tuple[int, int]] = []
        self.unmaps: list[tuple[int, int]] = []
        #: the GPU's size is a stand-in for "unlimited": reservations never run out of addresses
        self.unbounded_address_space = False
        self._beyond = VirtualAddressSpace(UNBOUNDED_BOTTOM, UNBOUNDED_TOP)

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

    # -- expandable segments ----------------------------------------------------------------
    def reserve(self, size: int) -> int:
        """cuMemAddressReserve: the base of the recorded segment whose first ``segment_map`` comes
        next (outside every range reserved now), else a synthetic range."""
        rec = self.recorded_maps[self.map_cursor] if self.map_cursor < len(self.recorded_maps) else None
        if rec is not None and self._reservation_at(rec[0]) is None and rec[0] not in self._allocations:
            self._va.take(rec[0], size)  # recorded ranges lie above the synthetic window
            self._reservations[rec[0]] = size
            self._mapped[rec[0]] = 0
            return rec[0]
        try:
            return super().reserve(size)
        except DriverError:
            ptr = self._beyond.allocate(size) if self.unbounded_address_space else None
            if ptr is None:
                raise
            self._reservations[ptr] = self._beyond.size_of(ptr) or size
            self._mapped[ptr] = 0
            return ptr

    def release(self, ptr: int) -> None:
        if self._beyond.size_of(ptr) is None:
            super().release(ptr)
            return
        if self._mapped.get(ptr):
            raise ValueError(f"releasing reserved range {ptr:#x} that still has mapped pages")
        del self._reservations[ptr], self._mapped[ptr]
        self._beyond.free(ptr)

    def adopt_reservation(self, base: int, size: int, mapped: int) -> bool:
        """Take over a recorded expandable segment's range with `mapped` bytes already mapped
        (a recording's starting state); False when they do not fit or the range is in use."""
        if mapped < 0 or not self._fits(mapped) or base in self._reservations or base in self._allocations:
            return False
        self._va.take(base, size)
        self._reservations[base] = size
        self._mapped[base] = mapped
        self.used += mapped
        return True

    def _reservation_at(self, ptr: int) -> int | None:
        """The reserved range holding `ptr`: the highest base at or below it (recorded ranges
        from a smaller real GPU may be closer together than this device's reserve size)."""
        best = None
        for base, rsize in self._reservations.items():
            if base <= ptr < base + rsize and (best is None or base > best):
                best = base
        return best

    def _reservation_of(self, ptr: int, size: int) -> int:
        base = self._reservation_at(ptr)
        if base is None:
            raise ValueError(f"range {ptr:#x}+{size} is not inside a reserved range")
        return base

    def map(self, ptr: int, size: int) -> bool:
        if self.fail_mallocs or not super().map(ptr, size):
            return False
        rec = self.recorded_maps[self.map_cursor] if self.map_cursor < len(self.recorded_maps) else None
        if rec == (ptr, size):
            self.map_cursor += 1
        self.maps.append((ptr, size))
        return True

    def unmap(self, ptr: int, size: int) -> None:
        super().unmap(ptr, size)
        self.unmaps.append((ptr, size))
