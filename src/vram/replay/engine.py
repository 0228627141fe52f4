"""Layer 4: replay a recorded snapshot's trace through the allocator — what-if and verification.

`replay(snapshot, gpu=..., context=..., conf=..., verify=...)`:
1. rewinds the recording to the state at its first event (`vram.replay.rewind`) and installs it;
2. replays every ``alloc`` / ``free_requested`` / ``free_completed`` (per stream; a free whose
   completion the recording shows later is held back with an event, as ``record_stream`` does),
   ``segment_free`` runs (an ``empty_cache()`` call) and ``oom`` (a request that failed);
3. reports peaks, fragmentation at the reserved peak, driver calls, retries and the first OOM;
4. with ``verify=True``, compares event by event with the recording: every ``segment_alloc``
   (size, order, address), every ``alloc`` address, every ``segment_free``, and the final
   segments and blocks.

Segment addresses come from a `TraceDevice`: the recorded ones for as long as the replay asks
for the same segments, so under the recorded config differences come only from what changed.
"""
from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vram.allocator.block import SIZE_MASK, SIZE_SHIFT, STREAM_SHIFT
from vram.allocator.caching import ONE_EB, CachingAllocator
from vram.allocator.config import ConfigError, parse_alloc_conf
from vram.allocator.errors import OutOfMemoryError
from vram.devices.base import Event
from vram.devices.gpus import gpu_memory
from vram.devices.trace import TraceDevice
from vram.units import parse_size

from . import ccore, pool_search
from .checks import Checks
from .cycles import CycleSkipper
from .messages import SnapshotError, printable
from .pool_replay import PoolRouter, plan_pools
from .rewind import rewind
from .safe_pickle import gc_paused
from .state import import_segments
from .validate import RESERVED_STREAMS

#: capacity of the replay GPU when none is given: large enough for any recording
UNLIMITED = 1 << 40
#: pseudo streams that stand for "whatever the recording waited on" before a free completed;
#: the loader refuses recorded stream ids this large (`vram.replay.validate.RESERVED_STREAMS`)
PENDING_STREAM_BASE = RESERVED_STREAMS
#: at most this many pseudo streams: every malloc visits each stream with outstanding events
#: (spec §10.3), so one stream per held-back free would make a file of many held-back frees
#: quadratic. Beyond it, held-back frees share a stream and may complete late (noted).
MAX_PENDING_STREAMS = 64
_KEY_TOP = 1 << 192  # above every pool key (stream < 2**63, shifted by 128)


@dataclass
class ReplayResult:
    """What a replay found. Sizes in bytes."""

    conf: str
    gpu: int
    context: int
    device: int = 0
    events: int = 0
    #: wall time of the whole `replay` call: rewind, state import, the events, verification
    seconds_replay: float = 0.0
    peak_allocated: int = 0
    peak_requested: int = 0
    peak_reserved: int = 0
    peak_device_used: int = 0
    allocated_at_reserved_peak: int = 0
    largest_free_block_at_reserved_peak: int = 0
    segment_allocs: int = 0
    segment_frees: int = 0
    alloc_retries: int = 0
    ooms: int = 0
    oom: dict[str, Any] | None = None
    oom_events: list[dict[str, Any]] = field(default_factory=list)
    final_allocated: int = 0
    final_reserved: int = 0
    verification: dict[str, Any] | None = None
    reserved_peak_event: int = -1
    skipped_events: int = 0
    #: which engine replayed the events: "C" (`vram.replay.ccore`) or "Python (why not C)"
    engine: str = field(default="", repr=False, compare=False)
    allocator: CachingAllocator | None = field(default=None, repr=False)
    timeline: tuple[array, array] | None = field(default=None, repr=False)

    @property
    def fragmentation_at_reserved_peak(self) -> int:
        return self.peak_reserved - self.allocated_at_reserved_peak

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items()
               if k not in ("allocator", "verification", "timeline", "engine")}
        out["fragmentation_at_reserved_peak"] = self.fragmentation_at_reserved_peak
        if self.verification is not None:
            out.update(self.verification)
        return out


def _recorded_conf(snapshot: Mapping[str, Any]) -> str:
    settings = snapshot.get("allocator_settings") or {}
    conf = settings.get("PYTORCH_CUDA_ALLOC_CONF", "")
    return conf if isinstance(conf, str) else ""


