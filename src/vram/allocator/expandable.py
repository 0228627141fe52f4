"""Expandable segments (spec §14): one reserved virtual range per (stream, pool), backed with
physical pages on demand — 2 MiB pages in the small pool, ``large_segment_size`` (20 MiB) in the
large pool.

Accounting differs from ordinary segments: mapping or unmapping moves ``reserved_bytes`` and
``num_device_alloc``/``num_device_free`` but never the ``segment``, ``oversize_segments`` or
``inactive_split`` statistics.
"""
from __future__ import annotations

from typing import Any

from vram.devices.base import Device

from .block import STREAM_SHIFT, Block, BlockPool, try_merge_blocks
from .config import AllocatorConfig
from .history import History
from .native import mypyc_attr, trait
from .stats import DeviceStats

K_SMALL_BUFFER = 2097152


class ExpandableSegment:
    """A reserved virtual range of ``pages × page_size`` bytes, mapped page by page: room for
    1 1/8 of the GPU's memory (``ExpandableSegment``'s constructor in CUDACachingAllocator.cpp)."""

    __slots__ = ("device", "stream", "ptr", "page_size", "pages", "mapped_pages")

    def __init__(self, device: Any, stream: int, page_size: int) -> None:
        self.pages = range_size(device, page_size) // page_size
        self.page_size = page_size
        self.device = device
        self.stream = stream
        self.ptr = device.reserve(self.pages * page_size)
        self.mapped_pages = 0

    @property
    def size(self) -> int:
        return self.pages * self.page_size

    def map(self, ptr: int, size: int) -> tuple[int, int]:
        """Map every page touching [ptr, ptr+size); (ptr, 0) when the device is out of memory."""
        page = self.page_size
        begin = (ptr - self.ptr) // page
        end = -(-(ptr + size - self.ptr) // page)
        if end <= begin:
            return ptr, 0
        start, length = self.ptr + begin * page, (end - begin) * page
        if not self.device.map(start, length):
            return ptr, 0
        self.mapped_pages += end - begin
        return start, length

    def unmap_range(self, ptr: int, size: int) -> tuple[int, int]:
        """The whole pages inside [ptr, ptr+size), as (start, length); (ptr, 0) if there are none."""
        page = self.page_size
        begin = -(-(ptr - self.ptr) // page)
        end = (ptr + size - self.ptr) // page
        if end <= begin:
            return ptr, 0
        return self.ptr + begin * page, (end - begin) * page

    def unmap(self, ptr: int, size: int) -> tuple[int, int]:
        """Unmap the pages lying entirely inside [ptr, ptr+size); (ptr, 0) if there are none."""
        start, length = self.unmap_range(ptr, size)
        if length == 0:
            return ptr, 0
        self.device.unmap(start, length)
        self.mapped_pages -= length // self.page_size
        return start, length


def range_size(device: Any, page_size: int) -> int:
    """The bytes an expandable segment reserves: 1 1/8 of ``totalGlobalMem`` in whole pages. A
    replay whose GPU is a stand-in sizes it by the recording's own card as far as the recording
    shows it (`vram.devices.trace.TraceDevice.recorded_total_memory`)."""
    total = getattr(device, "recorded_total_memory", None) or device.total_memory
    return -(-(total + total // 8) // page_size) * page_size


def unmapped_next_size(block: Block) -> int:
    """Size of the unmapped block right after `block` (0 if none): how far it could grow."""
    nxt = block.next
    return nxt.size if nxt is not None and not nxt.mapped else 0


def _link_after(block: Block, new: Block) -> None:
    """Put `new` right after `block` in its segment's list of blocks."""
    new.prev, new.next = block, block.next
    if block.next is not None:
        block.next.prev = new
    block.next = new


def _link_before(block: Block, new: Block) -> None:
    """Put `new` right before `block` in its segment's list of blocks."""
    new.prev, new.next = block.prev, block
    if block.prev is not None:
        block.prev.next = new
    block.prev = new


def _allocatable(b: Block | None) -> bool:
    return b is not None and not b.allocated and b.event_count == 0 and not b.stream_uses


def _has_space(b: Block | None, size: int) -> bool:
    total = 0
    while total < size and b is not None and _allocatable(b):
        total += b.size
        b = b.next
    return total >= size


@trait
@mypyc_attr(allow_interpreted_subclasses=True)  # as CachingAllocator (vram.allocator.native)
class ExpandableSegmentsMixin:
    """`CachingAllocator`'s expandable-segment paths (spec §14): find, map and unmap pages."""

    # State owned by `CachingAllocator` (declared for the type checker).
    config: AllocatorConfig
    device: Device
    stats: DeviceStats
    history: History
    expandable_segments: list[ExpandableSegment]
    total_allocated_memory: int

    def _find_expandable_block(self, pool: BlockPool, stream: int, size: int) -> Block:
        """The first unmapped block of this stream (address order) that, with the free mapped block
        before it and whatever free/unmapped space follows, holds `size`; else a new segment's range.
        The room found never crosses a segment's end, so when `size` is more than the largest
        segment the search would fail on every block: it is skipped (the same answer, without a
        walk over the unmapped range each earlier such request left behind)."""
        if size <= pool.largest_expandable:
            for key in pool.unmapped_keys.irange_from(stream << STREAM_SHIFT):
                if key >> STREAM_SHIFT != stream:
                    break
                c = pool.unmapped[key]
                if _allocatable(c.prev):
                    c = c.prev  # type: ignore[assignment]
                if _has_space(c, size):
                    return c
        page = K_SMALL_BUFFER if pool.is_small else self.config.large_segment_size
        es = ExpandableSegment(self.device, stream, page)
        self.expandable_segments.append(es)
        candidate = Block(stream, es.size, pool, es.ptr)
        candidate.mapped = False
        candidate.expandable_segment = es
        pool.insert_unmapped(candidate)
        return candidate

    def _map_block(self, to_map: Block, size: int, frames: Any) -> bool:
        """Back the front of unmapped block `to_map` with pages covering `size` bytes; merge with
        free mapped neighbours and put the result in the pool (spec §14 step 2)."""
        es: ExpandableSegment = to_map.expandable_segment
        ptr, mapped = es.map(to_map.ptr, size)
        if mapped == 0:
            return False
        pool = to_map.pool
        pool.remove_unmapped(to_map)
        to_map.mapped = True
        if mapped < to_map.size:
            rest = Block(to_map.stream, to_map.size - mapped, pool, to_map.ptr + mapped)
            rest.mapped = False
            rest.expandable_segment = es
            _link_after(to_map, rest)
            pool.insert_unmapped(rest)
            to_map.size = mapped
        try_merge_blocks(to_map, to_map.prev, pool)
        try_merge_blocks(to_map, to_map.next, pool)
        pool.insert(to_map)
        self.total_allocated_memory += mapped
        stats = self.stats
        stats.on_segment(pool.stat_index, 0, mapped)  # reserved bytes only: no `segment` change
        stats.num_device_alloc += 1
        self.history.record("segment_map", ptr, mapped, to_map.stream, frames, pool.trace_id)
        if to_map.prev is None and to_map.segment_frames is None:
            to_map.segment_frames = frames
        return True

    def _try_allocate_expandable_block(self, pool: BlockPool, stream: int, size: int,
                                           frames: Any) -> Block | None:
        """New memory for a rounded request of `size` bytes from an expandable segment (spec §14)."""
        candidate = self._find_expandable_block(pool, stream, size)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size), frames):
            return None
        while candidate.size < size:
            nxt = candidate.next
            assert nxt is not None and not nxt.mapped
            if not self._map_block(nxt, min(size - candidate.size, nxt.size), frames):
                return None
            candidate = nxt
        pool.remove(candidate)
        if pool.owner is not None:  # one count per successful ``alloc_block``, however many maps
            pool.owner.cuda_malloc_count += 1
        return candidate

    def _unmap_block(self, block: Block, frames: Any) -> None:
        """Unmap the whole pages inside free block `block` (spec §14, release); partial-page pieces
        stay mapped and free. A segment left entirely unmapped gives back its virtual range."""
        es: ExpandableSegment = block.expandable_segment
        pool = block.pool
        if pool.owner is not None and pool.owner.cuda_malloc_count <= 0 and es.unmap_range(block.ptr, block.size)[1]:
            # PyTorch counts one per ``alloc_block`` and one down per unmap: a private pool that
            # unmaps more runs than it allocated fails its internal assert here.
            raise RuntimeError("INTERNAL ASSERT FAILED: block->pool->owner_PrivatePool->cudaMalloc_count > 0 "
                               "(unmap_block in a private memory pool with expandable segments)")
        ptr, size = es.unmap(block.ptr, block.size)
        if size == 0:
            return
        pool.remove(block)
        before = ptr - block.ptr
        if before > 0:
            head = Block(block.stream, before, pool, block.ptr)
            head.expandable_segment = es
            _link_before(block, head)
            head.segment_frames, block.segment_frames = block.segment_frames, None
            pool.insert(head)
        after = block.size - before - size
        if after > 0:
            tail = Block(block.stream, after, pool, ptr + size)
            tail.expandable_segment = es
            _link_after(block, tail)
            pool.insert(tail)
        block.ptr = ptr
        block.size = size
        block.mapped = False
        try_merge_blocks(block, block.prev, pool)
        try_merge_blocks(block, block.next, pool)
        pool.insert_unmapped(block)
        self.total_allocated_memory -= size
        stats = self.stats
        stats.on_segment(pool.stat_index, 0, -size)
        stats.num_device_free += 1
        if pool.owner is not None:
            pool.owner.cuda_malloc_count -= 1
        self.history.record("segment_unmap", ptr, size, block.stream, frames, pool.trace_id)
        if block.prev is None and block.next is None:
            pool.remove_unmapped(block)
            self.expandable_segments.remove(es)
            self.device.release(es.ptr)
