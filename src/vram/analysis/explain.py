"""``vram explain``: why a recording ran out of memory (or what its reserved peak is made of), and
what would have avoided it — every fix checked by replaying the recording with it.

The moment: the first OOM (recorded, or on ``gpu`` when given), else the reserved peak. There:
- what was allocated, grouped by the user's innermost stack frame (`vram.replay.diff.user_frame`);
- reserved but unallocated, and why: the free blocks per pool and stream, the largest of them
  against the request (spec §7: a request is served only from its own pool and stream, by a
  block at least its rounded size; §9: before an OOM PyTorch has already returned every unsplit
  cached segment, so what is left free is inside segments that also hold live blocks), and frees
  still pending on other streams' events (§10.3);
- fixes, each replayed through the whole recording on the same GPU (``verified`` is that replay's
  answer, not a guess): allocator settings (`vram.analysis.tune`), a larger GPU (the smallest found
  by bisection, then replayed), ``empty_cache()`` at a point (`cache_peaks`), or "it does not fit": the live
  tensors alone need more than the GPU had.

The GPU: ``gpu``/``context`` when given; else, at a recorded OOM, reserved + the recorded free
memory there (what PyTorch could have had: context and other processes taken as constant); else
unlimited.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vram.allocator.block import SIZE_MASK, SIZE_SHIFT, STREAM_SHIFT
from vram.allocator.caching import K_SMALL_SIZE, round_size
from vram.allocator.config import parse_alloc_conf
from vram.replay.cut import allocation_stacks
from vram.replay.diff import user_frame
from vram.replay.engine import device_count, replay
from vram.units import format_size

from .fleet import ReplayJob, load_cached, run_jobs
from .tune import budgets_for, cap_bound, ends_at_oom, fit_bound, smallest_fit, tune

#: consumers listed
TOP = 10
#: at most this many ``empty_cache()`` points are replayed (the largest local maxima of the cache)
EMPTY_CACHE_REPLAYS = 32
#: working ``empty_cache()`` points listed
EMPTY_CACHE_FIXES = 3
MiB = 1 << 20


@dataclass
class Explanation:
    """What `explain` found; `to_json` is ``vram explain --json``."""

    path: str
    device: int
    at: dict[str, Any]
    gpu: int | None
    gpu_from: str
    allocated: int = 0
    reserved: int = 0
    top_consumers: list[dict[str, Any]] = field(default_factory=list)
    free_by_pool: list[dict[str, Any]] = field(default_factory=list)
    largest_free_block: int = 0
    pending_frees: dict[str, int] = field(default_factory=dict)
    why: list[str] = field(default_factory=list)
    fixes: list[dict[str, Any]] = field(default_factory=list)
    #: what bounded PyTorch at the OOM, in bytes: ``{"low", "high", "cause"}`` (`_limit`); None
    #: without an OOM on a GPU of unknown size
    limit: dict[str, Any] | None = None
    #: the recording has no allocation after the OOM: the program's later needs are not in it
    ends_at_oom: bool = False

    @property
    def capped(self) -> bool:
        """`gpu` is a per-process cap (on a device with room), not a GPU's size."""
        return self.limit is not None and self.limit["cause"] == "per-process cap"

    def job(self, path: str, conf: str | None, context: int | str = 0, **kw: Any) -> ReplayJob:
        """A replay on this explanation's budget: the GPU, or the cap."""
        if self.capped:
            return ReplayJob(path, self.device, conf, None, context, cap=self.gpu, **kw)
        return ReplayJob(path, self.device, conf, self.gpu, context, **kw)

    @property
    def reserved_unallocated(self) -> int:
        return self.reserved - self.allocated

    def __str__(self) -> str:
        from .report import explanation_text

        return explanation_text(self)

    def __repr__(self) -> str:
        from .report import explanation_repr

        return explanation_repr(self)

    def _repr_html_(self) -> str:
        from .report import explanation_html

        return explanation_html(self)

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["reserved_unallocated"] = self.reserved_unallocated
        return out


def _pools(alloc: Any) -> list[dict[str, Any]]:
    """Free bytes, block count and largest block per (pool, stream), from the sorted keys."""
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for name, pool in (("small", alloc.small_blocks), ("large", alloc.large_blocks)):
        for key in pool.keys:
            stream, size = key >> STREAM_SHIFT, (key >> SIZE_SHIFT) & SIZE_MASK
            row = rows.setdefault((name, stream), {"pool": name, "stream": stream, "free_bytes": 0,
                                                   "blocks": 0, "largest": 0})
            row["free_bytes"] += size
            row["blocks"] += 1
            row["largest"] = max(row["largest"], size)
    return sorted(rows.values(), key=lambda r: (r["pool"], r["stream"]))


