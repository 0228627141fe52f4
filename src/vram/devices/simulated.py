"""The simulated GPU: `SimulatedDevice` implements `vram.devices.base.Device` with a capacity,
a CUDA context, other processes' memory, an address model and an event policy.

Address model (spec §22): segment bases are 2 MiB aligned and handed out top-down from a large
virtual window, each new range placed at the top of the highest free hole that fits. Like the
driver in real recordings, addresses therefore mostly descend and consecutive segments are often
adjacent; freed ranges are reused. This matters: equal-size free blocks are tie-broken by lowest
address (spec §7). Expandable segments' reserved ranges go the other way, bottom-up, as the
driver placed them in a real recording (`RESERVE_ALIGNMENT`).

Event model (spec §10.3): a simulated GPU has no clock, so event completion is a policy.
``event_completion="immediate"`` (default): kernels finish instantly, every recorded event is
already complete when queried — a block freed after ``record_stream`` becomes reusable at the next
``malloc``. ``"on_sync"``: an event completes only when its stream (or the device) is
synchronised — by `synchronize`, by ``empty_cache()`` or by the allocator's retry step, which
synchronise all events. That models a side stream still running when the host moves on.
"""
from __future__ import annotations

import bisect
import os
from dataclasses import dataclass

from vram.units import GiB, MiB, parse_size

from .base import DriverError, Event
from .gpus import gpu_preset

SEGMENT_ALIGNMENT = 2 * MiB
#: The simulated virtual window of device 0. CUDA's unified address space lies in the process's
#: 47-bit user half (128 TiB on x86-64 Linux), and driver mappings sit near its top (0x7f…, as in
#: the recordings). The window leaves the lowest 16 TiB to the host program: about 111.5 TiB, so
#: an 80 GiB card can hold ~1,270 expandable-segment reservations (each 1 1/8 of the card, one per
#: stream and pool), and a 3 TiB one ~33, as cuMemAddressReserve allows before it fails.
VA_BOTTOM = 0x1000_0000_0000
VA_TOP = 0x7F80_0000_0000
#: cuMemAddressReserve's placement. On an H200 (driver 580, CUDA 13.0, torch 2.11:
#: ../shared/gpu-truth/h200-2026-11-27, expandable_pressure) a process's three expandable
#: segments were reserved at 0x302000000, 0x2a56000000 and 0x51a8000000: each above the one
#: before, at the first 32 MiB boundary after its end (0x2a54400000, 0x51a7c00000): as if each
#: range took its size rounded up to 32 MiB, next to the one before.
RESERVE_ALIGNMENT = 32 * MiB
#: Device index i's window is device 0's shifted up by i × 2**48, so no two devices' overlap
#: (on a real machine they share one 128 TiB space: a limit vram does not model across devices).
DEVICE_VA_STRIDE = 1 << 48


@dataclass(frozen=True)
class OtherProcess:
    """Memory another process holds on the same GPU (shown by nvidia-smi and in OOM messages)."""

    pid: int
    used: int