def _recorded_rules(recorded_conf: str, what_if: bool) -> tuple[list[int], bool]:
    """The recording's ``roundup_power2_divisions`` and ``expandable_segments`` (rewind infers
    block sizes with them). A recorded string vram cannot parse is the file's problem: a
    `SnapshotError` naming the field when replaying under it, else (another config was asked
    for) the defaults."""
    try:
        cfg = parse_alloc_conf(recorded_conf)
        return cfg.roundup_power2_divisions, cfg.expandable_segments
    except ConfigError as exc:
        if what_if:
            return [0] * 16, False
        raise SnapshotError(f"allocator_settings.PYTORCH_CUDA_ALLOC_CONF "
                            f"{printable(recorded_conf, 60)!r} cannot be replayed: "
                            f"{printable(str(exc), 200)} (pass a config to replay under instead)") from None


class _ReplayDevice(TraceDevice):
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


def replay(snapshot: Mapping[str, Any], *, gpu: int | str | None = None, context: int | str = 0,
           conf: str | None = None, verify: bool = False, device: int = 0,
           progress: Callable[[int, int], None] | None = None, stop_at: int | None = None,
           timeline: bool = False, skip_cycles: bool = True,
           empty_cache_at: Collection[int] = ()) -> ReplayResult:
    """Replay one device's trace of `snapshot` (a loaded snapshot dict); see the module doc.

    `conf` None means the recording's own ``PYTORCH_CUDA_ALLOC_CONF``; `gpu` None means a GPU
    large enough for anything (1 TiB). `stop_at` replays only events before that index (the
    allocator is left in that state: ``result.allocator``). `timeline` keeps allocated and
    reserved bytes after every event (``result.timeline``). `skip_cycles` lets the Python engine
    apply periods that provably repeat as deltas instead of replaying them (`vram.replay.cycles`);
    results are identical either way. Where the C core (`vram.replay.ccore`) models the replay it
    runs instead, every event (it is 3-6x faster than skipping, on periodic traces too: README,
    Speed), and ``skipped_events`` is 0. `empty_cache_at` calls ``empty_cache()`` before each of those event
    indices (a what-if: the program calling it there).

    The recording's ``oom`` events (requests that failed) are reproduced under the recorded config
    on the recorded GPU (`conf` and `gpu` None) and when verifying: the device fails as the real one
    did and reports the ``device_free`` recorded, so PyTorch's message has the recorded figures
    (spec §15; CUDACachingAllocator.cpp records ``device_free`` from cudaMemGetInfo just before it
    formats the message). Otherwise they are requests that may now succeed (then freed at once:
    the program never got the tensor).
    """
    t0 = time.perf_counter()  # `seconds_replay` covers all the caller waits for, rewind included
    if device < 0:
        raise ValueError(f"device must be >= 0, not {device}")
    devices = device_count(snapshot)
    if device >= devices:
        raise ValueError(f"device {device} is not in the snapshot: it records {devices} device(s) (0..{devices - 1})")
    recorded_conf = _recorded_conf(snapshot)
    conf_text = recorded_conf if conf is None else conf
    total = UNLIMITED if gpu is None else gpu_memory(gpu)
    ctx = parse_size(context, "context")
    traces = snapshot.get("device_traces") or []
    trace: Sequence[Mapping[str, Any]] = traces[device] if device < len(traces) else []
    final = [s for s in snapshot.get("segments", []) if s.get("device", 0) == device]
    scan = ccore.scan(trace)  # every event read once, in C, for the rewind and the C loop (None: not here)
    unknown = pool_search.to_infer(final, trace, device, scan.first_pool_id if scan else 0)
    if unknown is not None:  # an older recording whose pools are found by replay: vram.replay.pool_search
        return pool_search.agree([replay(s, gpu=gpu, context=context, conf=conf, verify=verify, device=device,
                                         progress=progress, stop_at=stop_at, timeline=timeline,
                                         skip_cycles=skip_cycles, empty_cache_at=empty_cache_at)
                                  for s in pool_search.labellings(snapshot, device, unknown, replay)], device)
    plan = plan_pools(final, trace, device, scan.first_pool_id if scan else 0)  # private pools: pool_replay
    if final or not trace:
        divisions, expandable = _recorded_rules(recorded_conf, conf is not None)
        with gc_paused():  # it makes a tuple per live block and no garbage cycles (see `gc_paused`)
            initial = rewind(final, trace, divisions, device, expandable, plan is not None, scan)
    else:  # no segment layout (an RMM log): the trace is taken to start from an empty allocator
        initial = []
    recorded, recorded_maps = (scan.segment_allocs, scan.segment_maps) if scan else (
        [(e["addr"], e["size"]) for e in trace if e["action"] == "segment_alloc"],
        [(e["addr"], e["size"]) for e in trace if e["action"] == "segment_map"])
    if stop_at is not None:
        if not 0 <= stop_at <= len(trace):
            raise ValueError(f"event index {stop_at} is outside the trace (0..{len(trace)})")
        trace = trace[:stop_at]

    def start() -> tuple[_ReplayDevice, CachingAllocator, set[int]]:
        dev = _ReplayDevice(recorded, total, ctx, device, recorded_maps=recorded_maps)
        dev.reproduce_ooms = verify or (conf is None and gpu is None)
        dev.capacity_known = gpu is not None
        dev.unbounded_address_space = gpu is None  # (a stand-in size: vram.devices.trace)
        dev.empty_cache_at = frozenset(empty_cache_at)
        alloc = CachingAllocator(dev, conf_text)
        import_segments(alloc, initial)
        dev.pool_router = plan.router(alloc) if plan is not None else None
        return dev, alloc, {b["address"] for seg in initial for b in seg["blocks"] if b["state"] != "inactive"}

    if empty_cache_at or plan is not None:
        skip_cycles = False  # the periods are no longer the recording's (or pools are routed)

    def play(events: Sequence[Mapping[str, Any]], with_checks: bool, prog: Callable[[int, int], None] | None,
             track_peak: bool) -> tuple[_ReplayDevice, CachingAllocator, ReplayResult, Checks | None]:
        """Replay `events` from the start state: in C where `vram.replay.ccore` models it, else (or
        when the C loop stops on the way: then from a fresh start) in Python."""
        why = None
        for use_c in (True, False):
            dev, alloc, live = start()
            res = ReplayResult(conf=conf_text, gpu=total, context=ctx, device=device, allocator=alloc)
            checks = Checks(events, scan.rare if scan else None) if with_checks else None
            if timeline and track_peak:
                res.timeline = (array("q"), array("q"))
            if use_c:
                why = ccore.unsupported(alloc, dev, empty_cache_at=empty_cache_at)
                touched = False
                if why is None:
                    why, touched = ccore.run(alloc, dev, scan, len(events), res, checks, verify, prog, live,
                                             track_peak)
                    if why is None:
                        res.engine = "C"
                        return dev, alloc, res, checks
                if touched:
                    continue
            res.engine = f"Python ({why})"
            _run(alloc, dev, events, res, checks, verify, prog, skip_cycles, live, track_peak=track_peak)
            return dev, alloc, res, checks
        raise AssertionError("unreachable")

    with gc_paused():  # the replay makes no garbage cycles: see `gc_paused`
        dev, alloc, result, checks = play(trace, verify, progress, True)
        if result.largest_free_block_at_reserved_peak < 0:  # too many streams to track it on the go:
            # replay again up to the peak (the replay is deterministic)
            _, alloc2, _, _ = play(trace[:result.reserved_peak_event + 1], False, None, False)
            result.largest_free_block_at_reserved_peak = _largest_free_block(alloc2)
    stats = alloc.stats
    result.events = len(trace)
    result.peak_allocated = stats.allocated_bytes[0].peak
    result.peak_reserved = stats.reserved_bytes[0].peak
    result.peak_requested = stats.requested_bytes[0].peak
    result.peak_device_used = result.peak_reserved + ctx + dev.other_used
    result.segment_allocs = stats.num_device_alloc
    result.segment_frees = stats.num_device_free
    result.alloc_retries = stats.num_alloc_retries
    result.ooms += stats.num_ooms  # (+ the requests refused before the allocator: `_note_oom`)
    result.final_allocated = stats.allocated_bytes[0].current
    result.final_reserved = stats.reserved_bytes[0].current
    if checks is not None:
        result.verification = checks.finish(alloc, dev, final, recorded, live_at_start={
            b["address"] for seg in initial for b in seg["blocks"] if b["state"] != "inactive"})
        result.verification["segments_on_other_devices"] = sum(
            1 for s in snapshot.get("segments", []) if s.get("device", 0) != device)
    result.seconds_replay = time.perf_counter() - t0
    return result