def consumers(snap: Mapping[str, Any], device: int, stop: int, alloc: Any) -> list[dict[str, Any]]:
    """The live blocks of `alloc` (the state of a replay under the recorded config before event
    `stop`) grouped by the user's innermost frame of the request that made each, largest first."""
    trace = (snap.get("device_traces") or [[]] * (device + 1))[device]
    known = allocation_stacks(snap, trace, stop, device)
    groups: dict[str, list[int]] = {}
    for block in alloc.all_blocks():
        if block.allocated:
            frames = known.get(block.ptr)
            label = (user_frame(frames) if frames else "(allocated before the recording began)" if frames is None
                     else "(recorded without a Python stack: e.g. autograd's backward, run in C++)")
            g = groups.setdefault(label, [0, 0])
            g[0] += block.size
            g[1] += 1
    return [{"frame": k, "bytes": v[0], "blocks": v[1]}
            for k, v in sorted(groups.items(), key=lambda kv: (-kv[1][0], kv[0]))[:TOP]]


def _state(ex: Explanation, snap: Mapping[str, Any], stop: int, gpu: int | None, context: int | str) -> None:
    """Fill in the allocation and fragmentation figures at the state before event `stop`."""
    state = replay(snap, device=ex.device, stop_at=stop, gpu=gpu, context=context)
    alloc = state.allocator
    assert alloc is not None
    ex.allocated = alloc.stats.allocated_bytes[0].current
    ex.reserved = alloc.stats.reserved_bytes[0].current
    ex.top_consumers = consumers(snap, ex.device, stop, alloc)
    pending = [b.size for b in alloc.all_blocks() if not b.allocated and b.event_count > 0]
    ex.free_by_pool = _pools(alloc)
    ex.pending_frees = {"bytes": sum(pending), "blocks": len(pending)}
    at = ex.at
    if at["kind"] == "oom":
        rounded = round_size(at["size"], alloc.config.roundup_power2_divisions)
        pool = "small" if rounded <= K_SMALL_SIZE else "large"
        at["pool"] = pool
        mine = [r for r in ex.free_by_pool if r["pool"] == pool and r["stream"] == at["stream"]]
        ex.largest_free_block = mine[0]["largest"] if mine else 0
    else:
        ex.largest_free_block = max((r["largest"] for r in ex.free_by_pool), default=0)


def _why(ex: Explanation) -> None:
    at, f = ex.at, format_size
    if at["kind"] == "oom":
        ex.why.append(f"the request: {f(at['size'])} from the {at['pool']} pool on stream {at['stream']}; "
                      f"{f(ex.allocated)} allocated, {f(ex.reserved)} reserved, "
                      f"{f(at['device_free'])} of the GPU free")
        lim = ex.limit
        if lim is not None and lim["cause"] == "per-process cap":
            ex.why.append(f"the device had {f(at['device_free'])} free, enough for the {f(lim['high'] - ex.reserved)} "
                          "segment the request needed, so cudaMalloc would have succeeded: the OOM came from a "
                          "per-process cap (torch.cuda.set_per_process_memory_fraction, or "
                          "per_process_memory_fraction in PYTORCH_CUDA_ALLOC_CONF). The recording brackets it: "
                          f"at least {lim['low']:,} B (the most reserved before, which it allowed) and below "
                          f"{lim['high']:,} B (reserved + that segment, which it refused); every fix below is "
                          f"verified against {lim['high'] - 1:,} B, the most it can have allowed")
        if ex.ends_at_oom:
            ex.why.append(f"the recording stops at this failure (no allocation after event {at['event_index']}): it "
                          "shows what was live and cached up to the failure, not what the program would have "
                          "allocated after it, so each fix below is verified only up to this point")
        if ex.reserved_unallocated:
            ex.why.append(f"{f(ex.reserved_unallocated)} reserved but unallocated could not serve it: the "
                          f"largest free block in its pool and stream is {f(ex.largest_free_block)}; the "
                          "free blocks lie in segments that also hold live tensors, so empty_cache() "
                          "(which PyTorch already ran before raising) cannot return them")
        others = [r for r in ex.free_by_pool if not (r["pool"] == at["pool"] and r["stream"] == at["stream"])]
        if any(r["free_bytes"] for r in others):
            ex.why.append("free in other pools/streams (not usable for this request): " + ", ".join(
                f"{r['pool']} stream {r['stream']}: {f(r['free_bytes'])} (largest {f(r['largest'])})"
                for r in others if r["free_bytes"]))
    elif at["kind"] == "state":
        ex.why.append(f"the state in the file: {f(ex.reserved)} reserved, {f(ex.allocated)} allocated, "
                      f"{f(ex.reserved_unallocated)} cached but unallocated (largest free block "
                      f"{f(ex.largest_free_block)}). The file records no allocation events (a state dump), so "
                      "there is no peak or failure in it to explain; whether it was taken at an OOM is not in it")
    elif at["kind"] == "allocated_peak":
        ex.why.append(f"reserved memory never rose above the {f(ex.reserved)} the recording started with: what "
                      "reserved it happened before the recording began. Shown instead: the allocated peak, "
                      f"{f(ex.allocated)} allocated ({f(ex.reserved_unallocated)} cached but unallocated, largest "
                      f"free block {f(ex.largest_free_block)})")
    else:
        ex.why.append(f"the reserved peak: {f(ex.reserved)} reserved, {f(ex.allocated)} allocated, "
                      f"{f(ex.reserved_unallocated)} cached but unallocated (largest free block "
                      f"{f(ex.largest_free_block)})")
    if ex.pending_frees["blocks"]:
        ex.why.append(f"{f(ex.pending_frees['bytes'])} in {ex.pending_frees['blocks']} freed blocks waits on "
                      "other streams' events (record_stream) and cannot be reused yet")


