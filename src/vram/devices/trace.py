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
kept for verification. A range the recording never maps (one reserved by a request that failed)
goes above every recorded address, where the driver puts a later range.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .base import DriverError
from .simulated import RESERVE_ALIGNMENT, SimulatedDevice, VirtualAddressSpace

#: synthetic addresses live far below the 0x7f… range real drivers hand out
SYNTHETIC_BOTTOM = 0x4000_0000_0000
SYNTHETIC_TOP = 0x6000_0000_0000
#: where synthetic reservations go once that window is full, on a GPU of unlimited size: each
#: expandable segment reserves 1 1/8 of the card (spec §14), and the stand-in size of an
#: unlimited card is arbitrary, so its address space is unlimited too (far above any recorded
#: address, which the loader keeps below 2**64 but real drivers below 2**48)
UNBOUNDED_BOTTOM = 1 << 60
UNBOUNDED_TOP = 1 << 63
_WINDOW = SYNTHETIC_TOP - SYNTHETIC_BOTTOM
#: the smallest page any expandable segment maps (the small pool's, kSmallBuffer)
_PAGE = 2 << 20


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
        self._live_pages: set[int] = set()  # 2 MiB pages mapped now (address // 2 MiB)
        #: maps refused because a segment outgrew a range cut at a later recorded base
        self.cut_maps = 0
        #: the GPU's size is a stand-in for "unlimited": reservations never run out of addresses
        self.unbounded_address_space = False
        #: the recording's GPU memory as far as the recording shows it (None: `total_memory`):
        #: it sizes expandable segments' ranges when `total_memory` is a stand-in, so a request
        #: larger than the real card's range reserves a new one there too
        self.recorded_total_memory: int | None = None
        self._beyond = VirtualAddressSpace(UNBOUNDED_BOTTOM, UNBOUNDED_TOP)
        self._reserve_va: VirtualAddressSpace | None = None  # made at the first synthetic range

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
        next, else a synthetic range.

        A range is ``segment_size × numSegments(total + total / 8)`` (``ExpandableSegment`` in
        CUDACachingAllocator.cpp), so on the recording's GPU no range reached the next recorded
        base. This device may be larger than that GPU (its size is not in the recording), so
        recorded ranges may overlap here: each is cut where the next one begins (`_cut_around`),
        as long as no page mapped now lies in the new range."""
        rec = self.recorded_maps[self.map_cursor] if self.map_cursor < len(self.recorded_maps) else None
        if rec is None or rec[0] in self._reservations or rec[0] in self._allocations or (
                self.fail_mallocs and self._reservation_at(rec[0]) is not None):
            # (a range reserved by a request that failed, while the next recorded map grows a
            # range that exists: the driver put the new one above it, where it stayed unmapped)
            return self._synthetic_reserve(size)
        base = rec[0]
        try:
            self._va.take(base, size)
        except ValueError:  # a recorded base inside this device's synthetic window
            return self._synthetic_reserve(size)
        if not self._cut_around(base, size):
            self._va.free(base)
            return self._synthetic_reserve(size)
        self._mapped[base] = 0
        return base

    def _synthetic_reserve(self, size: int) -> int:
        """A range the recording does not place: above every address known when the first such
        range is asked for (the driver places each reserved range above the ones before:
        `vram.devices.simulated.RESERVE_ALIGNMENT`), in a window as large as the synthetic one;
        past its end, on a GPU of unlimited size, one in the unbounded window above it."""
        if self._reserve_va is None:
            known = [*self.recorded, *self.recorded_maps, *self._reservations.items(), *self._allocations.items()]
            high = max([SYNTHETIC_BOTTOM] + [a + n for a, n in known])
            bottom = min(-(-high // RESERVE_ALIGNMENT) * RESERVE_ALIGNMENT, UNBOUNDED_BOTTOM - _WINDOW)
            self._reserve_va = VirtualAddressSpace(bottom, bottom + _WINDOW)
        ptr = self._reserve_va.allocate_bottom_up(size, RESERVE_ALIGNMENT)
        space = self._reserve_va
        if ptr is None and self.unbounded_address_space:
            ptr, space = self._beyond.allocate(size), self._beyond
        if ptr is None:
            raise DriverError("CUDA driver error: out of memory")
        self._reservations[ptr] = space.size_of(ptr) or size
        self._mapped[ptr] = 0
        return ptr

    def release(self, ptr: int) -> None:
        space = next((v for v in (self._reserve_va, self._beyond) if v is not None and v.size_of(ptr)), None)
        if space is None:
            super().release(ptr)
            return
        if self._mapped.get(ptr):
            raise ValueError(f"releasing reserved range {ptr:#x} that still has mapped pages")
        del self._reservations[ptr], self._mapped[ptr]
        space.free(ptr)

    def _cut_around(self, base: int, size: int) -> bool:
        """Make room for a recorded range at `base`: the range below it ends there, and this one
        ends at the next reserved base above; False when a page mapped now lies in the room."""
        above = self._reservations.first_inside(base, base + size)
        end = base + size if above is None else above
        lo, hi = base // _PAGE, -(-end // _PAGE)
        if any(lo <= p < hi for p in self._live_pages):
            return False
        around = self._reservation_at(base)
        if around is not None:
            self._reservations[around] = base - around
        self._reservations[base] = end - base
        return True

    def adopt_reservation(self, base: int, size: int, mapped: int,
                          runs: Sequence[tuple[int, int]] = ()) -> bool:
        """Take over a recorded expandable segment's range with `mapped` bytes already mapped
        (a recording's starting state), the mapped `runs` given as (address, size); False when
        they do not fit or the range is in use. Overlapping recorded ranges are cut as in
        `reserve`."""
        if mapped < 0 or not self._fits(mapped) or base in self._reservations or base in self._allocations:
            return False
        self._va.take(base, size)
        if not self._cut_around(base, size):
            self._va.free(base)
            return False
        self._mapped[base] = mapped
        self.used += mapped
        for ptr, length in runs:
            self._live_pages.update(range(ptr // _PAGE, -(-(ptr + length) // _PAGE)))
        return True

    def _reservation_at(self, ptr: int) -> int | None:
        """The reserved range holding `ptr`: the highest base at or below it (recorded ranges
        from a smaller real GPU may be closer together than this device's reserve size)."""
        return self._reservations.holding(ptr)

    def _reservation_of(self, ptr: int, size: int) -> int:
        base = self._reservation_at(ptr)
        if base is None:
            raise ValueError(f"range {ptr:#x}+{size} is not inside a reserved range")
        return base

    def map(self, ptr: int, size: int) -> bool:
        """cuMemMap; fails (as out of memory) where a range cut at a later recorded base would
        have to grow past it: the recording's GPU could not have held such a segment."""
        base = self._reservation_at(ptr)
        if base is not None and ptr + size > base + self._reservations[base]:
            self.cut_maps += 1
            return False
        if self.fail_mallocs or not super().map(ptr, size):
            return False
        self._live_pages.update(range(ptr // _PAGE, -(-(ptr + size) // _PAGE)))
        rec = self.recorded_maps[self.map_cursor] if self.map_cursor < len(self.recorded_maps) else None
        if rec == (ptr, size):
            self.map_cursor += 1
        self.maps.append((ptr, size))
        return True

    def unmap(self, ptr: int, size: int) -> None:
        super().unmap(ptr, size)
        self._live_pages.difference_update(range(ptr // _PAGE, -(-(ptr + size) // _PAGE)))
        self.unmaps.append((ptr, size))
