"""Load a recorded segment layout into a `CachingAllocator` (issue: replay from mid-run).

`import_segments` installs segments and blocks — allocated ones live, free ones cached in their
pool — exactly as if the allocator had produced them, with every statistic consistent with the
block state (spec §16): segment, reserved, allocation, active, requested, inactive_split and the
oversize counts. Counters of driver calls (``num_device_alloc`` …) are left at 0: those calls
happened before the recording.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from vram.allocator.block import Block
from vram.allocator.caching import CachingAllocator

ALLOCATED_STATES = ("active_allocated", "active_pending_free")


class StateError(ValueError):
    """A recorded state that cannot be installed (overlaps, does not fit, unsupported)."""


def import_segments(alloc: CachingAllocator, segments: Iterable[Mapping[str, Any]]) -> None:
    """Install `segments` (snapshot segment dicts with blocks) into an empty allocator.

    Blocks in state ``active_allocated`` or ``active_pending_free`` become allocated blocks at
    their recorded addresses; ``inactive`` ones become free cached blocks. Raises `StateError`
    if the allocator is not empty, a segment is expandable, blocks do not tile their segment, or
    the device has no room for the segments.
    """
    with alloc.lock:
        if alloc.active or len(alloc.small_blocks) or len(alloc.large_blocks) or alloc.expandable_segments:
            raise StateError("import_segments needs an empty allocator")
        segs = sorted(segments, key=lambda s: s["address"])
        for s in segs:
            if s.get("is_expandable"):
                raise StateError(f"segment {s['address']:#x} is an expandable segment: "
                                 "loading expandable segments is not supported yet")
            total = sum(b["size"] for b in s["blocks"])
            if total != s["total_size"] or not s["blocks"]:
                raise StateError(f"segment {s['address']:#x}: blocks add up to {total}, "
                                 f"not its total_size {s['total_size']}")
        for s in segs:
            _install(alloc, s)


def _install(alloc: CachingAllocator, seg: Mapping[str, Any]) -> None:
    device = alloc.device
    address, total, stream = seg["address"], seg["total_size"], seg.get("stream", 0)
    adopt = getattr(device, "adopt", None)
    if adopt is None or not adopt(address, total):
        free, dev_total = device.mem_get_info()
        raise StateError(
            f"the recorded segment at {address:#x} ({total} bytes) does not fit on the device "
            f"({free} of {dev_total} bytes free, or the address is already in use)")
    pool = alloc.small_blocks if seg.get("segment_type") == "small" else alloc.large_blocks
    stats = alloc.stats
    i = pool.stat_index
    max_split = alloc.config.max_split_size
    alloc.total_allocated_memory += total
    stats.on_segment(i, 1, total)
    if total >= max_split:
        stats.oversize_segments.increase(1)
    blocks = seg["blocks"]
    split = len(blocks) > 1
    prev: Block | None = None
    ptr = address
    for b in blocks:
        block = Block(stream, b["size"], pool, ptr)
        block.requested_size = b.get("requested_size", 0) or 0
        block.prev = prev
        if prev is not None:
            prev.next = block
        else:
            block.segment_frames = seg.get("frames") or None  # shared, never copied: a file may
            # hand one long frame list to many blocks
        if b.get("state") in ALLOCATED_STATES:
            block.allocated = True
            block.frames = b.get("frames") or None
            alloc.active[ptr] = block
            stats.on_alloc(i, block.size, block.requested_size)
            if block.size >= max_split:
                stats.oversize_allocations.increase(1)
        else:
            if prev is not None and not prev.allocated:
                raise StateError(f"segment {address:#x}: two adjacent free blocks at {prev.ptr:#x} "
                                 f"and {ptr:#x} (the allocator always merges them)")
            pool.insert(block)
            if split:
                stats.on_inactive_split(i, 1, block.size)
        prev = block
        ptr += block.size
