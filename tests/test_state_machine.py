"""Stateful property tests for `vram.allocator.CachingAllocator`.

A hypothesis `RuleBasedStateMachine` drives one allocator on a small simulated device through
random sequences of malloc (sizes biased to the boundaries of spec §2–§8), free, record_stream,
empty_cache, device synchronisation, calls on several streams, out-of-memory failures and bad
input, under a configuration drawn at the start (default, ``max_split_size_mb``,
``roundup_power2_divisions`` scalar or list, ``garbage_collection_threshold`` with a memory
fraction, ``expandable_segments:True``, and both event-completion models of the simulated device).

After every step `tests.invariants.check_invariants` re-derives every stat from the block state
and checks the structure; each rule also checks its own effect against the spec (rounding §4,
best fit §7, split rule §8, OOM retry chain §9, free/events §10, release §11, stats §16), and the
test keeps a model of live pointers and pending cross-stream frees. At the end everything is
freed, the device synchronised and the cache emptied: nothing may stay reserved.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

sys.path.insert(0, os.path.dirname(__file__))

from invariants import check_invariants, segments, state_fingerprint  # noqa: E402
from vram.allocator.caching import CachingAllocator  # noqa: E402
from vram.allocator.errors import OutOfMemoryError  # noqa: E402
from vram.devices.simulated import SimulatedDevice  # noqa: E402

KiB = 1 << 10
MiB = 1 << 20
SIZE_MAX = 2**64 - 1
R_DEFAULT = 20 * MiB  # max_non_split_rounding default (§3.3)
STREAMS = (0, 7, 13)  # stream handles: the default stream and two side streams


# ------------------------------------------------------------------ reference formulas (spec)

def ref_round_size(n: int, table: list[int]) -> int:
    """Spec §4, written independently of the implementation."""
    if n < 512:
        return 512
    bucket = min(max((n.bit_length() - 1) - 20, 0), 15)  # clamp(floor(log2 n) - 20, 0, 15)
    d = table[bucket]
    if d > 1 and n > 512 * d:
        if n & (n - 1) == 0:
            return n
        f = 1 << (n.bit_length() - 1)
        step = f // d
        return f + step * -(-(n - f) // step)
    return -(-n // 512) * 512


def ref_alloc_size(size: int) -> int:
    """Spec §6."""
    if size <= MiB:
        return 2 * MiB
    if size < 10 * MiB:
        return 20 * MiB
    return -(-size // (2 * MiB)) * (2 * MiB)


def format_size(b: int) -> str:
    """Spec §15 format_size."""
    if b <= 1024:
        return f"{b} bytes"
    if b <= MiB:
        return f"{b / 1024:.2f} KiB"
    if b <= 1 << 30:
        return f"{b / MiB:.2f} MiB"
    return f"{b / (1 << 30):.2f} GiB"


# ------------------------------------------------------------------ configurations

@dataclass(frozen=True)
class Conf:
    text: str
    max_split: int  # bytes, SIZE_MAX when unlimited
    table: tuple[int, ...]
    gc: float  # 0 when off
    expandable: bool
    fraction: float | None  # set_memory_fraction at start (None: no limit)
    on_sync: bool
    total: int

    def __repr__(self) -> str:
        return (f"Conf({self.text!r}, fraction={self.fraction}, "
                f"event_completion={'on_sync' if self.on_sync else 'immediate'}, total={self.total // MiB} MiB)")


ROUNDUP = [
    ("", (0,) * 16),
    ("roundup_power2_divisions:4", (4,) * 16),
    ("roundup_power2_divisions:2", (2,) * 16),
    ("roundup_power2_divisions:8", (8,) * 16),
    # first item fills below; gaps stay 0 after the reset of §3.1; '>' fills from last+1 (§3.4)
    ("roundup_power2_divisions:[2:4,16:8,>:2]", (4, 4, 0, 0, 8) + (2,) * 11),
    ("roundup_power2_divisions:[1:2,2:4,4:8,8:4,16:2,>:1]", (2, 4, 8, 4, 2) + (1,) * 11),
]


@st.composite
def confs(draw: st.DrawFn) -> Conf:
    parts: list[str] = []
    kind = draw(st.sampled_from(["default", "mixed", "mixed", "mixed"]))
    max_split, table, gc, expandable, fraction = SIZE_MAX, (0,) * 16, 0.0, False, None
    if kind == "mixed":
        if draw(st.booleans()):
            m = draw(st.one_of(st.sampled_from([20, 21, 22, 30, 32, 64]), st.integers(20, 200)))
            parts.append(f"max_split_size_mb:{m}")
            max_split = m * MiB
        text, table = draw(st.sampled_from(ROUNDUP))
        if text:
            parts.append(text)
        if draw(st.booleans()):
            gc = draw(st.sampled_from([0.3, 0.5, 0.6, 0.8]))
            parts.append(f"garbage_collection_threshold:{gc}")
            fraction = draw(st.sampled_from([0.5, 0.75, 0.9]))
        elif draw(st.integers(0, 3)) == 0:
            fraction = draw(st.sampled_from([0.4, 0.8]))
        if draw(st.integers(0, 2)) == 0:
            parts.append("expandable_segments:True")
            expandable = True
    on_sync = draw(st.booleans())
    total = draw(st.sampled_from([64, 96, 128, 256, 1024])) * MiB
    draw_order = draw(st.permutations(parts)) if parts else parts
    return Conf(",".join(draw_order), max_split, table, gc, expandable, fraction, on_sync, total)


@st.composite
def reconfs(draw: st.DrawFn) -> tuple[str, int, tuple[int, ...], float, bool | None]:
    """A valid settings string for set_allocator_settings at run time: (text, max_split, table,
    gc threshold, expandable or None when the string leaves it as it was (§3.1))."""
    parts: list[str] = []
    max_split, gc, expandable = SIZE_MAX, 0.0, None
    if draw(st.booleans()):
        m = draw(st.one_of(st.sampled_from([20, 21, 32]), st.integers(20, 200)))
        parts.append(f"max_split_size_mb:{m}")
        max_split = m * MiB
    text, table = draw(st.sampled_from(ROUNDUP))
    if text:
        parts.append(text)
    if draw(st.booleans()):
        gc = draw(st.sampled_from([0.3, 0.6]))
        parts.append(f"garbage_collection_threshold:{gc}")
    expandable = draw(st.sampled_from([None, True, False]))
    if expandable is not None:
        parts.append(f"expandable_segments:{expandable}")
    return ",".join(draw(st.permutations(parts))), max_split, table, gc, expandable


def size_strategy(conf: Conf) -> st.SearchStrategy[int]:
    boundaries = {1, 511, 512, 513, 1000, 4096, 1 * MiB - 512, 1 * MiB - 1, 1 * MiB, 1 * MiB + 1,
                  1 * MiB + 512, 2 * MiB - 1, 2 * MiB, 2 * MiB + 1, 3 * MiB, 5 * MiB + 1,
                  10 * MiB - 1, 10 * MiB, 10 * MiB + 1, 19 * MiB, 19 * MiB + 1, 20 * MiB - 1,
                  20 * MiB, 20 * MiB + 1, 21 * MiB, 32 * MiB, 50 * MiB, 64 * MiB, 64 * MiB + 1,
                  100 * MiB}
    if conf.max_split != SIZE_MAX:
        m = conf.max_split
        boundaries |= {m - 2 * MiB - 1, m - 1, m, m + 1, m + R_DEFAULT - 1 * MiB, m + 3 * MiB}
    ordered = sorted(b for b in boundaries if 0 < b <= 120 * MiB)
    return st.one_of(
        st.sampled_from(ordered),
        st.integers(1, 1 * MiB),
        st.integers(1 * MiB + 1, 12 * MiB),
        st.integers(1, 100 * MiB),
        st.just(0),
    )


# ------------------------------------------------------------------ the machine

class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.a: CachingAllocator | None = None
        self.live: dict[int, tuple[int, int]] = {}  # ptr -> (requested n, stream)
        self.pending: dict[int, set[int]] = {}  # ptr -> streams whose event is not complete yet
        self.freed: set[int] = set()  # pointers freed at some point (for double-free checks)

    # -- setup -----------------------------------------------------------------------------
    @initialize(conf=confs())
    def setup(self, conf: Conf) -> None:
        self.conf = conf
        self.device = SimulatedDevice(conf.total,
                                      event_completion="on_sync" if conf.on_sync else "immediate")
        self.a = CachingAllocator(self.device, alloc_conf=conf.text)
        self.allowed = None
        if conf.fraction is not None:
            self.a.set_memory_fraction(conf.fraction)
            self.allowed = int(conf.fraction * conf.total)
            assert self.a.allowed_memory_maximum == self.allowed
        assert self.a.config.max_split_size == conf.max_split
        assert list(self.a.config.roundup_power2_divisions) == list(conf.table)
        assert self.a.config.expandable_segments == conf.expandable
        assert self.a.config.garbage_collection_threshold == conf.gc
        self.sizes = size_strategy(conf)
        event(f"expandable={conf.expandable} gc={self.gc_active} max_split={conf.max_split != SIZE_MAX} "
              f"on_sync={conf.on_sync}")
        self.M = conf.max_split
        self.reconfigured = False
        self.ever_expandable = conf.expandable
        self.R = self.a.config.max_non_split_rounding
        assert self.R == R_DEFAULT

    # -- helpers ----------------------------------------------------------------------------
    @property
    def gc_active(self) -> bool:
        return self.conf.gc > 0 and self.allowed is not None

    def stats(self) -> dict[str, int]:
        return dict(self.a.memory_stats())

    def complete_ready_events(self) -> None:
        """process_events at the start of malloc: blocks whose events all completed are freed."""
        for ptr in [p for p, streams in self.pending.items() if not streams]:
            del self.pending[ptr]

    def check(self) -> None:
        check_invariants(self.a, exact_counters=not self.ever_expandable,
                         allowed=None if self.ever_expandable else self.allowed,
                         check_oversize=not self.reconfigured, strict_split=not self.reconfigured)

    def pending_bytes(self) -> int:
        return sum(b.size for b in self.a.active.values() if not b.allocated)

    # -- invariants --------------------------------------------------------------------------
    @invariant()
    def invariants_hold(self) -> None:
        if self.a is None:
            return
        self.check()
        a = self.a
        allocated = {p for p, b in a.active.items() if b.allocated}
        assert allocated == set(self.live), "allocated blocks differ from the live pointers"
        for ptr, (n, stream) in self.live.items():
            b = a.active[ptr]
            assert b.requested_size == n and b.stream == stream
        pending = {p for p, b in a.active.items() if not b.allocated}
        assert pending == set(self.pending), \
            f"pending frees {sorted(pending)} differ from the model {sorted(self.pending)}"

    # -- malloc -----------------------------------------------------------------------------
    @rule(data=st.data())
    def malloc(self, data: st.DataObject) -> None:
        n = data.draw(self.sizes, label="n")
        stream = data.draw(st.sampled_from(STREAMS), label="stream")
        self._malloc(n, stream)

    @rule(data=st.data())
    def malloc_burst(self, data: st.DataObject) -> None:
        """Several allocations in a row (memory pressure, OOMs on the small devices)."""
        for _ in range(data.draw(st.integers(2, 6), label="count")):
            n = data.draw(self.sizes, label="n")
            stream = data.draw(st.sampled_from(STREAMS), label="stream")
            self._malloc(n, stream)

    def _best_fit(self, pool, stream: int, rounded: int):
        """Spec §7 oracle: the free block the cache must hand out, or None for a cache miss."""
        order = sorted((b for b in pool.blocks.values() if b.stream == stream), key=lambda b: (b.size, b.ptr))
        idx = next((i for i, b in enumerate(order) if b.size >= rounded), None)
        if idx is None:
            return None
        best = order[idx]
        if best.expandable_segment is not None and not self.conf.expandable:
            # toggled off at run time: expandable blocks are no longer handed out (§7 step 3)
            while best.expandable_segment is not None:
                idx += 1
                if idx == len(order):
                    return None
                best = order[idx]
        if best.expandable_segment is not None:

            def xsize(b):  # how far b can grow into the unmapped block after it (§7 step 3)
                nxt = b.next
                return b.size + (nxt.size if nxt is not None and not nxt.mapped else 0)

            first = idx
            while (best.expandable_segment is not None and idx + 1 < len(order)
                   and xsize(order[idx + 1]) < xsize(best)):
                idx += 1
                best = order[idx]
            if idx != first:
                event("expandable best fit skipped a block fronting the unmapped tail")
        if rounded < self.M and best.size >= self.M:
            return None
        if rounded >= self.M and best.size >= rounded + self.R:
            return None
        return best

    def _malloc(self, n: int, stream: int) -> None:
        a = self.a
        before = self.stats()
        if n == 0:
            fp = state_fingerprint(a)
            assert a.malloc(0, stream) == 0
            assert state_fingerprint(a) == fp, "malloc(0) changed the allocator"
            return
        rounded = ref_round_size(n, list(self.conf.table))
        small = rounded <= MiB
        pool = a.small_blocks if small else a.large_blocks
        alloc_size = ref_alloc_size(rounded)
        oracle = None
        no_hit = False
        no_events = not a.cuda_events
        if no_events:
            best = self._best_fit(pool, stream, rounded)
            oracle = None if best is None else (best.ptr, best.size, best)
            no_hit = best is None
        dev_free_before = self.device.mem_get_info()[0]
        total_before = a.total_allocated_memory
        pending_before = self.pending_bytes()
        plan = None
        if no_hit and not self.conf.expandable:
            plan = self._ref_release_chain(pool, stream, rounded, alloc_size, dev_free_before, total_before)
        try:
            ptr = a.malloc(n, stream)
        except OutOfMemoryError as e:
            assert plan is None or plan[0] == "retry", \
                f"OOM although GC / oversize release would have made room ({plan})"
            self._after_oom(e, n, stream, rounded, alloc_size, before, pending_before)
            return
        self.complete_ready_events()
        assert ptr not in self.live
        self.live[ptr] = (n, stream)
        self.freed.discard(ptr)
        after = self.stats()
        b = a.active.get(ptr)
        assert b is not None and b.allocated and b.ptr == ptr, f"malloc({n}) returned a non-block {ptr:#x}"
        assert b.requested_size == n and b.stream == stream
        assert b.pool is pool, f"malloc({n}) (rounded {rounded}) went to the {b.pool.name} pool"
        # Rounding (§4) and the split rule (§8).
        if small or self.conf.expandable:
            assert b.size == rounded, f"malloc({n}): block {b.size}, rounded size {rounded}"
        elif rounded < self.M:
            assert rounded <= b.size <= rounded + MiB, f"malloc({n}): block {b.size}, rounded {rounded}"
        else:
            assert rounded <= b.size < rounded + self.R, f"oversize malloc({n}): block {b.size}"
            assert b.prev is None and b.next is None, "an oversize allocation was split"
        # Stats of the allocation itself (§16.1).
        i = "small_pool" if small else "large_pool"
        for pk in ("all", i):
            assert after[f"allocation.{pk}.current"] == before[f"allocation.{pk}.current"] + 1
            assert after[f"allocated_bytes.{pk}.current"] == before[f"allocated_bytes.{pk}.current"] + b.size
            assert after[f"allocated_bytes.{pk}.allocated"] == before[f"allocated_bytes.{pk}.allocated"] + b.size
            assert after[f"requested_bytes.{pk}.allocated"] == before[f"requested_bytes.{pk}.allocated"] + n
            assert after[f"active.{pk}.allocated"] == before[f"active.{pk}.allocated"] + 1
        assert after["oversize_allocations.current"] == before["oversize_allocations.current"] + (b.size >= self.M)
        assert after["num_ooms"] == before["num_ooms"]
        retries = after["num_alloc_retries"] - before["num_alloc_retries"]
        assert retries in (0, 1)
        assert after["num_sync_all_streams"] - before["num_sync_all_streams"] == retries
        if retries:
            event("malloc succeeded after a retry")
            assert not a.cuda_events  # the retry synchronised every event
            self.pending.clear()
        new_allocs = after["num_device_alloc"] - before["num_device_alloc"]
        if after["num_device_free"] > before["num_device_free"] and not retries:
            event("malloc released cached memory without a full retry (GC or oversize release)")
        if after["active.all.freed"] > before["active.all.freed"]:
            event("malloc completed a pending cross-stream free")
        if b.size >= self.M:
            event("oversize allocation")
        # Peaks (§16.1): within malloc these stats only fall (completed frees, releases) before
        # they rise (new segment, carve), so the new peak is max(old peak, new current).
        peaked = ["allocation", "allocated_bytes", "active", "active_bytes", "requested_bytes"]
        if not self.conf.expandable:
            peaked += ["segment", "reserved_bytes"]
        self._check_peaks(before, after, peaked)
        # Best fit (§7) when nothing pending could change the cache first.
        if oracle is not None:
            event("best-fit oracle: cache hit")
            assert ptr == oracle[0], \
                f"best fit: expected the free block at {oracle[0]:#x} (+{oracle[1]}), got {b!r}"
            assert new_allocs == 0 and retries == 0
            assert after["reserved_bytes.all.current"] == before["reserved_bytes.all.current"]
        elif no_hit and not self.conf.expandable:
            event("best-fit oracle: cache miss")
            assert new_allocs == 1, f"cache miss for {rounded} but {new_allocs} device allocations"
            seg = next(s for s in segments(a) if b in s.blocks)
            assert seg.blocks[0] is b and seg.size == alloc_size, \
                f"a fresh segment of {seg.size} bytes for rounded {rounded}, expected {alloc_size}"
            # The retry chain (§9 step 4, §11.2, §12) released exactly what the reference says.
            kind, released = plan
            if kind == "fits":
                if released:
                    event("GC / oversize-release oracle: released cached segments, no retry")
                assert retries == 0, "retried although GC / oversize release made room"
                assert after["num_device_free"] - before["num_device_free"] == len(released), \
                    f"released {after['num_device_free'] - before['num_device_free']} segments, " \
                    f"expected {[hex(x.ptr) for x in released]}"
                assert after["reserved_bytes.all.current"] == \
                    before["reserved_bytes.all.current"] - sum(x.size for x in released) + alloc_size
            else:
                assert retries == 1, "a full retry was needed but did not happen"

    def _ref_release_chain(self, pool, stream: int, rounded: int, alloc_size: int, dev_free: int,
                           total: int) -> tuple[str, list]:
        """What malloc must release before a new segment fits, for a non-expandable cache miss
        with no pending event: GC (§12) then release_available_cached_blocks (§11.2).
        ("fits", released blocks) when attempt 1 or 2 succeeds, ("retry", []) otherwise."""
        a = self.a
        released: list = []

        def fits() -> bool:
            freed = sum(b.size for b in released)
            return (dev_free + freed >= alloc_size
                    and (self.allowed is None or total - freed + alloc_size <= self.allowed))

        def order(p):
            return sorted(p.blocks.values(), key=lambda b: (b.stream, b.size, b.ptr))

        if self.gc_active:
            large = a.large_blocks
            clock = large.get_free_blocks_call_count + (1 if pool is large else 0)
            threshold = int(self.conf.gc * float(self.allowed))
            if total > threshold:
                target = total - threshold
                cands = [b for b in order(large)
                         if b.prev is None and b.next is None and b.expandable_segment is None]
                total_age = sum(clock - b.gc_count_base for b in cands)
                count = len(cands)
                reclaimed, freed_any = 0, True
                while reclaimed < target and freed_any and count > 0:
                    avg = total_age / count
                    freed_any = False
                    for b in cands:
                        age = clock - b.gc_count_base
                        if b not in released and float(age) >= avg:
                            freed_any = True
                            reclaimed += b.size
                            total_age -= age
                            count -= 1
                            released.append(b)
                if released:
                    event("GC released segments")
        if fits():
            return "fits", released
        if self.M == SIZE_MAX:
            return "retry", []
        target = max(rounded, self.M)
        blocks = [b for b in order(pool) if b not in released]
        i = next((k for k, b in enumerate(blocks) if (b.stream, b.size, b.ptr) >= (stream, target, 0)),
                 len(blocks))
        if i < len(blocks) and blocks[i].stream == stream and blocks[i].expandable_segment is None:
            released.append(blocks[i])
            ok = True
        else:
            got = 0
            j = i - 1
            while j >= 0 and got < target and blocks[j].size >= self.M and blocks[j].stream == stream:
                if blocks[j].expandable_segment is None:  # newest: expandable blocks are skipped
                    released.append(blocks[j])
                    got += blocks[j].size
                j -= 1
            ok = got >= target
        if ok and fits():
            return "fits", released
        return "retry", []

    @staticmethod
    def _check_peaks(before: dict[str, int], after: dict[str, int], names: list[str]) -> None:
        for name in names:
            for pk in ("all", "small_pool", "large_pool"):
                k = f"{name}.{pk}"
                want = max(before[k + ".peak"], after[k + ".current"])
                assert after[k + ".peak"] == want, f"{k}.peak is {after[k + '.peak']}, expected {want}"

    def _after_oom(self, e: OutOfMemoryError, n: int, stream: int, rounded: int, alloc_size: int,
                   before: dict[str, int], pending_before: int) -> None:
        a = self.a
        event("OOM")
        after = self.stats()
        msg = str(e)
        assert msg.startswith(f"CUDA out of memory. Tried to allocate {format_size(alloc_size)}. GPU 0 "), msg
        # The retry chain ran a full synchronisation: every pending free completed.
        assert not a.cuda_events
        self.pending.clear()
        assert after["num_ooms"] == before["num_ooms"] + 1
        assert after["num_alloc_retries"] == before["num_alloc_retries"] + 1
        assert after["num_sync_all_streams"] == before["num_sync_all_streams"] + 1
        exact = {k for k in before if k.startswith(("allocation.", "allocated_bytes.", "oversize_allocations."))}
        exact |= {"max_split_size"}
        for name in ("active", "active_bytes", "requested_bytes"):
            exact |= {k for k in before if k.startswith(name + ".") and k.endswith((".allocated", ".peak"))}
            for pk in ("all", "small_pool", "large_pool"):
                assert after[f"{name}.{pk}.current"] <= before[f"{name}.{pk}.current"]
        assert before["active_bytes.all.current"] - after["active_bytes.all.current"] == pending_before
        if not self.conf.expandable:
            exact |= {"num_device_alloc"}
            for name in ("segment", "reserved_bytes"):
                exact |= {k for k in before if k.startswith(name + ".") and k.endswith((".allocated", ".peak"))}
            exact |= {"oversize_segments.allocated", "oversize_segments.peak"}
        for k in exact:
            assert after[k] == before[k], f"OOM changed {k}: {before[k]} -> {after[k]}"
        # The OOM is genuine: after releasing the cache the request still cannot be backed.
        dev_free = self.device.mem_get_info()[0]
        over_fraction = self.allowed is not None and a.total_allocated_memory + alloc_size > self.allowed
        if self.conf.expandable:
            page = 2 * MiB if rounded <= MiB else a.config.large_segment_size
            need = -(-rounded // page) * page
            assert over_fraction or dev_free < need, \
                f"OOM for {rounded} bytes with {dev_free} bytes free on the device"
        else:
            assert over_fraction or dev_free < alloc_size, \
                f"OOM for a {alloc_size}-byte segment with {dev_free} bytes free on the device"
            # release_cached_blocks freed every whole cached segment
            for pool in (a.small_blocks, a.large_blocks):
                for blk in pool.blocks.values():
                    assert blk.prev is not None or blk.next is not None or blk.expandable_segment, \
                        f"whole free segment {blk!r} survived the OOM retry"

    # -- free -------------------------------------------------------------------------------
    @precondition(lambda self: self.a is not None and self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        ptr = data.draw(st.sampled_from(sorted(self.live)), label="ptr")
        self._free(ptr)

    def _free(self, ptr: int) -> None:
        a = self.a
        b = a.active[ptr]
        size, req, uses = b.size, b.requested_size, set(b.stream_uses or ())
        small = b.pool.is_small
        before = self.stats()
        a.free(ptr)
        after = self.stats()
        del self.live[ptr]
        self.freed.add(ptr)
        for pk in ("all", "small_pool" if small else "large_pool"):
            assert after[f"allocation.{pk}.current"] == before[f"allocation.{pk}.current"] - 1
            assert after[f"allocated_bytes.{pk}.current"] == before[f"allocated_bytes.{pk}.current"] - size
            if uses:
                assert after[f"active.{pk}.current"] == before[f"active.{pk}.current"]
                assert after[f"active_bytes.{pk}.current"] == before[f"active_bytes.{pk}.current"]
            else:
                assert after[f"active.{pk}.current"] == before[f"active.{pk}.current"] - 1
                assert after[f"active_bytes.{pk}.current"] == before[f"active_bytes.{pk}.current"] - size
                assert after[f"requested_bytes.{pk}.current"] == before[f"requested_bytes.{pk}.current"] - req
        assert after["oversize_allocations.current"] == before["oversize_allocations.current"] - (size >= self.M)
        for k in ("reserved_bytes.all.current", "segment.all.current", "num_device_alloc",
                  "num_device_free", "num_sync_all_streams"):
            assert after[k] == before[k], f"free changed {k}"
        self._check_peaks(before, after, ["allocation", "allocated_bytes", "active", "active_bytes",
                                          "requested_bytes", "segment", "reserved_bytes",
                                          "inactive_split", "inactive_split_bytes"])
        if uses:
            assert a.active.get(ptr) is b and not b.allocated and b.event_count == len(uses)
            self.pending[ptr] = set() if not self.conf.on_sync else set(uses)
        else:
            assert ptr not in a.active
            pool = b.pool
            assert any(f.ptr <= ptr < f.ptr + f.size for f in pool.blocks.values()), \
                "freed memory is not in its pool"

    # -- streams ----------------------------------------------------------------------------
    @precondition(lambda self: self.a is not None and self.live)
    @rule(data=st.data())
    def record_stream(self, data: st.DataObject) -> None:
        ptr = data.draw(st.sampled_from(sorted(self.live)), label="ptr")
        stream = data.draw(st.sampled_from(STREAMS), label="stream")
        self._record(ptr, stream)

    def _record(self, ptr: int, stream: int) -> None:
        a = self.a
        b = a.active[ptr]
        uses = set(b.stream_uses or ())
        stats = self.stats()
        a.record_stream(ptr, stream)
        assert self.stats() == stats, "record_stream changed the stats"
        if stream != b.stream:
            uses.add(stream)
        assert set(b.stream_uses or ()) == uses

    @precondition(lambda self: self.a is not None and self.live)
    @rule(data=st.data())
    def record_stream_then_free(self, data: st.DataObject) -> None:
        ptr = data.draw(st.sampled_from(sorted(self.live)), label="ptr")
        own = self.live[ptr][1]
        stream = data.draw(st.sampled_from([s for s in STREAMS if s != own]), label="stream")
        self._record(ptr, stream)
        self._free(ptr)

    @precondition(lambda self: self.a is not None)
    @rule(stream=st.one_of(st.none(), st.sampled_from(STREAMS)))
    def synchronize(self, stream: int | None) -> None:
        fp = state_fingerprint(self.a)
        self.device.synchronize(stream)
        assert state_fingerprint(self.a) == fp, "device.synchronize changed the allocator state"
        for streams in self.pending.values():
            if stream is None:
                streams.clear()
            else:
                streams.discard(stream)

    # -- release ----------------------------------------------------------------------------
    @precondition(lambda self: self.a is not None)
    @rule()
    def empty_cache(self) -> None:
        a = self.a
        before = self.stats()
        no_events = not a.cuda_events
        whole = [blk for pool in (a.large_blocks, a.small_blocks) for blk in pool.blocks.values()
                 if blk.prev is None and blk.next is None and blk.expandable_segment is None]
        a.empty_cache()
        after = self.stats()
        self.pending.clear()
        assert not a.cuda_events
        assert after["num_sync_all_streams"] == before["num_sync_all_streams"] + 1
        for k in before:
            if k.startswith(("allocation.", "allocated_bytes.", "oversize_allocations.")) or \
                    k in ("num_device_alloc", "num_ooms", "num_alloc_retries"):
                assert after[k] == before[k], f"empty_cache changed {k}"
        if no_events and not self.ever_expandable:
            assert after["num_device_free"] - before["num_device_free"] == len(whole)
            assert before["reserved_bytes.all.current"] - after["reserved_bytes.all.current"] == \
                sum(blk.size for blk in whole)
        for pool in (a.large_blocks, a.small_blocks):
            for blk in pool.blocks.values():
                es = blk.expandable_segment
                if es is None:
                    assert blk.prev is not None or blk.next is not None, \
                        f"empty_cache left the whole free segment {blk!r}"
                else:
                    page = es.page_size
                    first = -(-(blk.ptr - es.ptr) // page)
                    last = (blk.ptr + blk.size - es.ptr) // page
                    assert last <= first, f"empty_cache left a whole page mapped in free {blk!r}"

    @precondition(lambda self: self.a is not None)
    @rule()
    def reset_peak(self) -> None:
        before = self.stats()
        self.a.reset_peak_memory_stats()
        after = self.stats()
        for k, v in before.items():
            if k.endswith(".peak"):
                assert after[k] == after[k[:-5] + ".current"]
            else:
                assert after[k] == v

    @precondition(lambda self: self.a is not None and self.live)
    @rule()
    def free_everything(self) -> None:
        for ptr in sorted(self.live):
            self._free(ptr)

    # -- bad input --------------------------------------------------------------------------
    @precondition(lambda self: self.a is not None)
    @rule(data=st.data())
    def bad_input(self, data: st.DataObject) -> None:
        a = self.a
        unknown = [p for p in self.freed if p not in self.live]
        choices = ["neg", "float", "str", "stream_neg", "stream_float", "unknown", "interior",
                   "free_float", "record_unknown", "eb", "fraction_range", "fraction_type", "config"]
        if unknown:
            choices.append("double_free")
        if self.pending:
            choices += ["free_pending", "record_pending"]
        kind = data.draw(st.sampled_from(choices), label="kind")
        fp = state_fingerprint(a)
        stats = self.stats()
        live = sorted(self.live) or [0x7000_0000_0000]
        if kind == "neg":
            with pytest.raises(ValueError):
                a.malloc(data.draw(st.integers(-(1 << 62), -1), label="size"))
        elif kind == "float":
            with pytest.raises(TypeError):
                a.malloc(data.draw(st.sampled_from([1.0, 512.5, 1e6, float("nan")]), label="size"))
        elif kind == "bool":
            with pytest.raises(TypeError):
                a.malloc(True)
        elif kind == "str":
            with pytest.raises(TypeError):
                a.malloc("1024")
        elif kind == "stream_neg":
            with pytest.raises(ValueError):
                a.malloc(1024, -1)
        elif kind == "stream_float":
            with pytest.raises(TypeError):
                a.malloc(1024, 1.0)
        elif kind == "unknown":
            with pytest.raises(RuntimeError):
                a.free(data.draw(st.sampled_from([12345, 0x10, (1 << 50) + 512]), label="ptr"))
        elif kind == "interior":
            p = data.draw(st.sampled_from(live), label="ptr")
            with pytest.raises(RuntimeError):
                a.free(p + 256)  # never a block address (blocks are 512-aligned)
        elif kind == "free_float":
            with pytest.raises(TypeError):
                a.free(float(live[0]))
        elif kind == "record_unknown":
            with pytest.raises(RuntimeError):
                a.record_stream(12345, 7)
        elif kind == "double_free":
            with pytest.raises(RuntimeError):
                a.free(data.draw(st.sampled_from(sorted(unknown)), label="ptr"))
        elif kind == "free_pending":
            with pytest.raises(RuntimeError):
                a.free(data.draw(st.sampled_from(sorted(self.pending)), label="ptr"))
        elif kind == "record_pending":
            with pytest.raises(RuntimeError):
                a.record_stream(data.draw(st.sampled_from(sorted(self.pending)), label="ptr"), 7)
        elif kind == "eb":
            with pytest.raises(OutOfMemoryError, match="Tried to allocate more than 1EB memory"):
                a.malloc(data.draw(st.sampled_from([1 << 60, (1 << 60) + 1, 1 << 62]), label="size"))
        elif kind == "fraction_range":
            with pytest.raises(ValueError):
                a.set_memory_fraction(data.draw(st.sampled_from([-0.1, 1.5, float("nan")]), label="f"))
        elif kind == "fraction_type":
            with pytest.raises(TypeError):
                a.set_memory_fraction(data.draw(st.sampled_from(["0.5", None, True]), label="f"))
        elif kind == "config":
            text = data.draw(st.sampled_from([
                "max_split_size_mb:10", "max_split_size_mb:abc", "foo:1", "garbage_collection_threshold:1.5",
                "garbage_collection_threshold:0", "roundup_power2_divisions:3",
                "roundup_power2_divisions:[3:4]", "expandable_segments:maybe", "backend:magic",
                "expandable_segments:True,max_split_size_mb:5", "max_split_size_mb:64,bogus_key:1",
            ]), label="text")
            with pytest.raises(ValueError):
                a.set_allocator_settings(text)
        assert self.stats() == stats, f"rejected input ({kind}) changed memory_stats()"
        assert state_fingerprint(a) == fp, f"rejected input ({kind}) changed the allocator state"

    # -- end --------------------------------------------------------------------------------
    def teardown(self) -> None:
        a = self.a
        if a is None:
            return
        for ptr in sorted(self.live):
            self._free(ptr)
        self.device.synchronize()
        a.empty_cache()
        self.pending.clear()
        self.check()
        s = self.stats()
        for pk in ("all", "small_pool", "large_pool"):
            for name in ("allocation", "allocated_bytes", "active", "active_bytes", "requested_bytes",
                         "segment", "reserved_bytes", "inactive_split", "inactive_split_bytes"):
                assert s[f"{name}.{pk}.current"] == 0, f"{name}.{pk}.current is {s[f'{name}.{pk}.current']} at the end"
        if not self.reconfigured:
            assert s["oversize_allocations.current"] == 0 and s["oversize_segments.current"] == 0
        assert s["num_device_alloc"] == s["num_device_free"] or self.ever_expandable
        assert a.total_allocated_memory == 0
        assert self.device.used == 0
        assert not a.active and not a.cuda_events
        for pool in (a.small_blocks, a.large_blocks):
            assert not pool.blocks, f"free blocks left in the {pool.name} pool: {list(pool.blocks.values())}"
        # An expandable segment whose very first mapping failed (OOM) keeps its reserved virtual
        # range: release only walks the *mapped* free blocks (PyTorch's release_blocks does the
        # same; a request larger than the whole reserved range even leaves one per attempt).
        # Anything left must be entirely unmapped.
        if a.expandable_segments:
            event("never-mapped expandable segment left after empty_cache")
        for es in a.expandable_segments:
            assert es.mapped_pages == 0
        for pool in (a.small_blocks, a.large_blocks):
            for b in pool.unmapped.values():
                assert b.prev is None and b.next is None and b.size == b.expandable_segment.size


AllocatorMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("VRAM_SM_EXAMPLES", "200")),
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
TestAllocatorStateMachine = AllocatorMachine.TestCase


class ReconfiguringMachine(AllocatorMachine):
    """The same machine, plus valid ``set_allocator_settings`` calls at run time (§3.1): the
    rounding table, max_split_size, the GC threshold and expandable segments change under
    live allocations (toggling expandable segments off: §7 step 3, §14)."""

    @precondition(lambda self: self.a is not None)
    @rule(new=reconfs())
    def reconfigure(self, new: tuple[str, int, tuple[int, ...], float, bool | None]) -> None:
        text, max_split, table, gc, expandable = new
        a = self.a
        stats = self.stats()
        a.set_allocator_settings(text)
        assert self.stats() == stats, "set_allocator_settings changed the stats"
        if expandable is None:  # keys not named keep their previous values (§3.1)
            expandable = self.conf.expandable
        cfg = a.config
        assert cfg.max_split_size == max_split
        assert tuple(cfg.roundup_power2_divisions) == table
        assert cfg.garbage_collection_threshold == gc
        assert cfg.expandable_segments == expandable
        if expandable != self.conf.expandable:
            event(f"expandable segments toggled {'on' if expandable else 'off'} at run time")
        self.conf = replace(self.conf, text=text, max_split=max_split, table=table, gc=gc,
                            expandable=expandable)
        self.M = max_split
        self.reconfigured = True
        self.ever_expandable = self.ever_expandable or expandable


ReconfiguringMachine.TestCase.settings = settings(
    AllocatorMachine.TestCase.settings,
    max_examples=int(os.environ.get("VRAM_SM_RECONF_EXAMPLES", "100")),
)
TestReconfiguringStateMachine = ReconfiguringMachine.TestCase


# ------------------------------------------------------------------ the checker checks itself

def _busy_allocator(conf: str = "") -> CachingAllocator:
    a = CachingAllocator(SimulatedDevice(256 * MiB), alloc_conf=conf)
    ptrs = [a.malloc(n) for n in (1000, 3000, 5 * MiB, 30 * MiB, 700 * KiB)]
    a.free(ptrs[1])
    a.free(ptrs[2])
    check_invariants(a)
    return a


def test_checker_accepts_a_busy_allocator() -> None:
    for conf in ("", "expandable_segments:True", "max_split_size_mb:24,roundup_power2_divisions:4"):
        a = _busy_allocator(conf)
        q = a.malloc(2 * MiB, stream=7)
        a.record_stream(q, 13)
        a.free(q)
        check_invariants(a)
        a.empty_cache()
        check_invariants(a)


@pytest.mark.parametrize("corruption", [
    "stat", "pool_key", "lost_free_block", "unmerged", "link", "active", "device_used", "peak",
])
def test_checker_detects_corruption(corruption: str) -> None:
    a = _busy_allocator()
    free_block = next(iter(a.small_blocks.blocks.values()))
    if corruption == "stat":
        a.stats.allocated_bytes[1].current += 512
        a.stats.allocated_bytes[0].current += 512
    elif corruption == "pool_key":
        a.small_blocks.remove(free_block)
        free_block.size -= 512
        a.small_blocks.insert(free_block)
        free_block.size += 512
    elif corruption == "lost_free_block":
        a.small_blocks.remove(free_block)
    elif corruption == "unmerged":
        # split a free block in two free halves without merging them
        from vram.allocator.block import Block
        half = free_block.size // 2 // 512 * 512
        a.small_blocks.remove(free_block)
        other = Block(free_block.stream, free_block.size - half, free_block.pool, free_block.ptr + half)
        other.prev, other.next = free_block, free_block.next
        if free_block.next is not None:
            free_block.next.prev = other
        free_block.next = other
        free_block.size = half
        a.small_blocks.insert(free_block)
        a.small_blocks.insert(other)
    elif corruption == "link":
        b = next(b for b in a.active.values() if b.next is not None)
        b.next.prev = None
    elif corruption == "active":
        b = next(iter(a.active.values()))
        del a.active[b.ptr]
    elif corruption == "device_used":
        a.device.used += 2 * MiB
    elif corruption == "peak":
        a.stats.segment[2].peak = 0
    with pytest.raises(AssertionError):
        check_invariants(a)
