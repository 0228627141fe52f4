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
rules of spec §8. The gap ends at the nearest evidence of the block's end: the next block live
at the start, the segment's end, and every in-trace allocation at a higher address of the same
segment made while the block was still live. With ``expandable_segments:True`` a block is split
at any remainder ≥ 512 B (``should_split``, spec §14), so it is exactly ``round_size(n)``. A block
whose ``free_completed`` comes with no ``free_requested`` before it in the trace had its free
requested before the trace began: it starts ``active_pending_free`` (freed, waiting for events).

Expandable segments (spec §14) appear as one entry per contiguous mapped run. Backwards, a
``segment_map`` turns its range back into unmapped space (the run is cut), a ``segment_unmap``
maps it again as free memory (joined to the runs it touches). Each run records the lowest address
its expandable segment is seen to have mapped (``expandable_base``, for `vram.replay.state`).
"""
from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from vram.allocator.block import SortedKeys
from vram.allocator.caching import K_MIN_BLOCK_SIZE, K_SMALL_SIZE, round_size

from . import ccore
from .messages import SnapshotError
from .validate import private_pool


class TraceError(SnapshotError):
    """The trace and the final state contradict each other (a file that cannot be replayed)."""


ALLOCATED, PENDING = "active_allocated", "active_pending_free"
LARGE_PAGE = 20 * 1024 * 1024  # an expandable segment's large-pool page (kLargeBuffer, spec §14)


class _Segment:
    __slots__ = ("address", "total_size", "stream", "segment_type", "frames", "live", "expandable", "bound",
                 "unknown", "pool")

    def __init__(self, address: int, total_size: int, stream: int, segment_type: str | None,
                 frames: list[Any], expandable: bool = False) -> None:
        self.address = address
        self.total_size = total_size
        self.stream = stream
        self.segment_type = segment_type  # None: an expandable run of a pool not yet known
        self.frames = frames
        self.expandable = expandable
        #: addr -> (size, requested, frames, state); size -1: allocated before the trace, unknown
        self.live: dict[int, tuple[int, int, list[Any], str]] = {}
        #: addr of a block of unknown size -> the lowest address allocated above it while it lived
        self.bound: dict[int, int] = {}
        self.unknown: list[int] = []  # sorted addresses of the live blocks of size -1
        self.pool: Any = None  # a private pool's id (``segment_pool_id``); None: the default pool

    @property
    def end(self) -> int:
        return self.address + self.total_size


_Edit = Callable[[_Segment], None]  # add a segment to, or drop it from, the rewound state


def rewind(segments: Sequence[Mapping[str, Any]], trace: Sequence[Mapping[str, Any]],
           divisions: list[int] | None = None, device: int = 0,
           expandable_conf: bool = False, private_pools: bool = False,
           events: ccore.Scan | None = None) -> list[dict[str, Any]]:
    """The segments (with blocks) as they were before the first event of `trace`.

    `segments` is the snapshot's final state of one device, `trace` that device's events (its
    index `device` names them in errors), `divisions` the recording's
    ``roundup_power2_divisions`` table and `expandable_conf` its ``expandable_segments`` (for
    inferring sizes); `private_pools`: the recording used private pools, so segments keep their
    pool, which only the Python walk follows. `events`: `trace` as `ccore.scan` read it, if
    the caller has it. Linear in the trace (a sorted index of segment starts), so 100k segments
    rewind in well under a second. Raises `TraceError` where the trace contradicts the final state.
    """
    divisions = divisions or [0] * 16
    segs: dict[int, _Segment] = {}
    starts = SortedKeys()  # segment addresses, for "which segment holds this address"
    final_free: dict[tuple[int, int], int] = {}
    groups = _Groups()
    for s in segments:
        seg = _Segment(s["address"], s["total_size"], s.get("stream", 0),
                       s.get("segment_type", "large"), s.get("frames") or [], bool(s.get("is_expandable")))
        seg.pool = s.get("segment_pool_id")
        addr = s["address"]
        for b in s["blocks"]:
            if b["state"] != "inactive":
                seg.live[addr] = (b["size"], b.get("requested_size", 0), b.get("frames") or [], b["state"])
            else:
                final_free[(addr, b["size"])] = b.get("requested_size", 0)
                final_free[(-1, addr + b["size"])] = b.get("requested_size", 0)
            addr += b["size"]
        segs[seg.address] = seg
        starts.add(seg.address)
        groups.add(seg)
    private = private_pools or any(private_pool(seg.pool) for seg in segs.values())
    walked = None if private else _walk_in_c(segs, trace, events)
    order: list[int]
    if walked is None:
        _walk(segs, starts, groups, trace, divisions, device)
        order = list(starts)
    else:
        segs, order = walked, list(walked)  # (in address order)
    for a in order:
        seg = segs[a]
        if seg.segment_type is None:  # never used in the trace: only its size can tell
            groups.drop(seg)
            seg.segment_type = "large" if seg.total_size % LARGE_PAGE == 0 else "small"
            groups.add(seg)
        _infer_sizes(seg, divisions, expandable_conf or seg.expandable)
    return [_as_snapshot_segment(segs[a], final_free, groups.lowest) for a in order]


def _walk_in_c(segs: dict[int, _Segment], trace: Sequence[Mapping[str, Any]],
               events: ccore.Scan | None = None) -> dict[int, _Segment] | None:
    """`_walk` in C (`vram.replay.ccore`), on new segments (`segs` is left as it is), over `trace`
    as `ccore.scan` reads it (`events`, if the caller has it): the segments at the trace's first
    event by address, or None where the C core is not there or leaves the walk to Python (expandable
    segments, values beyond 64 bits, a trace that contradicts the state, events that are not dicts)."""
    module = ccore.loaded()
    if module is None or not trace or any(s.expandable or s.segment_type is None for s in segs.values()):
        return None
    trace = trace if isinstance(trace, list) else list(trace)
    if events is None:
        events = ccore.scan(trace)
        if events is None:
            return None
    given = list(segs.values())
    got = module.rewind([(s.address, s.total_size, s.live) for s in given], events.ops, trace, ALLOCATED, PENDING)
    if got is None:
        return None
    out: dict[int, _Segment] = {}
    for index, address, total, stream, live, bound in got:
        if index >= 0:
            old = given[index]
            seg = _Segment(address, total, old.stream, old.segment_type, old.frames)
        else:  # restored by a segment_free (as `_walk` makes it)
            seg = _Segment(address, total, stream, "small" if total == 2 * 1024 * 1024 else "large", [])
        seg.live, seg.bound = live, bound
        out[address] = seg
    return out


def _walk(segs: dict[int, _Segment], starts: SortedKeys, groups: _Groups, trace: Sequence[Mapping[str, Any]],
          divisions: list[int], device: int) -> None:
    """Walk `trace` backwards from the final state in `segs` (with `starts` and `groups`), leaving
    there the state at its first event: the readable reference for `_walk_in_c`."""
    _BackwardWalk(segs, starts, groups, trace, divisions, device).run()


class _BackwardWalk:
    """`_walk`'s state: the segments by address, their starts and groups, and `holder`, address ->
    the segment holding it (the same addresses come back all through a trace, and a dict lookup is
    much cheaper than a search of `starts`; cleared whenever segments change)."""

    def __init__(self, segs: dict[int, _Segment], starts: SortedKeys, groups: _Groups,
                 trace: Sequence[Mapping[str, Any]], divisions: list[int], device: int) -> None:
        self.segs, self.starts, self.groups, self.trace = segs, starts, groups, trace
        self.divisions, self.device = divisions, device
        self.holder: dict[int, _Segment] = {}
        self.nowhere = _Segment(-1, 0, 0, None, [])  # holds no block: for an address in no segment

    def run(self) -> None:
        steps = {"alloc": self._alloc, "free_completed": self._free_completed,
                 "free_requested": self._free_requested, "segment_alloc": self._segment_alloc,
                 "segment_free": self._segment_free, "segment_map": self._segment_map,
                 "segment_unmap": self._segment_unmap}
        trace = self.trace
        for i in range(len(trace) - 1, -1, -1):
            e = trace[i]
            step = steps.get(e["action"])
            if step is not None:
                step(i, e)

    def at(self, i: int) -> str:
        trace = self.trace
        return f"device_traces[{self.device}][{i}] ({trace[i]['action']} at {trace[i]['addr']:#x})"

    def find(self, addr: int, i: int) -> _Segment:
        seg = self.holder.get(addr)
        if seg is not None:
            return seg
        k = self.starts.floor_below(addr + 1)
        if k is not None:
            seg = self.segs[k]
            if addr < seg.end:
                self.holder[addr] = seg
                return seg
        raise TraceError(f"{self.at(i)}: the address is in no segment at that point of the trace")

    def add(self, seg: _Segment) -> None:
        self.holder.clear()
        self.segs[seg.address] = seg
        self.starts.add(seg.address)
        self.groups.add(seg)

    def drop(self, seg: _Segment) -> None:
        self.holder.clear()
        del self.segs[seg.address]
        self.starts.remove(seg.address)
        self.groups.drop(seg)

    def _alloc(self, i: int, e: Mapping[str, Any]) -> None:
        addr = e["addr"]
        seg = self.holder.get(addr) or self.find(addr, i)
        got = seg.live.pop(addr, None)
        if got is None:
            raise TraceError(f"{self.at(i)}: no block is live at that address later")
        if got[0] < 0:  # allocated in the trace: what bounded it says nothing of an older block
            del seg.unknown[bisect_left(seg.unknown, addr)]
            seg.bound.pop(addr, None)
        if seg.segment_type is None:  # an expandable run of unknown pool: the request tells
            self.groups.drop(seg)
            seg.segment_type = "small" if round_size(e["size"], self.divisions) <= K_SMALL_SIZE else "large"
            self.groups.add(seg)
        _bound_below(seg, addr)

    def _free_completed(self, i: int, e: Mapping[str, Any]) -> None:
        addr = e["addr"]
        seg = self.holder.get(addr) or self.find(addr, i)
        if addr in seg.live:
            raise TraceError(f"{self.at(i)}: a block is live at that address later")
        # Size unknown (-1) until the end: only blocks still live at the start need it. Pending
        # until its free_requested shows up earlier in the trace.
        seg.live[addr] = (-1, e["size"], e.get("frames") or [], PENDING)
        insort(seg.unknown, addr)

    def _free_requested(self, i: int, e: Mapping[str, Any]) -> None:
        addr = e["addr"]
        owner = self.holder.get(addr)
        if owner is None:
            k = self.starts.floor_below(addr + 1)
            owner = self.segs[k] if k is not None and addr < self.segs[k].end else self.nowhere
            if owner is not self.nowhere:
                self.holder[addr] = owner
        got = owner.live.get(addr)
        if got is not None and got[3] == PENDING:
            owner.live[addr] = (*got[:3], ALLOCATED)

    def _segment_alloc(self, i: int, e: Mapping[str, Any]) -> None:
        created = self.segs.get(e["addr"])
        if created is None or created.expandable:
            raise TraceError(f"{self.at(i)}: no segment starts at that address later")
        if created.live:
            raise TraceError(f"{self.at(i)}: the segment still has live blocks before its segment_alloc")
        self.drop(created)

    def _segment_free(self, i: int, e: Mapping[str, Any]) -> None:
        addr, size = e["addr"], e["size"]
        _check_unused(self.segs, self.starts, addr, size, self.at(i), "freed segment")
        if size <= 0 or size % K_MIN_BLOCK_SIZE:
            raise TraceError(f"{self.at(i)}: a segment of {size} bytes cannot exist (spec §6)")
        freed = _Segment(addr, size, e.get("stream", 0), "small" if size == 2 * 1024 * 1024 else "large", [])
        freed.pool = e.get("pool_id")  # (its pool: vram.replay.pool_replay)
        self.add(freed)

    def _segment_map(self, i: int, e: Mapping[str, Any]) -> None:
        self.holder.clear()  # (runs are cut and joined in place)
        _unmap_back(e, self.find(e["addr"], i), self.at(i), self.add, self.drop, self.groups)

    def _segment_unmap(self, i: int, e: Mapping[str, Any]) -> None:
        self.holder.clear()
        _map_back(e, self.at(i), self.add, self.drop, self.segs, self.starts)


def _group(seg: _Segment) -> tuple[int, str | None, Any]:
    """An expandable run's (stream, small/large pool, private pool id): one segment each."""
    return seg.stream, seg.segment_type, private_pool(seg.pool)


