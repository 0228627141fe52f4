"""Exact cycle skipping for long replays (training loops repeat).

The replay is deterministic: the same replay state followed by the same events produces the
same decisions. So if the state before event ``i`` equals the state before an earlier event
``j`` and events ``i .. i+P`` (P = i − j) equal events ``j .. i``, replaying them would do
exactly what ``j .. i`` did: every block ends where it was, every *current* statistic (a function
of the blocks) and every peak (the period's maxima were already reached) are unchanged, and the
running totals (``allocated``/``freed`` of each statistic, the driver/retry/OOM counters) grow by
the same amounts. `CycleSkipper` applies those deltas instead of replaying the period.

States are compared at anchor events chosen by their content (an ``alloc`` whose (address,
size) hashes to 0 under a mask), so anchors fall at the same phase of every period. The
fingerprint covers everything later decisions depend on: every block (address, size, allocated,
requested size, stream, pending events, recorded stream uses, mapped; GC age when GC is on),
the event queues, expandable segments, the device's recorded-address cursor and bytes in use,
and the replay's own maps (recorded → our addresses, held-back frees). Two independent 64-bit
hashes of it must both match. Where anchors keep missing, they are thinned out, so a trace with
no cycle pays little. Fingerprints cost the size of the state, and a hostile trace can choose
addresses that make every event an anchor: their total cost is kept within a constant times the
events replayed (`affordable`), so skipping never makes a replay quadratic.
"""
from __future__ import annotations

from typing import Any

from vram.allocator.caching import CachingAllocator
from vram.allocator.stats import COUNTERS


class CycleSkipper:
    """Finds repeated replay states and the periods that can be skipped (see module doc)."""

    MAX_MASK = (1 << 14) - 1
    WORK_PER_EVENT = 64  # fingerprinted rows allowed per replayed event, on top of WORK_BASE
    WORK_BASE = 1 << 20

    def __init__(self, alloc: CachingAllocator, dev: Any, gc_active: bool, verify: bool) -> None:
        self.alloc = alloc
        self.dev = dev
        self.gc_active = gc_active
        self.verify = verify
        self.mask = 63
        self.misses = 0
        self.seen: dict[tuple[int, int, tuple[Any, ...]], tuple[int, list[int]]] = {}
        self.stats = alloc.stats.all_stats()
        self.skipped_events = 0
        self.work = 0  # rows fingerprinted so far

    def affordable(self, i: int) -> bool:
        """Whether a fingerprint at event `i` keeps the total within budget (see module doc)."""
        return self.work <= self.WORK_BASE + self.WORK_PER_EVENT * i

    def is_anchor(self, ev: tuple[Any, ...]) -> bool:
        return ev[0] == 0 and not (hash(ev[1:3]) & self.mask)

    def fingerprint(self, ptr_of: dict[int, Any], pending: dict[int, int],
                    extra: tuple[Any, ...]) -> tuple[int, int]:
        a = self.alloc
        gc = self.gc_active
        rows: list[tuple[Any, ...]] = []
        for pool in (a.small_blocks, a.large_blocks):
            clock = pool.get_free_blocks_call_count
            for b in pool.blocks.values():
                rows.append((b.ptr, b.size, 0, b.requested_size, b.stream, 0, None, 1,
                             clock - b.gc_count_base if gc else 0))
            for b in pool.unmapped.values():
                rows.append((b.ptr, b.size, 0, b.requested_size, b.stream, 0, None, 0, 0))
        for b in a.active.values():
            uses = tuple(sorted(b.stream_uses)) if b.stream_uses else None
            rows.append((b.ptr, b.size, 1 if b.allocated else 2, b.requested_size, b.stream,
                         b.event_count, uses, 1, 0))
        rows.sort()
        self.work += len(rows) + len(ptr_of) + len(pending) + len(extra)
        queues = tuple((s, tuple((e.completed, blk.ptr) for e, blk in q)) for s, q in a.cuda_events.items())
        segs = tuple((es.ptr, es.mapped_pages) for es in a.expandable_segments)
        dev = self.dev
        state: tuple[Any, ...] = (tuple(rows), queues, segs, a.total_allocated_memory, dev.used, dev.cursor,
                 tuple(sorted(ptr_of.items(), key=lambda kv: kv[0])),
                 tuple(sorted(pending.items())), extra)
        if self.verify:
            state += (len(dev.mallocs), len(dev.frees), len(dev.divergences))
        return hash(state), hash((state, 0x5BD1E995))

    def totals(self) -> list[int]:
        s = self.alloc.stats
        out = []
        for st in self.stats:
            out.append(st.allocated)
            out.append(st.freed)
        out.extend(getattr(s, name) for name in COUNTERS)
        return out

    def check(self, i: int, ev: tuple[Any, ...], fp: tuple[int, int]) -> tuple[int, list[int]] | None:
        """Record the state at anchor `i`; return (j, totals at j) if it was seen before."""
        key = (fp[0], fp[1], ev)
        prev = self.seen.get(key)
        if prev is None:
            self.misses += 1
            if self.misses >= 8 and self.mask < self.MAX_MASK:
                self.mask = self.mask * 2 + 1
                self.misses = 0
            if len(self.seen) > 4096:
                self.seen.clear()
            self.seen[key] = (i, self.totals())
            return None
        return prev

    def apply(self, before: list[int], periods: int) -> None:
        """Add `periods` × (totals now − `before`) to every running total."""
        now = self.totals()
        k = 0
        for st in self.stats:
            st.allocated += (now[k] - before[k]) * periods
            st.freed += (now[k + 1] - before[k + 1]) * periods
            k += 2
        s = self.alloc.stats
        for name in COUNTERS:
            setattr(s, name, getattr(s, name) + (now[k] - before[k]) * periods)
            k += 1
