"""The Python replay loop: every recorded event through the allocator, in order (the readable
reference of the C core, `vram.replay.ccore`, which repeats it event for event).

``alloc`` is a malloc, ``free_requested`` a free (held back with an event on a pseudo stream when
the recording completes it later, as ``record_stream`` does), ``free_completed`` completes a held
back free, a run of ``segment_free`` / ``segment_unmap`` is one ``empty_cache()`` and ``oom`` is a
request that failed in the recording. `vram.replay.cycles` may apply periods that provably repeat
as deltas instead of replaying them.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from vram.allocator.block import SIZE_MASK, SIZE_SHIFT, STREAM_SHIFT
from vram.allocator.caching import ONE_EB, CachingAllocator
from vram.allocator.errors import OutOfMemoryError
from vram.devices.base import Event
from vram.devices.trace import TraceDevice

from .checks import Checks
from .cycles import CycleSkipper
from .pool_replay import PoolRouter
from .validate import RESERVED_STREAMS

if TYPE_CHECKING:
    from .engine import ReplayResult

#: pseudo streams that stand for "whatever the recording waited on" before a free completed;
#: the loader refuses recorded stream ids this large (`vram.replay.validate.RESERVED_STREAMS`)
PENDING_STREAM_BASE = RESERVED_STREAMS
#: at most this many pseudo streams: every malloc visits each stream with outstanding events
#: (spec §10.3), so one stream per held-back free would make a file of many held-back frees
#: quadratic. Beyond it, held-back frees share a stream and may complete late (noted).
MAX_PENDING_STREAMS = 64
_KEY_TOP = 1 << 192  # above every pool key (stream < 2**63, shifted by 128)
#: OOMs listed one by one in a result (all are counted in ``ooms``)
MAX_LISTED_OOMS = 100
#: a run of ``segment_free`` / ``segment_unmap`` is one ``empty_cache()`` (both are its release
#: steps, spec §11.1 and §14), so both share code 3
_CODES = {"alloc": 0, "free_requested": 1, "free_completed": 2, "segment_free": 3, "segment_unmap": 3,
          "oom": 4}


def compact_events(trace: Sequence[Mapping[str, Any]]) -> list[tuple[int, int, int, int]]:
    """(action code, address, size, stream) per event: what the replay acts on."""
    codes = _CODES
    return [(codes.get(e["action"], 5), e.get("addr", e.get("device_free", 0)), e["size"],
             e.get("stream", 0)) for e in trace]


def largest_free(alloc: CachingAllocator, budget: int | None = None) -> tuple[int, int]:
    """(the largest free block of either pool, streams visited). Pools are ordered by (stream,
    size, address) (spec §1), so each stream's largest is its last key: O(streams x log n), not
    a scan of every free block at every new reserved peak (quadratic in the trace). The size is
    -1 if it takes more than `budget` steps (a trace with very many streams)."""
    best = steps = 0
    for pool in (alloc.small_blocks, alloc.large_blocks):
        keys = pool.keys
        key = keys.floor_below(_KEY_TOP)
        while key is not None:
            best = max(best, (key >> SIZE_SHIFT) & SIZE_MASK)
            steps += 1
            if budget is not None and steps > budget:
                return -1, steps
            key = keys.floor_below((key >> STREAM_SHIFT) << STREAM_SHIFT)
    return best, steps


def largest_free_block(alloc: CachingAllocator) -> int:
    return largest_free(alloc)[0]


class ReplayDevice(TraceDevice):
    """A `TraceDevice` that keeps the last event it recorded (the replay completes it later) and,
    while a recorded OOM is replayed, reports the free memory the recording measured then."""

    last_event: Event | None = None
    #: replay the recording's ``oom`` events as failures (else: as requests that may succeed)
    reproduce_ooms = False
    #: the recorded ``device_free`` while a recorded OOM is replayed
    oom_free: int | None = None
    #: the GPU's capacity is known (``gpu=`` given): else an OOM reports the smallest consistent
    capacity_known = False
    #: event indices before which the replay calls ``empty_cache()`` (a what-if)
    empty_cache_at: frozenset[int] = frozenset()
    pool_router: PoolRouter | None = None  # routes requests to private pools (vram.replay.pool_replay)

    def record_event(self, stream: int) -> Event:
        event = self.last_event = super().record_event(stream)
        return event

    def mem_get_info(self) -> tuple[int, int]:
        """cudaMemGetInfo. At a recorded OOM: the recorded free bytes, and the capacity given, or
        else this process's segments + context + other processes + that free memory (the recording
        does not hold the capacity: the smallest GPU consistent with it)."""
        if self.oom_free is None:
            return super().mem_get_info()
        total = (self.total_memory if self.capacity_known
                 else self.used + self.context + self.other_used + self.oom_free)
        return self.oom_free, total


class EventLoop:
    """One replay of `trace` from the allocator's current state, into `result` (and `checks`
    when verifying). `live_at_start` holds the addresses of blocks live when the trace begins."""

    def __init__(self, alloc: CachingAllocator, dev: ReplayDevice, trace: Sequence[Mapping[str, Any]],
                 result: ReplayResult, checks: Checks | None, verify: bool, skip_cycles: bool,
                 live_at_start: set[int], track_peak: bool = True) -> None:
        self.alloc, self.dev, self.trace, self.result, self.checks = alloc, dev, trace, result, checks
        self.live_at_start, self.track_peak = live_at_start, track_peak
        router = dev.pool_router
        self.malloc: Callable[[int, int], int] = router.malloc if router else alloc.malloc
        self.empty: Callable[[], None] = router.empty_cache if router else alloc.empty_cache
        self.reserved, self.allocated = alloc.stats.reserved_bytes[0], alloc.stats.allocated_bytes[0]
        self.best_reserved = self.reserved.current  # the starting state is the first candidate for the peak
        result.allocated_at_reserved_peak = self.allocated.current
        result.largest_free_block_at_reserved_peak = largest_free_block(alloc)
        self.peak_steps = 0  # streams visited by largest_free: at most 4096 + 32 per event (so: linear)
        self.ptr_of: dict[int, int | None] = {}  # recorded address -> our address (None: the alloc failed)
        self.pending: dict[int, int] = {}  # recorded address -> pseudo stream of a held-back free
        self.events: dict[int, Event] = {}  # recorded address -> the event its free waits for
        self.busy: dict[int, int] = {}  # pseudo stream -> held-back frees on it (derived from `pending`)
        self.ev = compact_events(trace)
        self.timeline = result.timeline
        self.skipper = CycleSkipper(alloc, dev, alloc._gc_active(), verify) if skip_cycles else None
        self.anchor_checks: dict[int, tuple[int, int, int]] = {}
        self.in_empty_cache = False
        self.cache_points = dev.empty_cache_at

    def run(self, progress: Callable[[int, int], None] | None) -> None:
        """Every event in order (periods that provably repeat applied as deltas)."""
        ev, n = self.ev, len(self.ev)
        just_skipped = False
        next_progress = i = 0
        while i < n:
            if progress is not None and i >= next_progress:
                progress(i, n)
                next_progress = i + 0x10000
            if self.skipper is not None and ev[i][0] == 0 and not just_skipped:
                skipped = self._skip_periods(i)
                if skipped:
                    i += skipped
                    just_skipped = True
                    continue
            just_skipped = False
            i = self._step(i)
        self.result.skipped_events = self.skipper.skipped_events if self.skipper is not None else 0
        if progress is not None:
            progress(n, n)

    def _skip_periods(self, i: int) -> int:
        """At an anchor: the events skipped by applying the period that ends here as deltas, as
        many times as the trace repeats it (0 when it does not, or when a repeat must be listed)."""
        skipper, checks, ev, n = self.skipper, self.checks, self.ev, len(self.ev)
        assert skipper is not None
        if not (skipper.is_anchor(ev[i]) and skipper.affordable(i)):
            return 0
        fp = skipper.fingerprint(self.ptr_of, self.pending, tuple(sorted(self.live_at_start)))
        hit = skipper.check(i, ev[i], fp)
        if checks is not None:
            self.anchor_checks[i] = (checks.allocs_total, checks.allocs_matched, len(checks.divergences))
        if hit is None:
            return 0
        j, before = hit
        period = i - j
        pattern = ev[j:i]
        k = 0
        while i + (k + 1) * period <= n and ev[i + k * period:i + (k + 1) * period] == pattern:
            k += 1
        if checks is not None and self.anchor_checks.get(j, (0, 0, -1))[2] != len(checks.divergences):
            k = 0  # a period with divergences is replayed, so they are all listed
        if self.result.oom_events and self.result.oom_events[-1]["event_index"] >= j:
            k = 0  # so is a period with an OOM: each OOM is listed with its message
        if not k:
            return 0
        skipper.apply(before, k)
        if checks is not None:
            t0, m0, _ = self.anchor_checks[j]
            checks.allocs_total += (checks.allocs_total - t0) * k
            checks.allocs_matched += (checks.allocs_matched - m0) * k
        if self.timeline is not None:
            tl_alloc, tl_res = self.timeline
            seg_a, seg_r = tl_alloc[j:i], tl_res[j:i]
            for _ in range(k):
                tl_alloc.extend(seg_a)
                tl_res.extend(seg_r)
        skipper.skipped_events += k * period
        return k * period

    def _step(self, i: int) -> int:
        """Event `i` (with the completion that follows a free at once); the next event's index."""
        code, addr, size, stream = self.ev[i]
        nxt = i + 1
        cache_points = self.cache_points
        if cache_points and i in cache_points:
            self.alloc.empty_cache()
        if code != 3:
            self.in_empty_cache = False
        if code == 0:
            self._alloc(i, addr, size, stream)
        elif code == 1:
            nxt = self._free_requested(i, addr)
        elif code == 2:
            self._free_completed(addr)
        elif code == 3:  # segment_free / segment_unmap: a run of them is one empty_cache() call
            if not self.in_empty_cache:
                self.empty()
                self.in_empty_cache = True
        elif code == 4:
            self._recorded_oom(i, addr, size, stream)
        if self.timeline is not None:
            a_now, r_now = self.allocated.current, self.reserved.current
            tl_alloc, tl_res = self.timeline
            for _ in range(nxt - i):
                tl_alloc.append(a_now)
                tl_res.append(r_now)
        if cache_points and nxt > i + 1 and not cache_points.isdisjoint(range(i + 1, nxt)):
            self.alloc.empty_cache()  # a point inside events handled together (a free and its completion)
        return nxt

    def _alloc(self, i: int, addr: int, size: int, stream: int) -> None:
        result = self.result
        try:
            p = self.malloc(size, stream)
        except OutOfMemoryError as ex:
            p = None
            note_oom(result, self.alloc, self.trace, i, ex, size)
        self.ptr_of[addr] = p
        if self.checks is not None:
            self.checks.alloc(i, addr, p)
        if self.reserved.current > self.best_reserved:
            self.best_reserved = self.reserved.current
            result.reserved_peak_event = i
            result.allocated_at_reserved_peak = self.allocated.current
            if self.track_peak and (result.largest_free_block_at_reserved_peak or 0) >= 0:
                largest, steps = largest_free(self.alloc, 4096 + 32 * i - self.peak_steps)
                self.peak_steps += steps
                result.largest_free_block_at_reserved_peak = largest

    def _free_requested(self, i: int, addr: int) -> int:
        """A free: at once when the next event completes it, else held back with an event on a
        pseudo stream until its ``free_completed``; the next event's index."""
        alloc, checks, ev = self.alloc, self.checks, self.ev
        nxt = i + 1
        p = self.ptr_of.pop(addr, -1)
        if p == -1:  # not allocated in the trace: live at the start, or unknown (skipped)
            p = addr if addr in self.live_at_start else None
            self.live_at_start.discard(addr)
        block = alloc.active.get(p) if p else None
        if p is None or block is None or not block.allocated:
            if p and checks is not None:  # a trace that frees one block twice
                checks.note(i, "free", "a live block", "none at that address")
        elif nxt < len(ev) and ev[nxt][0] == 2 and ev[nxt][1] == addr:
            alloc.free(p)  # completes at once: the next event is its free_completed
            nxt += 1
        else:  # completes later: hold it back with an event, as record_stream does
            busy = self.busy
            pseudo = _pseudo_stream(busy)
            if pseudo is None:
                pseudo = min(busy, key=lambda s: (busy[s], s))
                if checks is not None and not checks.notes:
                    checks.notes.append(f"event {i}: more than {MAX_PENDING_STREAMS} frees held back "
                                        "at once share pseudo streams: some may complete late")
            alloc.record_stream(p, pseudo)
            self.dev.last_event = None
            alloc.free(p)
            old = self.pending.get(addr)
            if old is not None:  # a second free_requested before the first completed
                _release(busy, old)
            if self.dev.last_event is not None:
                self.pending[addr] = pseudo
                self.events[addr] = self.dev.last_event
                busy[pseudo] = busy.get(pseudo, 0) + 1
        return nxt

    def _free_completed(self, addr: int) -> None:
        alloc, dev = self.alloc, self.dev
        if addr in self.pending:
            pseudo = self.pending.pop(addr)
            event = self.events.pop(addr)
            if _release(self.busy, pseudo):
                dev.complete_events(pseudo)  # its only held-back free: complete the stream
            else:
                dev.synchronize_event(event)
            alloc.process_events()
        elif addr in self.live_at_start:  # free requested before the trace began, completing now
            self.live_at_start.discard(addr)
            block = alloc.active.get(addr)
            if block is not None and block.allocated:
                alloc.free(addr)
            elif block is not None:  # pending at the start (vram.replay.state): its event is done
                _complete_pending(alloc, dev, block)

    def _recorded_oom(self, i: int, free: int, size: int, stream: int) -> None:
        """A request that failed in the recording: under the recorded config the device fails as
        the real one did and reports its recorded free memory."""
        dev, checks = self.dev, self.checks
        if dev.reproduce_ooms:
            dev.fail_mallocs = True
            dev.oom_free = free
        try:
            p = self.malloc(size, stream)
            self.alloc.free(p)  # the program never got this tensor
            if checks is not None:
                checks.note(i, "oom", "OutOfMemoryError", "allocation succeeded")
        except OutOfMemoryError as ex:
            note_oom(self.result, self.alloc, self.trace, i, ex, size)
            if checks is not None:
                checks.ooms_matched += 1
        finally:
            dev.fail_mallocs = False
            dev.oom_free = None