class _Groups:
    """Expandable runs per (stream, pool): how many exist, and the lowest address their current
    expandable segment has been seen to map (its base is at or below it)."""

    def __init__(self) -> None:
        self.count: dict[tuple[int, str | None, Any], int] = {}
        self.lowest: dict[tuple[int, str | None, Any], int] = {}

    def add(self, seg: _Segment) -> None:
        if seg.expandable:
            key = _group(seg)
            self.count[key] = self.count.get(key, 0) + 1
            if seg.address < self.lowest.get(key, seg.address + 1):
                self.lowest[key] = seg.address

    def drop(self, seg: _Segment) -> None:
        if seg.expandable:
            key = _group(seg)
            self.count[key] -= 1

    def created(self, seg: _Segment) -> None:
        """Backwards past a map that left its pool no run: that map created the expandable
        segment; runs seen earlier belong to another one."""
        key = _group(seg)
        if not self.count.get(key):
            self.lowest.pop(key, None)


def _bound_below(seg: _Segment, addr: int) -> None:
    """An allocation at `addr` bounds the end of the nearest block below it whose size is unknown
    (it was live then: blocks allocated before the trace are live from its start until freed)."""
    k = bisect_left(seg.unknown, addr)
    if k:
        u = seg.unknown[k - 1]
        seg.bound[u] = min(seg.bound.get(u, addr), addr)


