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

from vram.allocator.caching import CachingAllocator
from vram.allocator.config import ConfigError, parse_alloc_conf
from vram.devices.gpus import gpu_memory
from vram.units import format_size, parse_size

from . import ccore, pool_search
from .checks import Checks
from .gc_pause import gc_paused
from .loop import EventLoop, ReplayDevice, largest_free_block
from .messages import SnapshotError, printable
from .pool_replay import plan_pools
from .rewind import rewind
from .state import import_segments

#: capacity of the replay GPU when none is given: large enough for any recording
UNLIMITED = 1 << 40


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
    #: None where it depends on facts the recording lacks (``notes`` says which)
    largest_free_block_at_reserved_peak: int | None = 0
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
    #: what the recording does not say and how the replay dealt with it (figures withheld)
    caveats: list[str] = field(default_factory=list)
    #: which engine replayed the events: "C" (`vram.replay.ccore`) or "Python (why not C)"
    engine: str = field(default="", repr=False, compare=False)
    allocator: CachingAllocator | None = field(default=None, repr=False)
    timeline: tuple[array, array] | None = field(default=None, repr=False)

    @property
    def fragmentation_at_reserved_peak(self) -> int:
        return self.peak_reserved - self.allocated_at_reserved_peak

    def _facts(self) -> list[tuple[str, str]]:
        oom = "none" if self.oom is None else f"{self.ooms:,} (first at event {self.oom['event_index']:,})"
        return [("config", self.conf or "default"), ("events", f"{self.events:,}"),
                ("GPU", "no limit" if self.gpu >= UNLIMITED else format_size(self.gpu)),
                ("peak allocated", format_size(self.peak_allocated)),
                ("peak reserved", format_size(self.peak_reserved)),
                ("peak nvidia-smi (reserved + context)", format_size(self.peak_device_used)), ("OOMs", oom)]

    def __repr__(self) -> str:
        """One line a notebook or a log can show: config, events, peaks and OOMs."""
        return "<ReplayResult " + ", ".join(f"{k} {v}" for k, v in self._facts()) + ">"

    def _repr_html_(self) -> str:
        from html import escape

        rows = "".join(f"<tr><th style='text-align:left'>{escape(k)}</th><td>{escape(v)}</td></tr>"
                       for k, v in self._facts())
        return f"<table>{rows}</table>"

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


