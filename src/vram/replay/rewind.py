"""Reconstruct the allocator state at a trace's first event (spec §23, "rewound").

A trace often starts mid-run (a ring buffer, or recording switched on late). Like memory_viz's
segment view, we walk the trace backwards from the final ``segments``: an ``alloc`` removes its
block, a ``free_completed`` restores it, a ``segment_alloc`` removes its segment and a
``segment_free`` restores an empty one. What remains at the start is the set of live blocks per
segment; free space is the gaps between them (free neighbours are always merged, so each gap is
one free block).

A block allocated before the trace and freed in it has an unknown block size (traces hold only
requested bytes): it is inferred as ``round_size(n)``, extended over a following gap too small to
be a free block of its pool (≤ 1 MiB in the large pool, < 512 B in the small pool) — the split
rules of spec §8.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vram.allocator.block import SortedKeys
from vram.allocator.caching import K_MIN_BLOCK_SIZE, K_SMALL_SIZE, round_size

from .messages import SnapshotError


class TraceError(SnapshotError):
    """The trace and the final state contradict each other (a file that cannot be replayed)."""


class _Segment:
    __slots__ = ("address", "total_size", "stream", "segment_type", "frames", "live")

    def __init__(self, address: int, total_size: int, stream: int, segment_type: str,
                 frames: list[Any]) -> None:
        self.address = address
        self.total_size = total_size
        self.stream = stream
        self.segment_type = segment_type
        self.frames = frames
        self.live: dict[int, tuple[int, int, list[Any]]] = {}  # addr -> (size, requested, frames)


def rewind(segments: Sequence[Mapping[str, Any]], trace: Sequence[Mapping[str, Any]],
           divisions: list[int] | None = None, device: int = 0) -> list[dict[str, Any]]:
    """The segments (with blocks) as they were before the first event of `trace`.

    `segments` is the snapshot's final state of one device, `trace` that device's events (its
    index `device` names them in errors), `divisions` the recording's
    ``roundup_power2_divisions`` table (for inferring sizes). Linear in the trace (a sorted
    index of segment starts), so 100k segments rewind in well under a second. Raises
    `TraceError` where the trace contradicts the final state.
    """
    divisions = divisions or [0] * 16
    segs: dict[int, _Segment] = {}
    starts = SortedKeys()  # segment addresses, for "which segment holds this address"
    final_free: dict[tuple[int, int], int] = {}
    for s in segments:
        if s.get("is_expandable"):
            raise TraceError("rewinding expandable segments is not supported yet")
        seg = _Segment(s["address"], s["total_size"], s.get("stream", 0),
                       s.get("segment_type", "large"), s.get("frames") or [])
        addr = s["address"]
        for b in s["blocks"]:
            if b["state"] != "inactive":
                seg.live[addr] = (b["size"], b.get("requested_size", 0), b.get("frames") or [])
            else:
                final_free[(addr, b["size"])] = b.get("requested_size", 0)
                final_free[(-1, addr + b["size"])] = b.get("requested_size", 0)
            addr += b["size"]
        segs[seg.address] = seg
        starts.add(seg.address)

    def at(i: int) -> str:
        return f"device_traces[{device}][{i}] ({trace[i]['action']} at {trace[i]['addr']:#x})"

    def find(addr: int, i: int) -> _Segment:
        k = starts.floor_below(addr + 1)
        if k is not None:
            seg = segs[k]
            if addr < seg.address + seg.total_size:
                return seg
        raise TraceError(f"{at(i)}: the address is in no segment at that point of the trace")

    for i in range(len(trace) - 1, -1, -1):
        e = trace[i]
        action = e["action"]
        if action == "alloc":
            seg = find(e["addr"], i)
            if seg.live.pop(e["addr"], None) is None:
                raise TraceError(f"{at(i)}: no block is live at that address later")
        elif action == "free_completed":
            addr = e["addr"]
            seg = find(addr, i)
            if addr in seg.live:
                raise TraceError(f"{at(i)}: a block is live at that address later")
            # Size unknown (-1) until the end: only blocks still live at the start need it.
            seg.live[addr] = (-1, e["size"], e.get("frames") or [])
        elif action == "segment_alloc":
            created = segs.pop(e["addr"], None)
            if created is None:
                raise TraceError(f"{at(i)}: no segment starts at that address later")
            if created.live:
                raise TraceError(f"{at(i)}: the segment still has live blocks before its segment_alloc")
            starts.remove(created.address)
        elif action == "segment_free":
            addr, size = e["addr"], e["size"]
            if addr in segs:
                raise TraceError(f"{at(i)}: a segment starts at that address later")
            below, above = starts.floor_below(addr), starts.higher(addr)
            if (below is not None and segs[below].address + segs[below].total_size > addr
                    or above is not None and addr + size > above):
                raise TraceError(f"{at(i)}: the freed segment ({size} bytes) overlaps another one")
            if size <= 0 or size % K_MIN_BLOCK_SIZE:
                raise TraceError(f"{at(i)}: a segment of {size} bytes cannot exist (spec §6)")
            segs[addr] = _Segment(addr, size, e.get("stream", 0),
                                  "small" if size == 2 * 1024 * 1024 else "large", [])
            starts.add(addr)
        elif action in ("segment_map", "segment_unmap"):
            raise TraceError(f"{at(i)}: rewinding expandable segments is not supported yet")
    for a in starts:
        _infer_sizes(segs[a], divisions)
    return [_as_snapshot_segment(segs[a], final_free) for a in starts]


def _infer_sizes(seg: _Segment, divisions: list[int]) -> None:
    """Sizes of blocks allocated before the trace and freed in it: ``round_size(n)``, extended
    over a following gap that cannot be a free block of the pool (spec §8: a large-pool block is
    always > 1 MiB, a small-pool one ≥ 512 B), clamped at the next live block."""
    addrs = sorted(seg.live)
    end_of_seg = seg.address + seg.total_size
    small = seg.segment_type == "small"
    for k, addr in enumerate(addrs):
        size, n, frames = seg.live[addr]
        if size >= 0:
            continue
        end = addrs[k + 1] if k + 1 < len(addrs) else end_of_seg
        size = round_size(n, divisions)
        gap = end - addr - size
        if gap < 0 or (small and gap < K_MIN_BLOCK_SIZE) or (not small and gap <= K_SMALL_SIZE):
            size = end - addr
        seg.live[addr] = (size, n, frames)


def _stale_requested(final_free: Mapping[tuple[int, int], int], addr: int, end: int) -> int:
    """The stale ``requested_size`` of a free block at the start (spec §8, §10.2).

    A free block left untouched shows its value in the final snapshot. One carved from the front
    keeps it on the remainder, which still ends where the block ended: so a final free block
    ending at `end` carries it. (If a later free merged into that tail, the merged block shows
    the freed block's value instead, which the replay reproduces either way.) Else 0.
    """
    got = final_free.get((addr, end - addr))
    if got is None:
        got = final_free.get((-1, end), 0)
    return got


def _as_snapshot_segment(seg: _Segment, final_free: Mapping[tuple[int, int], int]) -> dict[str, Any]:
    blocks = []
    addr = seg.address
    end = seg.address + seg.total_size
    for a in sorted(seg.live):
        if a < addr:
            raise TraceError(f"the trace restores a block at {a:#x}, inside the live block before it "
                             f"(segment at {seg.address:#x})")
        if a > addr:
            blocks.append({"address": addr, "size": a - addr, "state": "inactive", "frames": [],
                           "requested_size": _stale_requested(final_free, addr, a)})
        size, requested, frames = seg.live[a]
        blocks.append({"address": a, "size": size, "requested_size": requested,
                       "state": "active_allocated", "frames": frames})
        addr = a + size
    if addr < end:
        blocks.append({"address": addr, "size": end - addr, "state": "inactive", "frames": [],
                       "requested_size": _stale_requested(final_free, addr, end)})
    return {"address": seg.address, "total_size": seg.total_size, "stream": seg.stream,
            "segment_type": seg.segment_type, "is_expandable": False, "frames": seg.frames,
            "blocks": blocks}