def _complete_pending(alloc: CachingAllocator, dev: ReplayDevice, block: Any) -> None:
    """Complete the events of a block that was pending when the trace began, then free it."""
    for queue in alloc.cuda_events.values():
        for event, b in queue:
            if b is block:
                dev.synchronize_event(event)
    alloc.process_events()


def _pseudo_stream(busy: dict[int, int]) -> int | None:
    """The lowest pseudo stream with no held-back free on it (None when all are busy): a
    function of the replay state, so periods with held-back frees can still be skipped."""
    for k in range(MAX_PENDING_STREAMS):
        if PENDING_STREAM_BASE + k not in busy:
            return PENDING_STREAM_BASE + k
    return None


def _release(busy: dict[int, int], stream: int) -> bool:
    """One held-back free on `stream` is done; True if it was the stream's last."""
    left = busy[stream] - 1
    if left:
        busy[stream] = left
        return False
    del busy[stream]
    return True


def note_oom(result: ReplayResult, alloc: CachingAllocator, trace: Sequence[Mapping[str, Any]], i: int,
             ex: Exception, size: int) -> None:
    """Keep an OOM: where, PyTorch's message and its figures, and the recording's stack there. A
    request of 1 EiB or more is refused before the device allocator (``allocate``'s
    ``TORCH_CHECK_WITH(OutOfMemoryError, size < one_exa_bytes, ...)`` in CUDACachingAllocator.cpp),
    so ``num_ooms`` does not count it: it is counted here, and still an OOM of the replay."""
    if size >= ONE_EB:
        result.ooms += 1
    free, total = alloc.device.mem_get_info()
    record = {"event_index": i, "message": str(ex), "size": size, "recorded": trace[i]["action"] == "oom",
              "device_free": free, "device_total": total,
              "allocated": alloc.stats.allocated_bytes[0].current,
              "reserved": alloc.stats.reserved_bytes[0].current,
              "frames": list(trace[i].get("frames") or [])}
    if result.oom is None:
        result.oom = record
    if len(result.oom_events) < MAX_LISTED_OOMS:
        result.oom_events.append({k: v for k, v in record.items() if k != "frames"})