def replay(snapshot: Mapping[str, Any], *, gpu: int | str | None = None, context: int | str = 0,
           conf: str | None = None, verify: bool = False, device: int = 0,
           progress: Callable[[int, int], None] | None = None, stop_at: int | None = None,
           timeline: bool = False, skip_cycles: bool = True,
           empty_cache_at: Collection[int] = (), cap: int | None = None) -> ReplayResult:
    """Replay one device's trace of `snapshot` (a loaded snapshot dict); see the module doc.

    `conf` None means the recording's own ``PYTORCH_CUDA_ALLOC_CONF``; `gpu` None means a GPU
    large enough for anything (1 TiB). `stop_at` replays only events before that index (the
    allocator is left in that state: ``result.allocator``). `timeline` keeps allocated and
    reserved bytes after every event (``result.timeline``). `skip_cycles` lets the Python engine
    apply periods that provably repeat as deltas instead of replaying them (`vram.replay.cycles`);
    results are identical either way. Where the C core (`vram.replay.ccore`) models the replay it
    runs instead, every event (it is 3-6x faster than skipping, on periodic traces too: README,
    Speed), and ``skipped_events`` is 0. `empty_cache_at` calls ``empty_cache()`` before each of those event
    indices (a what-if: the program calling it there). `cap` is a per-process cap in bytes
    (``allowed_memory_maximum``, as ``set_per_process_memory_fraction`` sets it): a what-if where
    every new segment is checked whole against it before the device is asked (``alloc_block``).

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
        what_if = ((conf is not None and conf != recorded_conf) or gpu is not None or bool(empty_cache_at)
                   or cap is not None)
        asked = dict(gpu=gpu, context=context, conf=conf, verify=verify, device=device, progress=progress,
                     stop_at=stop_at, timeline=timeline, skip_cycles=skip_cycles, empty_cache_at=empty_cache_at,
                     cap=cap)
        return pool_search.decide(pool_search.labellings(snapshot, device, unknown, replay),
                                  lambda s, **over: replay(s, **{**asked, **over}), device, what_if)
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

    if empty_cache_at or plan is not None:
        skip_cycles = False  # the periods are no longer the recording's (or pools are routed)
    floor = None if gpu is not None or not _expandable(conf_text) else recorded_gpu_floor(initial, trace, ctx)
    setup = _Setup(recorded, recorded_maps, total, ctx, device, conf_text, initial, plan, scan, floor,
                   reproduce_ooms=verify or (conf is None and gpu is None and cap is None),
                   capacity_known=gpu is not None, empty_cache_at=frozenset(empty_cache_at), cap=cap,
                   timeline=timeline, skip_cycles=skip_cycles, verify=verify)
    with gc_paused():  # the replay makes no garbage cycles: see `gc_paused`
        dev, alloc, result, checks = _play(setup, trace, verify, progress, True)
        if (result.largest_free_block_at_reserved_peak or 0) < 0:  # too many streams to track it on the go:
            # replay again up to the peak (the replay is deterministic)
            _, alloc2, _, _ = _play(setup, trace[:result.reserved_peak_event + 1], False, None, False)
            result.largest_free_block_at_reserved_peak = largest_free_block(alloc2)
    _finish(result, alloc, dev, checks, snapshot, final, setup, len(trace))
    result.seconds_replay = time.perf_counter() - t0
    return result


@dataclass
class _Setup:
    """What every replay of one call starts from: the recording's segment addresses, the GPU and
    config asked for, the state at the first event, the private pools' plan."""
    recorded: list[tuple[int, int]]
    recorded_maps: list[tuple[int, int]]
    total: int
    ctx: int
    device: int
    conf_text: str
    initial: list[dict[str, Any]]
    plan: Any
    scan: Any
    recorded_total: int | None  #: the least memory the recording's GPU had (`recorded_gpu_floor`)
    reproduce_ooms: bool
    capacity_known: bool
    empty_cache_at: frozenset[int]
    cap: int | None
    timeline: bool
    skip_cycles: bool
    verify: bool


def _start(setup: _Setup) -> tuple[ReplayDevice, CachingAllocator, set[int]]:
    """A fresh device and allocator in the state at the first event, and the addresses of the
    blocks live there."""
    dev = ReplayDevice(setup.recorded, setup.total, setup.ctx, setup.device, recorded_maps=setup.recorded_maps)
    dev.reproduce_ooms = setup.reproduce_ooms
    dev.capacity_known = setup.capacity_known
    dev.unbounded_address_space = not setup.capacity_known  # (a stand-in size: vram.devices.trace)
    dev.recorded_total_memory = setup.recorded_total
    dev.empty_cache_at = setup.empty_cache_at
    alloc = CachingAllocator(dev, setup.conf_text)
    if setup.cap is not None:
        alloc.allowed_memory_maximum = setup.cap
    import_segments(alloc, setup.initial)
    dev.pool_router = setup.plan.router(alloc) if setup.plan is not None else None
    return dev, alloc, {b["address"] for seg in setup.initial for b in seg["blocks"] if b["state"] != "inactive"}


def _expandable(conf_text: str) -> bool:
    try:
        return parse_alloc_conf(conf_text).expandable_segments
    except ConfigError:
        return False


def recorded_gpu_floor(initial: Sequence[Mapping[str, Any]], trace: Sequence[Mapping[str, Any]],
                       context: int) -> int | None:
    """The least memory the recording's GPU can have had, from its ``oom`` events: the free bytes
    each recorded (``device_free``, cudaMemGetInfo's answer just before the message, kept as the
    event's ``addr``) plus this process's reserved bytes then and the context; None without one.
    Expandable segments reserve 1 1/8 of the card each (``ExpandableSegment``), so on a GPU of
    unknown size this sizes their ranges: a request larger than the real range makes a new
    segment, and later requests go to whichever range has the lower address, as on the card."""
    reserved = sum(s["total_size"] for s in initial)
    floor = None
    for e in trace:
        action = e["action"]
        if action == "segment_map" or action == "segment_alloc":
            reserved += e["size"]
        elif action == "segment_unmap" or action == "segment_free":
            reserved -= e["size"]
        elif action == "oom":
            floor = max(floor or 0, reserved + e["addr"] + context)
    return floor