def explain(path: str, *, device: int | None = None, gpu: int | str | None = None, context: int | str = 0,
            workers: int | None = None, cluster: str | None = None,
            progress: Callable[[int, int], None] | None = None, fixes: bool = True) -> Explanation:
    """Explain one snapshot file (see the module doc); without `fixes`, only the moment and what
    fills the memory there (no replays of fixes)."""
    from vram.devices.gpus import gpu_memory
    from vram.units import parse_size

    snap = load_cached(path)
    if device is None:  # the first device with a recorded OOM, else 0
        traces = snap.get("device_traces") or []
        device = next((d for d, t in enumerate(traces) if any(e["action"] == "oom" for e in t)), 0)
    elif not 0 <= device < device_count(snap):
        raise ValueError(f"device {device} is not in the snapshot: it records {device_count(snap)} device(s)")
    gpu_bytes = None if gpu is None else gpu_memory(gpu)
    ctx = parse_size(context, "context")
    probe = run_jobs([ReplayJob(path, device, None, gpu_bytes, ctx)], workers=1)[0]
    if "error" in probe:
        raise ValueError(probe["error"])
    recorded_conf = probe["conf"]
    budget = budgets_for([probe], gpu_bytes, ctx)[0]
    oom = probe["oom"]
    if oom is not None:
        at = {"kind": "oom", "event_index": oom["event_index"], "size": oom["size"], "message": oom["message"],
              "recorded": oom["recorded"], "device_free": oom["device_free"],
              "stream": (snap["device_traces"][device][oom["event_index"]].get("stream", 0)),
              "frame": user_frame(oom["frames"]) if oom["frames"] else None}
        stop = oom["event_index"]
    else:
        at, stop = _moment(snap, device, probe)
    b_gpu = budget.cap if budget.cap is not None else (
        budget.gpu if isinstance(budget.gpu, int) or budget.gpu is None else gpu_memory(budget.gpu))
    why_gpu = "unlimited (a state dump: no OOM event in the file, no --gpu)" if at["kind"] == "state" and \
        b_gpu is None else budget.why
    if gpu_bytes is not None and ctx and budget.cap is None:
        why_gpu = f"given, the CUDA context's {format_size(ctx)} included"
    ex = Explanation(path, device, at, b_gpu, why_gpu)
    _state(ex, snap, stop, gpu_bytes, ctx)
    ex.limit = _limit(ex, snap, oom, gpu_bytes, recorded_conf)
    ex.ends_at_oom = ends_at_oom(path, device, oom)
    _why(ex)
    if oom is not None and recorded_conf and parse_alloc_conf(recorded_conf).expandable_segments:
        ex.why.append("expandable_segments was already on: the message's advice to set it is fixed text "
                      "(CUDACachingAllocator.cpp, the OutOfMemoryError message), not a diagnosis")
    if fixes:
        _fixes(ex, path, recorded_conf, probe, budget.context, workers, cluster, progress)
    return ex