def device_count(snapshot: Mapping[str, Any]) -> int:
    """How many devices a snapshot records: its traces, or its segments' highest index + 1."""
    return max(len(snapshot.get("device_traces") or []),
               1 + max((s.get("device", 0) for s in snapshot.get("segments", [])), default=0))


def recorded_devices(snapshot: Mapping[str, Any]) -> list[int]:
    """The devices a snapshot records anything on (events, or segments), in order; device 0 when
    none does. A device with neither has nothing to replay: its replay is all zeros, so the work
    of replaying "every device" stays bounded by what the file holds, not by its count of traces."""
    traces = snapshot.get("device_traces") or []
    used = {d for d, t in enumerate(traces) if t} | {s.get("device", 0) for s in snapshot.get("segments", [])}
    return sorted(used) or [0]


def _largest_free(alloc: CachingAllocator, budget: int | None = None) -> tuple[int, int]:
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


def _largest_free_block(alloc: CachingAllocator) -> int:
    return _largest_free(alloc)[0]


#: a run of ``segment_free`` / ``segment_unmap`` is one ``empty_cache()`` (both are its release
#: steps, spec §11.1 and §14), so both share code 3
_CODES = {"alloc": 0, "free_requested": 1, "free_completed": 2, "segment_free": 3, "segment_unmap": 3,
          "oom": 4}


