"""A reusable consistency checker for `vram.allocator.CachingAllocator`.

`check_invariants(a)` walks every segment of the allocator (ordinary ``cudaMalloc`` segments and
expandable segments, including their unmapped pieces) and asserts what the behavioural spec
(``shared/spec/pytorch-allocator.md``) guarantees at every quiescent point:

* structure (§1, §8, §10.2, §14): blocks tile each segment exactly (no gap, no overlap), the
  ``prev``/``next`` lists are symmetric, every block of a segment shares its stream, pool and
  expandable segment, free neighbours are always merged, sizes are multiples of 512, small
  segments are 2 MiB, large segments are 2 MiB multiples of at least 10 MiB whose blocks are all
  larger than 1 MiB, mapped runs of an expandable segment are whole pages;
* bookkeeping: every free mapped block sits in exactly its own pool under the key
  (stream, size, ptr) and nothing else is in the pools; unmapped pieces sit in the unmapped set
  under (stream, ptr); every allocated or pending-free block is in ``a.active`` under its address;
  every event queued in ``a.cuda_events`` belongs to a pending block whose ``event_count`` matches;
* statistics (§16): the ``current`` value of every stat equals what recomputing it from the
  block state gives, per pool (``all``/``small_pool``/``large_pool``), and the stat algebra holds
  (peak ≥ current, allocated − freed = current, all = small + large, …);
* the device (§1, §22): ``total_allocated_memory`` == ``reserved_bytes.all.current`` == the bytes the
  simulated device handed out, which never exceed its capacity.

`state_fingerprint(a)` returns a comparable picture of the whole allocator state, used to assert
that a rejected call changed nothing.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

MiB = 1 << 20
K_MIN_BLOCK_SIZE = 512
K_SMALL_SIZE = MiB
K_SMALL_BUFFER = 2 * MiB
K_MIN_LARGE_ALLOC = 10 * MiB
K_ROUND_LARGE = 2 * MiB
SIZE_MAX = 2**64 - 1

ARRAY_STATS = ("allocation", "allocated_bytes", "active", "active_bytes", "requested_bytes",
               "segment", "reserved_bytes", "inactive_split", "inactive_split_bytes")
POOLS = ("all", "small_pool", "large_pool")
FIELDS = ("current", "peak", "allocated", "freed")
COUNTERS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
            "num_device_free")


class Segment:
    """One segment found by walking the block lists from a head (a block with no ``prev``)."""

    __slots__ = ("blocks", "pool", "stream", "es")

    def __init__(self, blocks: list[Any]) -> None:
        self.blocks = blocks
        self.pool = blocks[0].pool
        self.stream = blocks[0].stream
        self.es = blocks[0].expandable_segment

    @property
    def ptr(self) -> int:
        return self.blocks[0].ptr

    @property
    def size(self) -> int:
        return sum(b.size for b in self.blocks)

    @property
    def expandable(self) -> bool:
        return self.es is not None

    def __repr__(self) -> str:
        kind = "expandable " if self.es is not None else ""
        return f"<{kind}segment {self.ptr:#x} +{self.size} {self.blocks!r}>"


def _pools(a: Any) -> tuple[Any, Any]:
    return a.small_blocks, a.large_blocks


def pool_index(pool: Any) -> int:
    return 1 if pool.is_small else 2


def segments(a: Any) -> list[Segment]:
    """Every segment, found from the heads of every block the allocator knows about.

    Asserts on the way that the linked lists are symmetric, that every known block is reached
    exactly once, and that no unknown block is reachable.
    """
    known: dict[int, Any] = {}
    for pool in _pools(a):
        for b in pool.blocks.values():
            assert id(b) not in known, f"{b!r} is twice in the pools"
            known[id(b)] = b
        for b in pool.unmapped.values():
            assert id(b) not in known, f"unmapped {b!r} is also elsewhere"
            known[id(b)] = b
    for b in a.active.values():
        assert id(b) not in known, f"active {b!r} is also in a pool"
        known[id(b)] = b
    seen: set[int] = set()
    out: list[Segment] = []
    for b in known.values():
        if b.prev is not None:
            continue
        chain = []
        cur = b
        while cur is not None:
            assert id(cur) in known, f"{cur!r} is reachable from {b!r} but in no pool and not active"
            assert id(cur) not in seen, f"{cur!r} reached twice (cycle or shared block)"
            seen.add(id(cur))
            if cur.next is not None:
                assert cur.next.prev is cur, f"{cur!r}.next.prev is {cur.next.prev!r}"
            chain.append(cur)
            cur = cur.next
        out.append(Segment(chain))
    missing = [b for k, b in known.items() if k not in seen]
    assert not missing, f"blocks not reachable from any segment head (prev cycle?): {missing!r}"
    out.sort(key=lambda s: s.ptr)
    return out


def _is_free_mapped(b: Any) -> bool:
    return not b.allocated and b.mapped and b.event_count == 0 and not b.stream_uses


def expected_stats(a: Any, segs: list[Segment] | None = None) -> dict[str, Any]:
    """Recompute, from the block state alone, the current value of every stat (spec §16)."""
    if segs is None:
        segs = segments(a)
    M = a.config.max_split_size
    exp: dict[str, list[int]] = {name: [0, 0, 0] for name in ARRAY_STATS}
    oversize_allocations = 0
    oversize_segments = 0
    for seg in segs:
        i = pool_index(seg.pool)
        split = len(seg.blocks) > 1
        if not seg.expandable:
            exp["segment"][i] += 1
            exp["reserved_bytes"][i] += seg.size
            if seg.size >= M:
                oversize_segments += 1
        for b in seg.blocks:
            if seg.expandable and b.mapped:
                exp["reserved_bytes"][i] += b.size
            if b.allocated:
                exp["allocation"][i] += 1
                exp["allocated_bytes"][i] += b.size
                if b.size >= M:
                    oversize_allocations += 1
            if a.active.get(b.ptr) is b:
                exp["active"][i] += 1
                exp["active_bytes"][i] += b.size
                exp["requested_bytes"][i] += b.requested_size
            elif b.mapped and split and not seg.expandable:
                exp["inactive_split"][i] += 1
                exp["inactive_split_bytes"][i] += b.size
    for arr in exp.values():
        arr[0] = arr[1] + arr[2]
    return {"arrays": exp, "oversize_allocations": oversize_allocations,
            "oversize_segments": oversize_segments}


def check_invariants(a: Any, *, accumulated: bool = True, check_oversize: bool = True,
                     exact_counters: bool = False, allowed: int | None = None,
                     strict_split: bool = True) -> list[Segment]:
    """Assert every invariant listed in the module docstring; return the segments.

    accumulated:    no ``reset_accumulated_memory_stats`` happened, so allocated − freed == current
                    and peak ≤ allocated.
    check_oversize: ``max_split_size`` did not change since the allocator was created, so the
                    oversize stats can be recomputed with the current value. (After a change
                    PyTorch compares with the *current* value when decrementing, so the oversize
                    stats may even go negative; then only allocated − freed = current is checked.)
    exact_counters: no expandable segment was ever used (and no counter reset), so
                    ``num_device_alloc − num_device_free`` is the number of live segments.
    allowed:        a memory-fraction limit that was never lowered below what is reserved; non-
                    expandable allocators then never reserve more than it.
    strict_split:   ``expandable_segments`` was never switched on at run time over existing
                    ordinary segments. (Once it is on, ``should_split`` uses the 512-byte rule for
                    every block, §8, so an ordinary large segment can get pieces ≤ 1 MiB.)
    """
    segs = segments(a)
    config = a.config
    small, large = _pools(a)
    device = a.device

    # ---- pool containers are self-consistent -------------------------------------------------
    for pool in (small, large):
        keys = list(pool.keys)
        assert keys == sorted(keys), f"{pool.name} pool keys out of order"
        assert len(keys) == len(set(keys)) == len(pool.keys), f"{pool.name} pool: duplicate keys"
        assert set(keys) == set(pool.blocks), f"{pool.name} pool: keys and blocks disagree"
        ukeys = list(pool.unmapped_keys)
        assert ukeys == sorted(ukeys), f"{pool.name} unmapped keys out of order"
        assert set(ukeys) == set(pool.unmapped) and len(ukeys) == len(pool.unmapped), \
            f"{pool.name} pool: unmapped keys and blocks disagree"
        for key, b in pool.blocks.items():
            assert b.pool is pool, f"{b!r} is in the {pool.name} pool but says {b.pool.name}"
            assert key == (b.stream << 128) | (b.size << 64) | b.ptr, \
                f"{b!r} is filed under a stale key in the {pool.name} pool"
            assert _is_free_mapped(b), f"{b!r} in the {pool.name} pool is not a free mapped block"
            assert b.gc_count_base <= pool.get_free_blocks_call_count, f"{b!r}: GC base in the future"
        for key, b in pool.unmapped.items():
            assert b.pool is pool and not b.mapped and not b.allocated, f"bad unmapped entry {b!r}"
            assert b.expandable_segment is not None, f"unmapped {b!r} outside an expandable segment"
            assert key == (b.stream << 128) | b.ptr, f"unmapped {b!r} filed under a stale key"

    for ptr, b in a.active.items():
        assert b.ptr == ptr, f"{b!r} is active under {ptr:#x}"
        assert b.mapped, f"active {b!r} is unmapped"
        if b.allocated:
            assert b.event_count == 0, f"allocated {b!r} has {b.event_count} pending events"
        else:
            assert b.event_count > 0, f"{b!r} is active, not allocated, and waits for no event"
            assert not b.stream_uses, f"pending-free {b!r} still has stream uses"

    # ---- events --------------------------------------------------------------------------------
    queued: Counter[int] = Counter()
    for queue in a.cuda_events.values():
        for _event, b in queue:
            assert not b.allocated and a.active.get(b.ptr) is b, f"event queued for non-pending {b!r}"
            queued[id(b)] += 1
    for b in a.active.values():
        if not b.allocated:
            assert queued[id(b)] == b.event_count, \
                f"{b!r}: event_count {b.event_count} but {queued[id(b)]} events queued"

    # ---- segments -----------------------------------------------------------------------------
    dev_allocs = getattr(device, "_allocations", None)
    dev_mapped = getattr(device, "_mapped", None)
    es_seen: dict[int, Any] = {}
    for seg in segs:
        pool = seg.pool
        head = seg.blocks[0]
        for b in seg.blocks:
            assert b.pool is pool, f"{seg!r}: blocks of one segment in different pools"
            assert b.stream == seg.stream, f"{seg!r}: blocks of one segment on different streams"
            assert b.expandable_segment is seg.es, f"{seg!r}: mixed expandable_segment"
            assert b.size > 0 and b.size % K_MIN_BLOCK_SIZE == 0, f"{b!r}: size not a positive 512 multiple"
            assert b.ptr % K_MIN_BLOCK_SIZE == 0, f"{b!r}: address not 512-aligned"
            if b.allocated:
                assert a.active.get(b.ptr) is b, f"allocated {b!r} missing from a.active"
                assert b.requested_size > 0, f"allocated {b!r} has requested_size 0"
                assert b.requested_size <= b.size, f"{b!r}: requested more than the block"
                if pool.is_small:
                    assert b.size <= K_SMALL_SIZE, f"small-pool allocation {b!r} larger than 1 MiB"
                else:
                    assert b.size > K_SMALL_SIZE, f"large-pool allocation {b!r} not larger than 1 MiB"
            elif b.mapped and a.active.get(b.ptr) is not b:
                assert pool.blocks.get(b.key) is b, f"free mapped {b!r} is not in its pool"
            elif not b.mapped:
                assert pool.unmapped.get(b.key) is b, f"unmapped {b!r} is not in its unmapped set"
        for x, y in zip(seg.blocks, seg.blocks[1:]):
            assert y.ptr == x.ptr + x.size, f"{seg!r}: gap or overlap between {x!r} and {y!r}"
            assert y.prev is x
            both_free = (_is_free_mapped(x) and _is_free_mapped(y)
                         and a.active.get(x.ptr) is not x and a.active.get(y.ptr) is not y)
            assert not both_free, f"adjacent free blocks {x!r} and {y!r} were not merged"
            assert x.mapped or y.mapped, f"adjacent unmapped blocks {x!r} and {y!r} were not merged"
        if seg.es is None:
            assert all(b.mapped for b in seg.blocks), f"unmapped block in ordinary {seg!r}"
            if dev_allocs is not None:
                assert dev_allocs.get(head.ptr) == seg.size, \
                    f"{seg!r} does not match a device allocation ({dev_allocs.get(head.ptr)})"
            assert seg.size % K_ROUND_LARGE == 0, f"{seg!r}: size not a 2 MiB multiple"
            if pool.is_small:
                assert seg.size == K_SMALL_BUFFER, f"small {seg!r} is not 2 MiB"
            else:
                assert seg.size >= K_MIN_LARGE_ALLOC, f"large {seg!r} smaller than 10 MiB"
                if strict_split:
                    for b in seg.blocks:
                        assert b.size > K_SMALL_SIZE, f"large-pool block {b!r} not larger than 1 MiB"
        else:
            es = seg.es
            assert id(es) not in es_seen, f"two segments share expandable segment {es!r}"
            es_seen[id(es)] = es
            assert any(e is es for e in a.expandable_segments), f"{seg!r}: unknown expandable segment"
            assert head.ptr == es.ptr and seg.size == es.size, f"{seg!r} does not cover its reserved range"
            assert es.stream == seg.stream
            page = K_SMALL_BUFFER if pool.is_small else config.large_segment_size
            assert es.page_size == page, f"{seg!r}: page size {es.page_size}, expected {page}"
            mapped = 0
            for x, y in zip([None] + seg.blocks, seg.blocks + [None]):
                if y is not None and y.mapped and (x is None or not x.mapped):
                    assert (y.ptr - es.ptr) % page == 0, f"mapped run starts mid-page at {y!r}"
                if x is not None and x.mapped and (y is None or not y.mapped):
                    assert (x.ptr + x.size - es.ptr) % page == 0, f"mapped run ends mid-page at {x!r}"
                if y is not None and y.mapped:
                    mapped += y.size
            assert mapped == es.mapped_pages * page, \
                f"{seg!r}: {mapped} bytes of mapped blocks, {es.mapped_pages} pages mapped"
            if dev_mapped is not None:
                assert dev_mapped.get(es.ptr) == mapped, f"{seg!r}: device says {dev_mapped.get(es.ptr)} mapped"
    assert len(es_seen) == len(a.expandable_segments), \
        f"{len(a.expandable_segments) - len(es_seen)} expandable segments have no blocks"
    if dev_allocs is not None:
        ordinary = {s.ptr for s in segs if s.es is None}
        assert set(dev_allocs) == ordinary, \
            f"device allocations without a segment: {sorted(set(dev_allocs) - ordinary)}"

    # ---- statistics ----------------------------------------------------------------------------
    stats = a.stats
    flat = a.memory_stats()
    exp = expected_stats(a, segs)
    for name in ARRAY_STATS:
        arr = getattr(stats, name)
        for i, pool_name in enumerate(POOLS):
            got = arr[i].current
            want = exp["arrays"][name][i]
            assert got == want, f"{name}.{pool_name}.current is {got}, block state says {want}"
    if check_oversize:
        assert stats.oversize_allocations.current == exp["oversize_allocations"], \
            f"oversize_allocations.current {stats.oversize_allocations.current} != {exp['oversize_allocations']}"
        assert stats.oversize_segments.current == exp["oversize_segments"], \
            f"oversize_segments.current {stats.oversize_segments.current} != {exp['oversize_segments']}"
    all_stats = [(f"{name}.{POOLS[i]}", getattr(stats, name)[i]) for name in ARRAY_STATS for i in range(3)]
    all_stats += [("oversize_allocations", stats.oversize_allocations),
                  ("oversize_segments", stats.oversize_segments)]
    for label, s in all_stats:
        if check_oversize or not label.startswith("oversize"):
            assert s.current >= 0, f"{label}.current negative: {s.current}"
        assert s.peak >= s.current, f"{label}.peak {s.peak} < current {s.current}"
        assert s.allocated >= 0 and s.freed >= 0, f"{label}: negative allocated/freed"
        if accumulated:
            assert s.allocated - s.freed == s.current, \
                f"{label}: allocated {s.allocated} - freed {s.freed} != current {s.current}"
            assert s.peak <= s.allocated, f"{label}.peak {s.peak} > allocated {s.allocated}"
        for f in FIELDS:
            assert flat[f"{label}.{f}"] == getattr(s, f), f"memory_stats()['{label}.{f}'] disagrees"
    for name in ARRAY_STATS:
        arr = getattr(stats, name)
        for f in ("current", "allocated", "freed"):
            assert getattr(arr[0], f) == getattr(arr[1], f) + getattr(arr[2], f), \
                f"{name}.all.{f} != small + large"
        assert max(arr[1].peak, arr[2].peak) <= arr[0].peak <= arr[1].peak + arr[2].peak, \
            f"{name}.all.peak inconsistent with the pool peaks"
    for name in COUNTERS:
        assert getattr(stats, name) >= 0 and flat[name] == getattr(stats, name)
    # (with expandable segments one map call can be undone by several unmap calls, so
    # num_device_free may exceed num_device_alloc there)
    if accumulated:
        # every OOM follows a retry (attempt 3), every retry follows a full synchronisation (§9.4e)
        assert stats.num_sync_all_streams >= stats.num_alloc_retries >= stats.num_ooms, \
            "num_sync_all_streams >= num_alloc_retries >= num_ooms violated"
    if exact_counters:
        assert stats.num_device_alloc - stats.num_device_free == stats.segment[0].current, \
            "num_device_alloc - num_device_free != live segments"
    expected_msplit = -1 if config.max_split_size == SIZE_MAX else config.max_split_size
    if check_oversize:
        assert stats.max_split_size == expected_msplit == flat["max_split_size"]

    for i in range(3):
        alloc_b = stats.allocated_bytes[i].current
        active_b = stats.active_bytes[i].current
        reserved_b = stats.reserved_bytes[i].current
        assert alloc_b <= active_b <= reserved_b, \
            f"{POOLS[i]}: allocated {alloc_b} <= active {active_b} <= reserved {reserved_b} violated"
        assert stats.requested_bytes[i].current <= active_b
        assert stats.allocation[i].current <= stats.active[i].current
        assert stats.inactive_split_bytes[i].current + active_b <= reserved_b

    reserved = stats.reserved_bytes[0].current
    assert a.total_allocated_memory == reserved, \
        f"total_allocated_memory {a.total_allocated_memory} != reserved_bytes {reserved}"
    used = getattr(device, "used", None)
    if used is not None:
        assert used == reserved, f"device.used {used} != reserved_bytes {reserved}"
        if dev_allocs is not None and dev_mapped is not None:
            assert used == sum(dev_allocs.values()) + sum(dev_mapped.values())
    capacity = device.total_memory - getattr(device, "context", 0) - getattr(device, "other_used", 0)
    assert reserved <= capacity, f"reserved {reserved} exceeds device capacity {capacity}"
    if allowed is not None and not config.expandable_segments:
        assert reserved <= allowed, f"reserved {reserved} exceeds the fraction limit {allowed}"
    return segs


def block_tuple(b: Any) -> tuple:
    return (b.ptr, b.size, b.requested_size, b.stream, b.allocated, b.mapped, b.event_count,
            frozenset(b.stream_uses or ()), b.pool.name, b.gc_count_base,
            None if b.expandable_segment is None else b.expandable_segment.ptr)


def state_fingerprint(a: Any) -> tuple:
    """Everything observable about the allocator's state, as a comparable value."""
    segs = segments(a)
    pools = tuple((tuple(p.keys), tuple(p.unmapped_keys), p.get_free_blocks_call_count)
                  for p in _pools(a))
    events = tuple(sorted((s, tuple((id(e), id(b)) for e, b in q)) for s, q in a.cuda_events.items()))
    return (
        tuple(tuple(block_tuple(b) for b in s.blocks) for s in segs),
        pools,
        tuple(sorted(a.active)),
        events,
        a.total_allocated_memory,
        getattr(a.device, "used", None),
        tuple(es.ptr for es in a.expandable_segments),
        a.config.copy() if hasattr(a.config, "copy") else a.config,
        a.allowed_memory_maximum,
        tuple(a.memory_stats().items()),
    )