def _check_unused(segs: Mapping[int, _Segment], starts: SortedKeys, addr: int, size: int, where: str,
                  what: str) -> None:
    if addr in segs:
        raise TraceError(f"{where}: a segment starts at that address later")
    k = starts.floor_below(addr + size)
    if k is not None and segs[k].end > addr:
        raise TraceError(f"{where}: the {what} ({size} bytes) overlaps another one")


def _unmap_back(e: Mapping[str, Any], seg: _Segment, where: str, add: _Edit, drop: _Edit, groups: _Groups) -> None:
    """Before a ``segment_map`` its range was unmapped: cut it out of the run that holds it."""
    addr, size = e["addr"], e["size"]
    end = addr + size
    if not seg.expandable or end > seg.end or size <= 0:
        raise TraceError(f"{where}: the mapped range ({size} bytes) is not inside one expandable "
                         "segment later")
    if any(addr <= a < end or a < addr < a + v[0] for a, v in seg.live.items()):
        raise TraceError(f"{where}: a block is live in the range before it was mapped")
    drop(seg)
    for lo, hi in ((seg.address, addr), (end, seg.end)):
        if hi > lo:
            part = _Segment(lo, hi - lo, seg.stream, seg.segment_type, seg.frames if lo == seg.address else [], True)
            part.live = {a: v for a, v in seg.live.items() if lo <= a < hi}
            part.bound = {a: b for a, b in seg.bound.items() if lo <= a < hi}
            part.unknown = [a for a in seg.unknown if lo <= a < hi]
            part.pool = seg.pool
            add(part)
    groups.created(seg)