def _moment(snap: Mapping[str, Any], device: int, probe: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """Without an OOM: the reserved peak; where reserved memory never rose above what the
    recording started with (the peak is its starting state, made before it began), the allocated
    peak instead; a file without allocation events (a state dump): the state it holds."""
    trace = (snap.get("device_traces") or [[]] * (device + 1))[device]
    if not any(e["action"] == "alloc" for e in trace):
        return {"kind": "state", "event_index": -1}, 0
    peak = probe["reserved_peak_event"]
    if peak >= 0:
        return {"kind": "reserved_peak", "event_index": peak}, peak + 1
    timeline = replay(snap, device=device, timeline=True).timeline
    assert timeline is not None
    allocated = timeline[0]
    k = max(range(len(allocated)), key=lambda j: (allocated[j], -j))
    return {"kind": "allocated_peak", "event_index": k, "reserved_flat": True}, k + 1


def _limit(ex: Explanation, snap: Mapping[str, Any], oom: dict[str, Any] | None, gpu: int | None,
           conf: str) -> dict[str, Any] | None:
    """What bounded PyTorch at the OOM. On a given GPU: that GPU. At a recorded OOM with less than
    the requested segment free on the device: the device (reserved + its free memory). With more
    free: a per-process cap (`vram.analysis.tune.cap_bound`), bracketed by the recording: every
    earlier segment was allowed, so the cap was at least the most reserved before the OOM
    (``low``), and this one was refused, so it was below reserved + the segment (``high``)."""
    if gpu is not None:
        return {"low": gpu, "high": gpu, "cause": "device"}
    if oom is None or not oom.get("recorded"):
        return None
    cap = cap_bound(oom, parse_alloc_conf(conf).large_segment_size if conf else 20 * MiB)
    if cap is None:
        total = oom["reserved"] + oom["device_free"]
        return {"low": total, "high": total, "cause": "device"}
    before = replay(snap, device=ex.device, stop_at=oom["event_index"])
    return {"low": before.peak_reserved, "high": cap + 1, "cause": "per-process cap"}


def _fixes(ex: Explanation, path: str, recorded_conf: str, probe: dict[str, Any], context: int | str,
           workers: int | None, cluster: str | None, progress: Callable[[int, int], None] | None) -> None:
    f = format_size
    oom = ex.at["kind"] == "oom"
    unlimited = run_jobs([ReplayJob(path, ex.device, recorded_conf)], workers=1)[0]
    tuned = tune([path], gpu=None if ex.capped else ex.gpu, cap=ex.gpu if ex.capped else None, context=context,
                 devices=[ex.device], workers=workers, cluster=cluster, progress=progress)
    if oom:
        good = [r for r in tuned.results if not r["oom"]][:3]
        for r in good:
            ex.fixes.append({"kind": "config", "change": f"PYTORCH_CUDA_ALLOC_CONF={r['conf']}", "verified": True,
                             "peak_reserved": r["peak_reserved"]})
        if not good:
            ex.fixes.append({"kind": "config", "verified": False,
                             "change": f"no allocator setting avoids it (none of the {len(tuned.results)} tried)"})
    else:
        base = probe["peak_reserved"]
        for r in [r for r in tuned.results if not r["oom"] and r["peak_reserved"] < base][:3]:
            ex.fixes.append({"kind": "config", "change": f"PYTORCH_CUDA_ALLOC_CONF={r['conf']}", "verified": True,
                             "peak_reserved": r["peak_reserved"],
                             "saves": base - r["peak_reserved"]})
    _empty_cache_fixes(ex, path, recorded_conf, probe, context, workers, cluster)
    if ex.gpu is None or "error" in unlimited:  # (the error: no GPU fix can be checked)
        return
    # ex.gpu is the device's capacity: a given --gpu holds the context (`ctx`), the budget of a
    # recorded OOM (reserved + free there) does not (its context is 0)
    ctx = context if isinstance(context, int) else 0
    if oom:
        ctx = 0 if ex.capped else ctx  # a cap bounds PyTorch's reserved memory alone
        need = smallest_fit(path, ex.device, recorded_conf, ex.gpu,
                            fit_bound(unlimited["peak_reserved"] + ctx, ex.gpu, ex.capped), ctx, as_cap=ex.capped)
        if need is not None and need > ex.gpu:  # (fitting on ex.gpu itself would contradict the OOM)
            ex.fixes.append(_more_memory_fix(ex, ex.gpu, need, ctx))
        live, usable = unlimited["peak_requested"], ex.gpu - ctx
        if live > usable:
            ex.fixes.insert(0, {"kind": "does_not_fit", "verified": True, "more": live - usable,
                                "change": f"it does not fit: the tensors requested and alive at once reach "
                                          f"{f(live)}, {f(live - usable)} more than the {f(usable)} PyTorch could "
                                          "have: it needs at least that much more, whatever the settings"})


def _more_memory_fix(ex: Explanation, gpu: int, need: int, ctx: int) -> dict[str, Any]:
    """More memory than `gpu`: a larger cap under a per-process cap (bytes for PyTorch), else a
    larger GPU (its capacity, the CUDA context `ctx` included); "at least" where the recording
    stops at the failure (what follows it is not recorded)."""
    f, lim = format_size, ex.limit
    least = "at least " if ex.ends_at_oom else ""
    after = " to get past this request (what the program needs after it is not in the recording)" \
        if ex.ends_at_oom else ""
    if lim is not None and lim["cause"] == "per-process cap":
        return {"kind": "cap", "verified": True, "cap": need, "more": need - gpu, "lower_bound": ex.ends_at_oom,
                "change": f"a per-process cap allowing {least}{need:,} B{after} (the recorded cap allowed between "
                          f"{lim['low']:,} and {lim['high'] - 1:,} B; the device had room)"}
    with_ctx = f" with the {f(ctx)} CUDA context" if ctx else ""
    return {"kind": "gpu", "verified": True, "gpu": need, "more": need - gpu, "lower_bound": ex.ends_at_oom,
            "change": f"a GPU with {least}{f(need - gpu)} more memory ({need:,} B{with_ctx}, not {gpu:,} B){after}"}


def cache_peaks(allocated: Sequence[int], reserved: Sequence[int], end: int, limit: int) -> list[int]:
    """Points (event indices: ``empty_cache()`` before that event) where the cache, reserved -
    allocated after the event before, is at a local maximum: it grew up to there and the next event
    takes from it (a plateau counts once, at its end), before `end`. The `limit` largest, in
    event order.

    Why these: ``empty_cache()`` returns only cached memory, so within a stretch where the cache
    only grows, a later call has at least as much to return as an earlier one; the latest point
    before the cache is taken from again is where it holds most. (The answer is not monotone in
    the point, so no bisection: returning a segment early can make later requests split another
    one. Each point is therefore replayed.)"""
    cache = [reserved[j] - allocated[j] for j in range(end)]
    peaks = [j + 1 for j in range(end - 1) if cache[j] > 0 and cache[j + 1] < cache[j]
             and (j == 0 or cache[j] >= cache[j - 1])]
    best = sorted(peaks, key=lambda p: (-cache[p - 1], p))[:limit]
    return sorted(best)


def _empty_cache_fixes(ex: Explanation, path: str, conf: str, probe: dict[str, Any], context: int | str,
                       workers: int | None, cluster: str | None) -> None:
    """``empty_cache()`` before an event: each point of `cache_peaks` (at most
    `EMPTY_CACHE_REPLAYS`) replayed through the whole recording; those that avoid the OOM (or
    lower the reserved peak without one) are listed, at most `EMPTY_CACHE_FIXES`, the lowest
    peak first."""
    snap = load_cached(path)
    end = ex.at["event_index"]
    if end <= 1:
        return
    timeline = replay(snap, device=ex.device, conf=conf, gpu=None if ex.capped else ex.gpu,
                      cap=ex.gpu if ex.capped else None, context=context, timeline=True, stop_at=end).timeline
    assert timeline is not None
    points = cache_peaks(timeline[0], timeline[1], end, EMPTY_CACHE_REPLAYS)
    jobs = [ex.job(path, conf, context, empty_cache_at=(p,)) for p in points]
    trace = snap["device_traces"][ex.device]
    oom = ex.at["kind"] == "oom"
    found = []
    for p, r in zip(points, run_jobs(jobs, workers=workers, cluster=cluster)):
        if "error" in r or r["ooms"] or (not oom and r["peak_reserved"] >= probe["peak_reserved"]):
            continue
        frames = trace[p].get("frames") or []
        fix = {"kind": "empty_cache", "verified": True, "event_index": p, "peak_reserved": r["peak_reserved"],
               "change": f"torch.cuda.empty_cache() before event {p}" + (f" ({user_frame(frames)})" if frames else "")}
        if not oom:
            fix["saves"] = probe["peak_reserved"] - r["peak_reserved"]
        found.append(fix)
    ex.fixes.extend(sorted(found, key=lambda f: (f["peak_reserved"], f["event_index"]))[:EMPTY_CACHE_FIXES])