class VirtualAddressSpace:
    """Top-down first-fit allocator of 2 MiB-aligned virtual ranges (spec §22)."""

    __slots__ = ("_starts", "_ends", "_ranges", "bottom", "top")

    def __init__(self, bottom: int = VA_BOTTOM, top: int = VA_TOP) -> None:
        self.bottom = bottom
        self.top = top
        # Free holes as parallel sorted lists of starts and ends.
        self._starts = [bottom]
        self._ends = [top]
        self._ranges: dict[int, int] = {}  # base -> size of every range handed out

    def allocate(self, size: int) -> int | None:
        """The base of a new `size`-byte range (rounded up to 2 MiB), or None when no hole fits."""
        size = -(-size // SEGMENT_ALIGNMENT) * SEGMENT_ALIGNMENT
        starts, ends = self._starts, self._ends
        for i in range(len(starts) - 1, -1, -1):
            if ends[i] - starts[i] >= size:
                base = ends[i] - size
                if base == starts[i]:
                    del starts[i], ends[i]
                else:
                    ends[i] = base
                self._ranges[base] = size
                return base
        return None

    def allocate_bottom_up(self, size: int, alignment: int) -> int | None:
        """The base of a new `size`-byte range (rounded up to `alignment`, a multiple of 2 MiB)
        at the lowest aligned address of the lowest hole that fits, or None."""
        size = -(-size // alignment) * alignment
        starts, ends = self._starts, self._ends
        for i in range(len(starts)):
            base = -(-starts[i] // alignment) * alignment
            if base + size <= ends[i]:
                self.take(base, size)
                return base
        return None

    def take(self, base: int, size: int) -> None:
        """Mark [base, base+size) as used (a range handed out elsewhere); outside holes is fine."""
        starts, ends = self._starts, self._ends
        end = base + size
        i = bisect.bisect_right(starts, base) - 1
        if i >= 0 and ends[i] > base:
            if ends[i] < end:
                raise ValueError(f"range {base:#x}+{size} overlaps a range in use")
            left, right = (starts[i], base), (end, ends[i])
            del starts[i], ends[i]
            for lo, hi in (right, left):
                if hi > lo:
                    starts.insert(i, lo)
                    ends.insert(i, hi)
        elif i + 1 < len(starts) and starts[i + 1] < end:
            raise ValueError(f"range {base:#x}+{size} overlaps a range in use")
        self._ranges[base] = size

    def free(self, base: int) -> int:
        size = self._ranges.pop(base)
        end = base + size
        if base < self.bottom or end > self.top:
            return size  # an adopted range outside the window: nothing to give back
        starts, ends = self._starts, self._ends
        i = bisect.bisect_left(starts, base)
        # Coalesce with the hole before and/or after.
        if i > 0 and ends[i - 1] == base:
            if i < len(starts) and starts[i] == end:
                ends[i - 1] = ends[i]
                del starts[i], ends[i]
            else:
                ends[i - 1] = end
        elif i < len(starts) and starts[i] == end:
            starts[i] = base
        else:
            starts.insert(i, base)
            ends.insert(i, end)
        return size

    def size_of(self, base: int) -> int | None:
        return self._ranges.get(base)


class ReservedRanges(dict[int, int]):
    """Reserved virtual ranges, base -> size, with the bases also kept in order: the range holding
    an address is a binary search, not a walk over every range (with expandable segments, each
    request larger than any range left reserves one, so a run of OOMs reserves thousands)."""

    __slots__ = ("_bases",)

    def __init__(self) -> None:
        super().__init__()
        self._bases: list[int] = []

    def __setitem__(self, base: int, size: int) -> None:
        if base not in self:
            bisect.insort(self._bases, base)
        super().__setitem__(base, size)

    def __delitem__(self, base: int) -> None:
        super().__delitem__(base)
        del self._bases[bisect.bisect_left(self._bases, base)]

    def holding(self, ptr: int, size: int = 1) -> int | None:
        """The highest base at or below `ptr` whose range holds [ptr, ptr+size) (ranges never
        overlap, so the first one down that does is the only one; the walk down is for safety)."""
        bases = self._bases
        for i in range(bisect.bisect_right(bases, ptr) - 1, -1, -1):
            base = bases[i]
            if ptr + size <= base + self[base]:
                return base
        return None

    def first_inside(self, lo: int, hi: int) -> int | None:
        """The lowest base strictly between `lo` and `hi`, or None."""
        bases = self._bases
        i = bisect.bisect_right(bases, lo)
        return bases[i] if i < len(bases) and bases[i] < hi else None


class SimulatedDevice:
    """A GPU that exists only as numbers: capacity, CUDA context, other processes' memory.

    ``cudaMalloc`` (and mapping pages of expandable segments) fails when this process's driver
    allocations plus the context plus other processes' memory would exceed `total_memory`.
    `mem_get_info` reports ``free = total − context − other processes − this process's driver
    allocations`` (spec §19, §22). Sizes may be ints or strings such as ``"6GiB"``; `total_memory`
    may also name a card (``"A100-80GB"``: CUDA's total for it and its name, see `vram.devices.gpus`).

    ``nvml=True`` adds the per-process lines NVML gives real OOM messages ("Including non-PyTorch
    memory, this process has … memory in use." / "Process <pid> has …"); the default, like a
    machine without NVML (and like spec §20 Example 7), leaves them out.
    """

    def __init__(
        self,
        total_memory: int | str = 80 * GiB,
        context: int | str = 0,
        index: int = 0,
        *,
        other_processes: int | str | list[tuple[int, int | str]] = 0,
        name: str = "Simulated GPU",
        event_completion: str = "immediate",
        nvml: bool = False,
        pid: int | None = None,
    ) -> None:
        preset = gpu_preset(total_memory)
        total = preset.total_memory if preset is not None else parse_size(total_memory, "total_memory")
        if preset is not None and name == "Simulated GPU":
            name = preset.name
        ctx = parse_size(context, "context")
        if total <= 0:
            raise ValueError(f"total_memory must be positive, got {total}")
        if isinstance(other_processes, (int, str)):
            used = parse_size(other_processes, "other_processes")
            others = [OtherProcess(0, used)] if used else []
        else:
            others = [OtherProcess(int(p), parse_size(u, "other process memory")) for p, u in other_processes]
        if ctx + sum(o.used for o in others) > total:
            raise ValueError(f"context and other processes' memory exceed total_memory: {ctx:,} B of CUDA context + "
                             f"{sum(o.used for o in others):,} B > {total:,} B (a context of 0 leaves it out)")
        if event_completion not in ("immediate", "on_sync"):
            raise ValueError(f"event_completion must be 'immediate' or 'on_sync', got {event_completion!r}")
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ValueError(f"device index must be a non-negative int, got {index!r}")
        self.index = index
        self.total_memory = total
        self.context = ctx
        self.other_processes = others
        self.name = name
        self.event_completion = event_completion
        self.nvml = nvml
        self.pid = os.getpid() if pid is None else pid
        #: bytes this process holds from the driver (cudaMalloc'd plus mapped pages, the caching
        #: allocator's and `outside`)
        self.used = 0
        #: of `used`, what other libraries took directly from the driver (NCCL's buffers)
        self.outside = 0
        offset = index * DEVICE_VA_STRIDE
        self._va = VirtualAddressSpace(VA_BOTTOM + offset, VA_TOP + offset)
        self._allocations: dict[int, int] = {}  # cudaMalloc base -> size
        self._reservations = ReservedRanges()  # reserved base -> size
        self._mapped: dict[int, int] = {}  # reserved base -> bytes mapped in it
        self._pending: dict[int, list[Event]] = {}  # stream -> incomplete events (on_sync model)

    def __repr__(self) -> str:
        return (f"SimulatedDevice(total_memory={self.total_memory}, context={self.context}, "
                f"index={self.index})")

    # -- physical memory ---------------------------------------------------------------------
    @property
    def other_used(self) -> int:
        return sum(o.used for o in self.other_processes)

    def _fits(self, size: int) -> bool:
        return self.used + self.context + self.other_used + size <= self.total_memory

    def malloc(self, size: int) -> int | None:
        if size <= 0 or not self._fits(size):
            return None
        ptr = self._va.allocate(size)
        if ptr is None:  # no address range left: cudaMalloc fails as when out of memory
            return None
        self._allocations[ptr] = size
        self.used += size
        return ptr

    def adopt(self, ptr: int, size: int) -> bool:
        """Take over a segment that already exists at `ptr` (a recorded run's starting state).

        False when it does not fit in the capacity left. The range is taken out of the virtual
        address space when it lies in it, so no later segment can overlap it.
        """
        if size <= 0 or not self._fits(size) or ptr in self._allocations:
            return False
        self._va.take(ptr, size)
        self._allocations[ptr] = size
        self.used += size
        return True

    def free(self, ptr: int) -> None:
        size = self._allocations.pop(ptr, None)
        if size is None:
            raise ValueError(f"cudaFree of an address the device never allocated: {ptr:#x}")
        self._va.free(ptr)
        self.used -= size

    def take_outside(self, size: int) -> bool:
        """Physical memory another library of this process takes from the driver itself, never
        through the caching allocator (NCCL's ``cuMemCreate``'d buffers): it counts toward this
        process's use like a segment (``cudaMemGetInfo``, NVML) and can make a later ``cudaMalloc``
        fail. False, nothing taken, when it does not fit. No address is modelled: the caching
        allocator's segments keep theirs."""
        if size < 0 or not self._fits(size):
            return False
        self.used += size
        self.outside += size
        return True

    def give_outside(self, size: int) -> None:
        """Give back `size` bytes taken by `take_outside` (the library freed them)."""
        if not 0 <= size <= self.outside:
            raise ValueError(f"giving back {size} bytes outside the allocator, {self.outside} were taken")
        self.used -= size
        self.outside -= size

    def reserve(self, size: int) -> int:
        """cuMemAddressReserve; raises `DriverError` ("CUDA driver error: out of memory") when no
        range of `size` bytes is left, as ``C10_CUDA_DRIVER_CHECK`` does in PyTorch. Ranges go
        bottom-up, each at the next `RESERVE_ALIGNMENT` boundary, as the driver placed them in a
        real recording (see `RESERVE_ALIGNMENT`): a range reserved later lies above the earlier
        ones, so the allocator's address-ordered search (``find_expandable_block``) tries it last."""
        ptr = self._va.allocate_bottom_up(size, RESERVE_ALIGNMENT)
        if ptr is None:
            raise DriverError("CUDA driver error: out of memory")
        self._reservations[ptr] = self._va.size_of(ptr) or size
        self._mapped[ptr] = 0
        return ptr

    def _reservation_of(self, ptr: int, size: int) -> int:
        base = self._reservations.holding(ptr, size)
        if base is not None:
            return base
        raise ValueError(f"range {ptr:#x}+{size} is not inside a reserved range")

    def release(self, ptr: int) -> None:
        if self._mapped.get(ptr):
            raise ValueError(f"releasing reserved range {ptr:#x} that still has mapped pages")
        del self._reservations[ptr]
        del self._mapped[ptr]
        self._va.free(ptr)

    def map(self, ptr: int, size: int) -> bool:
        base = self._reservation_of(ptr, size)
        if not self._fits(size):
            return False
        self._mapped[base] += size
        self.used += size
        return True

    def unmap(self, ptr: int, size: int) -> None:
        base = self._reservation_of(ptr, size)
        self._mapped[base] -= size
        self.used -= size

    def mem_get_info(self) -> tuple[int, int]:
        free = self.total_memory - self.context - self.other_used - self.used
        return max(free, 0), self.total_memory

    def process_memory(self) -> list[tuple[int, int]]:
        """(pid, bytes) per process on the GPU, this one first: what NVML would list."""
        return [(self.pid, self.used + self.context)] + [(o.pid, o.used) for o in self.other_processes]

    # -- streams and events ------------------------------------------------------------------
    def record_event(self, stream: int) -> Event:
        if self.event_completion == "immediate":
            return Event(stream, True)
        event = Event(stream, False)
        self._pending.setdefault(stream, []).append(event)
        return event

    def query_event(self, event: Event) -> bool:
        return event.completed

    def synchronize_event(self, event: Event) -> None:
        event.completed = True

    def synchronize(self, stream: int | None = None) -> None:
        """Wait for `stream` (every stream if None): completes its recorded events."""
        streams = list(self._pending) if stream is None else [stream]
        for s in streams:
            for event in self._pending.pop(s, ()):
                event.completed = True