def _map_back(e: Mapping[str, Any], where: str, add: _Edit, drop: _Edit, segs: Mapping[int, _Segment],
              starts: SortedKeys) -> None:
    """Before a ``segment_unmap`` its range was mapped and free: a run, joined to the runs it touches."""
    addr, size, stream = e["addr"], e["size"], e.get("stream", 0)
    if size <= 0 or size % (2 * 1024 * 1024):
        raise TraceError(f"{where}: {size} bytes cannot be unmapped (whole 2 MiB or 20 MiB pages, spec §14)")
    _check_unused(segs, starts, addr, size, where, "unmapped range")
    k = starts.floor_below(addr)
    left = segs[k] if k is not None and segs[k].end == addr else None
    right = segs.get(addr + size)
    pool = private_pool(e.get("pool_id"))
    parts = [p for p in (left, right) if p is not None and p.expandable and p.stream == stream
             and (pool is None or private_pool(p.pool) in (None, pool))]
    types = {p.segment_type for p in parts} - {None}
    if len(types) > 1:
        raise TraceError(f"{where}: the unmapped range joins runs of both pools")
    run = _Segment(addr, size, stream, types.pop() if types else None, [], True)
    run.pool = pool if pool is not None else next((p.pool for p in parts if private_pool(p.pool)), None)
    for p in parts:
        drop(p)
        run.live.update(p.live)
        run.bound.update(p.bound)
        run.unknown = sorted(run.unknown + p.unknown)
        run.address = min(run.address, p.address)
        run.total_size += p.total_size
        if p is left:
            run.frames = p.frames
    add(run)