def _play(setup: _Setup, events: Sequence[Mapping[str, Any]], with_checks: bool,
          prog: Callable[[int, int], None] | None,
          track_peak: bool) -> tuple[ReplayDevice, CachingAllocator, ReplayResult, Checks | None]:
    """Replay `events` from the start state: in C where `vram.replay.ccore` models it, else (or
    when the C loop stops on the way: then from a fresh start) in Python."""
    why = None
    scan = setup.scan
    for use_c in (True, False):
        dev, alloc, live = _start(setup)
        res = ReplayResult(conf=setup.conf_text, gpu=setup.total, context=setup.ctx, device=setup.device,
                           allocator=alloc)
        checks = Checks(events, scan.rare if scan else None) if with_checks else None
        if setup.timeline and track_peak:
            res.timeline = (array("q"), array("q"))
        if use_c:
            why = ccore.unsupported(alloc, dev, empty_cache_at=setup.empty_cache_at)
            touched = False
            if why is None:
                why, touched = ccore.run(alloc, dev, scan, len(events), res, checks, setup.verify, prog, live,
                                         track_peak)
                if why is None:
                    res.engine = "C"
                    return dev, alloc, res, checks
            if touched:
                continue
        res.engine = f"Python ({why})"
        EventLoop(alloc, dev, events, res, checks, setup.verify, setup.skip_cycles, live, track_peak).run(prog)
        return dev, alloc, res, checks
    raise AssertionError("unreachable")


def _finish(result: ReplayResult, alloc: CachingAllocator, dev: ReplayDevice, checks: Checks | None,
            snapshot: Mapping[str, Any], final: list[dict[str, Any]], setup: _Setup, events: int) -> None:
    """The result's figures from the allocator's statistics, and the verification's verdict."""
    stats = alloc.stats
    result.events = events
    result.peak_allocated = stats.allocated_bytes[0].peak
    result.peak_reserved = stats.reserved_bytes[0].peak
    result.peak_requested = stats.requested_bytes[0].peak
    result.peak_device_used = result.peak_reserved + setup.ctx + dev.other_used
    result.segment_allocs = stats.num_device_alloc
    result.segment_frees = stats.num_device_free
    result.alloc_retries = stats.num_alloc_retries
    result.ooms += stats.num_ooms  # (+ the requests refused before the allocator: `vram.replay.loop.note_oom`)
    result.final_allocated = stats.allocated_bytes[0].current
    result.final_reserved = stats.reserved_bytes[0].current
    if checks is not None:
        result.verification = checks.finish(alloc, dev, final, setup.recorded, live_at_start={
            b["address"] for seg in setup.initial for b in seg["blocks"] if b["state"] != "inactive"})
        if dev.cut_maps:
            result.verification["notes"].append(
                f"{dev.cut_maps} page maps refused: an expandable segment outgrew the room the "
                "recording's later segment addresses leave it (give the recording's GPU with --gpu)")
        result.verification["segments_on_other_devices"] = sum(
            1 for s in snapshot.get("segments", []) if s.get("device", 0) != setup.device)


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


#: the budgets `smallest_budget` tries are multiples of this (cudaMalloc's 2 MiB granularity)
BUDGET_STEP = 2 << 20


def smallest_budget(fits: Callable[[int], bool], low: int, high: int,
                    bisections: int | None = None) -> int | None:
    """The smallest budget (bytes, a multiple of `BUDGET_STEP`, or `high`) in (`low`, `high`] for
    which `fits` (a replay without an OOM on a GPU or under a cap of that size) holds, by bisection:
    None when `high` does not fit. Fitting is taken to be monotonic in the budget; after
    `bisections` replays (None: no limit) the smallest fitting budget found so far is returned."""
    if not fits(high):
        return None
    lo, hi = low // BUDGET_STEP, -(-high // BUDGET_STEP)
    done = 0
    while hi - lo > 1 and (bisections is None or done < bisections):
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid * BUDGET_STEP) else (mid, hi)
        done += 1
    return min(hi * BUDGET_STEP, high)