def compact_events(trace: Sequence[Mapping[str, Any]]) -> list[tuple[int, int, int, int]]:
    """(action code, address, size, stream) per event: what the replay acts on."""
    codes = _CODES
    return [(codes.get(e["action"], 5), e.get("addr", e.get("device_free", 0)), e["size"],
             e.get("stream", 0)) for e in trace]


def _run(alloc: CachingAllocator, dev: _ReplayDevice, trace: Sequence[Mapping[str, Any]],
         result: ReplayResult, checks: Checks | None, verify: bool,
         progress: Callable[[int, int], None] | None, skip_cycles: bool,
         live_at_start: set[int], track_peak: bool = True) -> None:
    free, active, router = alloc.free, alloc.active, dev.pool_router
    malloc, empty = (router.malloc, router.empty_cache) if router else (alloc.malloc, alloc.empty_cache)
    reserved = alloc.stats.reserved_bytes[0]
    allocated = alloc.stats.allocated_bytes[0]
    best_reserved = reserved.current  # the starting state is the first candidate for the peak
    result.allocated_at_reserved_peak = allocated.current
    result.largest_free_block_at_reserved_peak = _largest_free_block(alloc)
    peak_steps = 0  # streams visited by _largest_free: at most 4096 + 32 per event (so: linear)
    ptr_of: dict[int, int | None] = {}  # recorded address -> our address (None: the alloc failed)
    pending: dict[int, int] = {}  # recorded address -> pseudo stream of a held-back free
    events: dict[int, Event] = {}  # recorded address -> the event its free waits for
    busy: dict[int, int] = {}  # pseudo stream -> held-back frees on it (derived from `pending`)
    ev = compact_events(trace)
    n = len(ev)
    tl_alloc, tl_res = result.timeline if result.timeline is not None else (None, None)
    skipper = CycleSkipper(alloc, dev, alloc._gc_active(), verify) if skip_cycles else None
    anchor_checks: dict[int, tuple[int, int, int]] = {}
    in_empty_cache = False
    reproduce = dev.reproduce_ooms
    cache_points = dev.empty_cache_at
    just_skipped = False
    next_progress = 0
    i = 0
    while i < n:
        if progress is not None and i >= next_progress:
            progress(i, n)
            next_progress = i + 0x10000
        code, addr, size, stream = ev[i]
        if (skipper is not None and code == 0 and not just_skipped and skipper.is_anchor(ev[i])
                and skipper.affordable(i)):
            fp = skipper.fingerprint(ptr_of, pending, tuple(sorted(live_at_start)))
            hit = skipper.check(i, ev[i], fp)
            if checks is not None:
                anchor_checks[i] = (checks.allocs_total, checks.allocs_matched, len(checks.divergences))
            if hit is not None:
                j, before = hit
                period = i - j
                pattern = ev[j:i]
                k = 0
                while i + (k + 1) * period <= n and ev[i + k * period:i + (k + 1) * period] == pattern:
                    k += 1
                if checks is not None and anchor_checks.get(j, (0, 0, -1))[2] != len(checks.divergences):
                    k = 0  # a period with divergences is replayed, so they are all listed
                if result.oom_events and result.oom_events[-1]["event_index"] >= j:
                    k = 0  # so is a period with an OOM: each OOM is listed with its message
                if k:
                    skipper.apply(before, k)
                    if checks is not None:
                        t0, m0, _ = anchor_checks[j]
                        checks.allocs_total += (checks.allocs_total - t0) * k
                        checks.allocs_matched += (checks.allocs_matched - m0) * k
                    if tl_alloc is not None and tl_res is not None:
                        seg_a, seg_r = tl_alloc[j:i], tl_res[j:i]
                        for _ in range(k):
                            tl_alloc.extend(seg_a)
                            tl_res.extend(seg_r)
                    skipper.skipped_events += k * period
                    i += k * period
                    just_skipped = True
                    continue
        just_skipped = False
        nxt = i + 1
        if cache_points and i in cache_points:
            alloc.empty_cache()
        if code != 3:
            in_empty_cache = False
        if code == 0:  # alloc
            try:
                p = malloc(size, stream)
            except OutOfMemoryError as ex:
                p = None
                _note_oom(result, alloc, trace, i, ex, size)
            ptr_of[addr] = p
            if checks is not None:
                checks.alloc(i, addr, p)
            if reserved.current > best_reserved:
                best_reserved = reserved.current
                result.reserved_peak_event = i
                result.allocated_at_reserved_peak = allocated.current
                if track_peak and result.largest_free_block_at_reserved_peak >= 0:
                    largest, steps = _largest_free(alloc, 4096 + 32 * i - peak_steps)
                    peak_steps += steps
                    result.largest_free_block_at_reserved_peak = largest
        elif code == 1:  # free_requested
            p = ptr_of.pop(addr, -1)
            if p == -1:  # not allocated in the trace: live at the start, or unknown (skipped)
                p = addr if addr in live_at_start else None
                live_at_start.discard(addr)
            block = active.get(p) if p else None
            if p is None or block is None or not block.allocated:
                if p and checks is not None:  # a trace that frees one block twice
                    checks.note(i, "free", "a live block", "none at that address")
            elif nxt < n and ev[nxt][0] == 2 and ev[nxt][1] == addr:
                free(p)  # completes at once: the next event is its free_completed
                nxt += 1
            else:  # completes later: hold it back with an event, as record_stream does
                pseudo = _pseudo_stream(busy)
                if pseudo is None:
                    pseudo = min(busy, key=lambda s: (busy[s], s))
                    if checks is not None and not checks.notes:
                        checks.notes.append(f"event {i}: more than {MAX_PENDING_STREAMS} frees held back "
                                            "at once share pseudo streams: some may complete late")
                alloc.record_stream(p, pseudo)
                dev.last_event = None
                free(p)
                old = pending.get(addr)
                if old is not None:  # a second free_requested before the first completed
                    _release(busy, old)
                if dev.last_event is not None:
                    pending[addr] = pseudo
                    events[addr] = dev.last_event
                    busy[pseudo] = busy.get(pseudo, 0) + 1
        elif code == 2:  # free_completed
            if addr in pending:
                pseudo = pending.pop(addr)
                event = events.pop(addr)
                if _release(busy, pseudo):
                    dev.complete_events(pseudo)  # its only held-back free: complete the stream
                else:
                    dev.synchronize_event(event)
                alloc.process_events()
            elif addr in live_at_start:  # free requested before the trace began, completing now
                live_at_start.discard(addr)
                block = active.get(addr)
                if block is not None and block.allocated:
                    free(addr)
                elif block is not None:  # pending at the start (vram.replay.state): its event is done
                    _complete_pending(alloc, dev, block)
        elif code == 3:  # segment_free / segment_unmap: a run of them is one empty_cache() call
            if not in_empty_cache:
                empty()
                in_empty_cache = True
        elif code == 4:  # oom: a request that failed in the recording
            if reproduce:  # the device fails as the real one did, and reports its recorded free
                dev.fail_mallocs = True
                dev.oom_free = addr
            try:
                p = malloc(size, stream)
                free(p)  # the program never got this tensor
                if checks is not None:
                    checks.note(i, "oom", "OutOfMemoryError", "allocation succeeded")
            except OutOfMemoryError as ex:
                _note_oom(result, alloc, trace, i, ex, size)
                if checks is not None:
                    checks.ooms_matched += 1
            finally:
                dev.fail_mallocs = False
                dev.oom_free = None
        if tl_alloc is not None and tl_res is not None:
            a_now, r_now = allocated.current, reserved.current
            for _ in range(nxt - i):
                tl_alloc.append(a_now)
                tl_res.append(r_now)
        if cache_points and nxt > i + 1 and not cache_points.isdisjoint(range(i + 1, nxt)):
            alloc.empty_cache()  # a point inside events handled together (a free and its completion)
        i = nxt
    result.skipped_events = skipper.skipped_events if skipper is not None else 0
    if progress is not None:
        progress(n, n)


def _complete_pending(alloc: CachingAllocator, dev: _ReplayDevice, block: Any) -> None:
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


#: OOMs listed one by one in a result (all are counted in ``ooms``)
MAX_LISTED_OOMS = 100


def _note_oom(result: ReplayResult, alloc: CachingAllocator, trace: Sequence[Mapping[str, Any]], i: int,
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