def _infer_sizes(seg: _Segment, divisions: list[int], exact: bool) -> None:
    """Sizes of blocks allocated before the trace and freed in it: ``round_size(n)``, extended
    over a following gap that cannot be a free block of the pool (spec §8: a large-pool block is
    always > 1 MiB, a small-pool one ≥ 512 B). The gap ends at the nearest evidence: the next
    live block, the segment's end, an allocation above it while it lived (`_bound_below`).
    `exact`: the recording split at any remainder ≥ 512 B (expandable segments, spec §14)."""
    addrs = sorted(seg.live)
    small = seg.segment_type == "small"
    for k, addr in enumerate(addrs):
        size, n, frames, state = seg.live[addr]
        if size >= 0:
            continue
        end = min(addrs[k + 1] if k + 1 < len(addrs) else seg.end, seg.bound.get(addr, seg.end))
        size = round_size(n, divisions)
        gap = end - addr - size
        if gap < 0 or (small or exact) and gap < K_MIN_BLOCK_SIZE or not (small or exact) and gap <= K_SMALL_SIZE:
            size = end - addr
        seg.live[addr] = (size, n, frames, state)


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


def _as_snapshot_segment(seg: _Segment, final_free: Mapping[tuple[int, int], int],
                         lowest: Mapping[tuple[int, str | None, Any], int]) -> dict[str, Any]:
    blocks = []
    addr = seg.address
    end = seg.end
    for a in sorted(seg.live):
        if a < addr:
            raise TraceError(f"the trace restores a block at {a:#x}, inside the live block before it "
                             f"(segment at {seg.address:#x})")
        if a > addr:
            blocks.append({"address": addr, "size": a - addr, "state": "inactive", "frames": [],
                           "requested_size": _stale_requested(final_free, addr, a)})
        size, requested, frames, state = seg.live[a]
        blocks.append({"address": a, "size": size, "requested_size": requested,
                       "state": state, "frames": frames})
        addr = a + size
    if addr < end:
        blocks.append({"address": addr, "size": end - addr, "state": "inactive", "frames": [],
                       "requested_size": _stale_requested(final_free, addr, end)})
    out: dict[str, Any] = {"address": seg.address, "total_size": seg.total_size, "stream": seg.stream,
           "segment_type": seg.segment_type, "is_expandable": seg.expandable, "frames": seg.frames,
           "blocks": blocks}
    pool = private_pool(seg.pool)
    if pool is not None:
        out["segment_pool_id"] = pool
    if seg.expandable:
        out["expandable_base"] = lowest.get(_group(seg), seg.address)
    return out
