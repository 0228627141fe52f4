"""Load a recorded segment layout into a `CachingAllocator`.

`import_segments` installs segments and blocks — allocated ones live, free ones cached in their
pool, pending ones (``active_pending_free``: freed, waiting for events on other streams) active
but not allocated — exactly as if the allocator had produced them, with every statistic
consistent with the block state (spec §16): segment, reserved, allocation, active, requested,
inactive_split and the oversize counts. Counters of driver calls (``num_device_alloc`` …) are
left at 0: those calls happened before the recording.

Expandable segments (spec §14) are recorded as one entry per contiguous mapped run. The runs of
one (stream, pool) become one expandable segment ("in practice there is one growing segment per
(stream, pool)"), based at the lowest address it is known to have mapped (``expandable_base``
from `vram.replay.rewind`, else its lowest run) and as long as this device's reserve
(``1⅛ × total memory`` in whole pages, CUDACachingAllocator.cpp ``ExpandableSegment``); the space
between and after the runs is unmapped.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from vram.allocator.block import Block, BlockPool
from vram.allocator.caching import CachingAllocator
from vram.allocator.expandable import K_SMALL_BUFFER, ExpandableSegment, range_size
from vram.devices.trace import TraceDevice

from .validate import RESERVED_STREAMS, private_pool

ALLOCATED_STATES = ("active_allocated", "active_pending_free")
#: streams on which the events of blocks pending at the start wait, one stream per block (so each
#: completes on its own: ``process_events`` stops at a stream's first incomplete event)
PENDING_IMPORT_STREAMS = RESERVED_STREAMS + (1 << 60)


class StateError(ValueError):
    """A recorded state that cannot be installed (overlaps, does not fit, unsupported)."""


def import_segments(alloc: CachingAllocator, segments: Iterable[Mapping[str, Any]]) -> None:
    """Install `segments` (snapshot segment dicts with blocks) into an empty allocator.

    ``active_allocated`` blocks become allocated blocks at their recorded addresses,
    ``active_pending_free`` ones freed blocks waiting for an event (on a stream of their own from
    `PENDING_IMPORT_STREAMS`, completed by ``device.synchronize_event``), ``inactive`` ones free
    cached blocks. Raises `StateError` if the allocator is not empty, blocks do not tile their
    segment, expandable runs cannot share one segment, or the device has no room for them.
    """
    with alloc.lock:
        if alloc.active or len(alloc.small_blocks) or len(alloc.large_blocks) or alloc.expandable_segments:
            raise StateError("import_segments needs an empty allocator")
        segs = sorted(segments, key=lambda s: s["address"])
        for s in segs:
            total = sum(b["size"] for b in s["blocks"])
            if total != s["total_size"] or not s["blocks"]:
                raise StateError(f"segment {s['address']:#x}: blocks add up to {total}, "
                                 f"not its total_size {s['total_size']}")
        groups: dict[tuple[int, bool, Any], list[Mapping[str, Any]]] = {}
        for s in segs:
            if s.get("is_expandable"):
                key = (s.get("stream", 0), s.get("segment_type") == "small", private_pool(s.get("segment_pool_id")))
                groups.setdefault(key, []).append(s)
            else:
                _install(alloc, s)
        for (stream, small, pid), runs in groups.items():
            _install_expandable(alloc, stream, _expandable_pool(alloc, small, pid), runs)


def _install(alloc: CachingAllocator, seg: Mapping[str, Any]) -> None:
    device = alloc.device
    address, total, stream = seg["address"], seg["total_size"], seg.get("stream", 0)
    adopt = getattr(device, "adopt", None)
    if adopt is None or not adopt(address, total):
        free, dev_total = device.mem_get_info()
        raise StateError(
            f"the recorded segment at {address:#x} ({total} bytes) does not fit on the device "
            f"({free} of {dev_total} bytes free, or the address is already in use)")
    pool = _pool(alloc, seg)
    stats = alloc.stats
    i = pool.stat_index
    alloc.total_allocated_memory += total
    stats.on_segment(i, 1, total)
    if total >= alloc.config.max_split_size:
        stats.oversize_segments.increase(1)
    blocks = _chain(alloc, seg, pool, stream, None, None)
    if len(blocks) > 1:
        for block in blocks:
            if not block.allocated and block.event_count == 0:
                stats.on_inactive_split(i, 1, block.size)


def _pool(alloc: CachingAllocator, seg: Mapping[str, Any]) -> BlockPool:
    """The segment's pool: the default's, or its private pool's (``segment_pool_id``), created
    with one use (spec §5; ``PrivatePool``'s ``cudaMalloc_count`` counts the segment)."""
    small = seg.get("segment_type") == "small"
    pid = private_pool(seg.get("segment_pool_id"))
    if pid is None:
        return alloc.small_blocks if small else alloc.large_blocks
    if pid not in alloc.graph_pools:
        alloc._create_or_incref(pid)
    pp = alloc.graph_pools[pid]
    pp.cuda_malloc_count += 1
    return pp.small_blocks if small else pp.large_blocks


def _expandable_pool(alloc: CachingAllocator, small: bool, pid: tuple[int, int] | None) -> BlockPool:
    """The pool of a group of expandable runs. A private pool's ``cudaMalloc_count`` (one per
    ``alloc_block`` that mapped, one down per unmap) is not in a snapshot: it starts at 2**40,
    which no run of unmaps exhausts, so the replay never fails PyTorch's assert where the real
    run did not (the count only decides whether an emptied pool's entry is deleted, which
    changes no figure)."""
    if pid is None:
        return alloc.small_blocks if small else alloc.large_blocks
    if pid not in alloc.graph_pools:
        alloc._create_or_incref(pid)
    pp = alloc.graph_pools[pid]
    pp.cuda_malloc_count += 1 << 40
    return pp.small_blocks if small else pp.large_blocks


def _chain(alloc: CachingAllocator, seg: Mapping[str, Any], pool: BlockPool, stream: int,
           prev: Block | None, es: ExpandableSegment | None) -> list[Block]:
    """The blocks of one recorded segment (or mapped run), linked after `prev`."""
    stats = alloc.stats
    i = pool.stat_index
    max_split = alloc.config.max_split_size
    out: list[Block] = []
    ptr = seg["address"]
    for b in seg["blocks"]:
        block = Block(stream, b["size"], pool, ptr)
        block.requested_size = b.get("requested_size", 0) or 0
        block.expandable_segment = es
        _link(prev, block)
        if not out:
            block.segment_frames = seg.get("frames") or None  # shared, never copied: a file may
            # hand one long frame list to many blocks
        state = b.get("state")
        if state in ALLOCATED_STATES:
            block.allocated = True
            block.frames = b.get("frames") or None
            alloc.active[ptr] = block
            stats.on_alloc(i, block.size, block.requested_size)
            if block.size >= max_split:
                stats.oversize_allocations.increase(1)
            if state == "active_pending_free":  # freed, its events still outstanding (spec §10.1)
                block.allocated = False
                stats.on_free_requested(i, block.size)
                if block.size >= max_split:
                    stats.oversize_allocations.decrease(1)
                pending = PENDING_IMPORT_STREAMS + sum(len(q) for q in alloc.cuda_events.values())
                block.event_count = 1
                alloc.cuda_events[pending] = deque([(alloc.device.record_event(pending), block)])
        else:
            if prev is not None and prev.mapped and not prev.allocated and prev.event_count == 0 and out:
                raise StateError(f"segment {seg['address']:#x}: two adjacent free blocks at {prev.ptr:#x} "
                                 f"and {ptr:#x} (the allocator always merges them)")
            pool.insert(block)
        out.append(block)
        prev = block
        ptr += block.size
    return out


def _link(prev: Block | None, block: Block) -> None:
    block.prev = prev
    if prev is not None:
        prev.next = block


def _install_expandable(alloc: CachingAllocator, stream: int, pool: BlockPool,
                        runs: list[Mapping[str, Any]]) -> None:
    """One expandable segment holding the mapped `runs` of (stream, pool), in address order."""
    page = K_SMALL_BUFFER if pool.is_small else alloc.config.large_segment_size
    first = runs[0]["address"]
    base = min([first] + [r["expandable_base"] for r in runs if "expandable_base" in r])
    size = range_size(alloc.device, page)
    where = f"the expandable segment of stream {stream:#x} ({'small' if pool.is_small else 'large'} pool)"
    mapped = 0
    end = base
    for r in runs:
        if (r["address"] - base) % page or r["total_size"] % page:
            raise StateError(f"{where}: the mapped run at {r['address']:#x} ({r['total_size']} bytes) is "
                             f"not whole {page}-byte pages from {base:#x} (spec §14)")
        if r["address"] <= end and r["address"] != first:
            raise StateError(f"{where}: mapped runs at {end:#x} and {r['address']:#x} touch; the "
                             "allocator reports one run per contiguous mapped range")
        mapped += r["total_size"]
        end = r["address"] + r["total_size"]
    device = alloc.device
    if end - base > size and isinstance(device, TraceDevice) and device.recorded_total_memory:
        device.recorded_total_memory = None  # the card was larger than its OOMs show: the stand-in
        size = range_size(device, page)
    if end - base > size:
        raise StateError(f"{where} spans {end - base} bytes from {base:#x}, more than this GPU's "
                         f"reserve of {size} bytes: give the recording's GPU (--gpu), or it had "
                         "several expandable segments there")
    adopt = getattr(device, "adopt_reservation", None)
    if adopt is None or not adopt(base, size, mapped, [(r["address"], r["total_size"]) for r in runs]):
        free, dev_total = device.mem_get_info()
        raise StateError(f"{where} ({mapped} bytes mapped at {base:#x}) does not fit on the device "
                         f"({free} of {dev_total} bytes free, or the range is already in use)")
    es = ExpandableSegment.__new__(ExpandableSegment)
    es.device, es.stream, es.ptr, es.page_size = device, stream, base, page
    es.pages, es.mapped_pages = size // page, mapped // page
    alloc.expandable_segments.append(es)
    alloc.total_allocated_memory += mapped
    alloc.stats.on_segment(pool.stat_index, 0, mapped)  # reserved bytes only (spec §14)
    prev: Block | None = None
    cursor = base
    for r in runs + [{"address": base + size, "blocks": []}]:
        if r["address"] > cursor:
            gap = Block(stream, r["address"] - cursor, pool, cursor)
            gap.mapped = False
            gap.expandable_segment = es
            _link(prev, gap)
            pool.insert_unmapped(gap)
            prev = gap
        if r["blocks"]:
            prev = _chain(alloc, r, pool, stream, prev, es)[-1]
            cursor = r["address"] + r["total_size"]
