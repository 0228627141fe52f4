"""Replay of recordings with private pools (CUDA graphs, ``torch.cuda.MemPool``; spec §5, §11.1).

What a recording holds (``torch/csrc/cuda/memory_snapshot.cpp``, c10/cuda/CUDACachingAllocator.cpp):
every segment has ``segment_pool_id`` (``owner_PrivatePool->id``, ``(0, 0)`` for the default
pool); newer releases also write ``pool_id`` on every trace entry (``TraceEntry::mempool_``:
``block->pool->owner_MempoolId()`` for alloc, free_requested, free_completed, segment_alloc and
segment_free; ``params.pool->owner_MempoolId()`` for oom), older ones on none. The trace has no
entry for a capture's begin or end (``beginAllocateToPool`` / ``endAllocateToPool``) nor for
``releasePool``, but it shows their effects, and those are what the replay needs:

* each request's pool is its entry's ``pool_id`` (or, in a recording without trace pool ids, the
  pool of the segment its address lies in, known for segments still alive at the end; those
  freed in the trace and ``oom`` entries are `Unknown`, searched for by `vram.replay.pool_search`); the
  replay routes that one request there as a capture would (``captures_underway`` holding it:
  ``get_pool`` picks the pool, and ``malloc`` neither processes events nor empties the cache as
  its last resort, as during the recorded capture);
* a private pool's ``segment_free`` entries prove it was freeable then (``release_cached_blocks``
  frees only ``graph_pools_freeable``): at that run of segment frees the replay releases the pool
  and frees it as the recording did (``empty_cache(mempool_id)`` when the run frees no default
  segment), its pools in the order the recording freed them (PyTorch walks a hash map).

A pool released in the recording but never freed afterwards leaves no evidence: it stays in use in
the replay, which changes nothing under the recorded config (its segments were never freed) but
may under another. Refused in one line: a request in memory of no known or freed segment.
"""
from __future__ import annotations

import itertools
from bisect import bisect_right, insort
from collections.abc import Mapping, Sequence
from typing import Any

from vram.allocator.caching import CachingAllocator

from .messages import SnapshotError
from .validate import private_pool

_MALLOC = frozenset(("alloc", "oom"))
_RELEASE = frozenset(("segment_free", "segment_unmap"))  # a run of them is one empty_cache()


class PoolPlan:
    """Per malloc (``alloc`` / ``oom`` entry, in order) its pool (None: the default); per run of
    segment frees the private pools it frees, in order, and whether it frees default segments."""

    __slots__ = ("mallocs", "runs")

    def __init__(self, mallocs: list[tuple[int, int] | None],
                 runs: list[tuple[list[tuple[int, int]], bool]]) -> None:
        self.mallocs = mallocs
        self.runs = runs

    def router(self, alloc: CachingAllocator) -> PoolRouter:
        return PoolRouter(alloc, self)


class PoolRouter:
    """Stands in for ``alloc.malloc`` and the replay's ``empty_cache`` (called once per malloc and
    per run of segment frees, in trace order: cycle skipping is off for these replays)."""

    __slots__ = ("alloc", "plan", "k", "r")

    def __init__(self, alloc: CachingAllocator, plan: PoolPlan) -> None:
        self.alloc, self.plan, self.k, self.r = alloc, plan, 0, 0

    def malloc(self, size: int, stream: int) -> int:
        pid = self.plan.mallocs[self.k]
        self.k += 1
        alloc = self.alloc
        if pid is None:
            return alloc.malloc(size, stream)
        if pid not in alloc.graph_pools:
            alloc._create_or_incref(pid)  # (a released pool's id may show again: no use added)
        alloc.captures.append((pid, stream, -1))  # routes this stream, as ``beginAllocateToPool``
        try:
            return alloc.malloc(size, stream)
        finally:
            alloc.captures.pop()

    def empty_cache(self) -> None:
        pids, default = self.plan.runs[self.r]
        self.r += 1
        alloc = self.alloc
        for pid in pids:
            pp = alloc.graph_pools.get(pid)
            if pp is None:
                continue  # (verification reports the segment frees that did not happen)
            pp.use_count = 0  # ``releasePool`` by every graph / MemPool that used it
            if pid not in alloc.freeable_pools:
                alloc.freeable_pools[pid] = pp
                alloc.freeable_slots.add(pid)
        alloc.release_order = pids  # (the recorded order: when each pool became freeable is not recorded)
        try:
            if default or not pids:
                alloc.empty_cache()
            else:
                for pid in pids:
                    alloc.empty_cache(pid)
        finally:
            alloc.release_order = []


def plan_pools(segments: Sequence[Mapping[str, Any]], trace: Sequence[Mapping[str, Any]],
               device: int = 0, first_pool_id: int | None = 0) -> PoolPlan | None:
    """The pools of a recording's requests and segment frees; None when it uses no private pool.
    `first_pool_id`: no event before it has a ``pool_id`` key (None: no event has one), where the
    caller knows (`vram.replay.ccore.scan`). Raises `SnapshotError` where the recording does not
    tell a pool that matters."""
    with_ids = False
    private = any(private_pool(s.get("segment_pool_id")) for s in segments)
    for e in () if first_pool_id is None else itertools.islice(trace, first_pool_id, None):
        if "pool_id" in e:
            with_ids = True
            if private_pool(e["pool_id"]):
                private = True
                break
    if not private:
        return None
    if with_ids:
        pools = [private_pool(e.get("pool_id")) for e in trace]  # (vram writes the key for private pools only)
    else:
        pools, units = pools_by_address(segments, trace, device)
        if units:  # (`vram.replay.engine.replay` labels such recordings first: vram.replay.pool_search)
            raise SnapshotError(f"device_traces[{device}]: the memory pools of {len(units)} segments freed in "
                                "the trace or oom entries are not recorded (no trace pool ids)")
    mallocs: list[tuple[int, int] | None] = []
    runs: list[tuple[list[tuple[int, int]], bool]] = []
    prev_release = False
    for e, pid in zip(trace, pools):
        action = e["action"]
        if action in _MALLOC:
            mallocs.append(pid)
        release = action in _RELEASE
        if release:
            if not prev_release:
                runs.append(([], False))
            if pid is None:
                runs[-1] = (runs[-1][0], True)
            elif pid not in runs[-1][0]:
                runs[-1][0].append(pid)
        prev_release = release
    return PoolPlan(mallocs, runs)


class Unknown:
    """A part of a recording without trace pool ids whose pool the file does not say: a segment
    freed in the trace (`entries`: every entry at its addresses while it lived) or an ``oom``
    entry. `first`: the first event whose replay depends on its pool (-1: the segment existed
    before the trace, so the starting state does)."""

    __slots__ = ("kind", "first", "entries")

    def __init__(self, kind: str, first: int, entries: list[int]) -> None:
        self.kind, self.first, self.entries = kind, first, entries


def pools_by_address(segments: Sequence[Mapping[str, Any]], trace: Sequence[Mapping[str, Any]],
                     device: int) -> tuple[list[tuple[int, int] | None], list[Unknown]]:
    """A recording without trace pool ids (older PyTorch): the pool of the segment each entry's
    address lies in, walking back from the final segments (their ``segment_pool_id``); per
    segment freed in the trace and per ``oom`` entry an `Unknown` (its entries' pools are left
    None: `vram.replay.pool_search` tries them). An allocation in memory of no known or freed
    segment (an unmapped expandable range) is refused."""
    starts: list[int] = []
    segs: dict[int, tuple[int, Any]] = {}  # address -> (end, its pool, or the Unknown of a freed segment)
    for s in segments:
        segs[s["address"]] = (s["address"] + s["total_size"], private_pool(s.get("segment_pool_id")))
        insort(starts, s["address"])
    out: list[tuple[int, int] | None] = [None] * len(trace)
    units: list[Unknown] = []
    for i in range(len(trace) - 1, -1, -1):
        e = trace[i]
        action = e["action"]
        if action == "oom":
            units.append(Unknown("oom", i, [i]))
            continue
        if action not in ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
                          "segment_map", "segment_unmap"):
            continue
        addr = e["addr"]
        if action == "segment_free":
            unit = Unknown("segment", -1, [])
            units.append(unit)
            segs[addr] = (addr + e["size"], unit)
            insort(starts, addr)
        k = bisect_right(starts, addr) - 1
        seg = segs.get(starts[k]) if k >= 0 else None
        owner = seg[1] if seg is not None and addr < seg[0] else _NOWHERE
        if isinstance(owner, Unknown):
            owner.entries.append(i)
        elif owner is _NOWHERE:
            if action == "alloc":
                raise SnapshotError(f"device_traces[{device}][{i}] ({action} at {addr:#x}): its memory pool is "
                                    "not recorded (a recording with private pools and no trace pool ids: the "
                                    "address lies in no segment alive at the end or freed in the trace)")
        else:
            out[i] = owner  # type: ignore[assignment]  # (a final segment's pool)
        if action == "segment_alloc" and seg is not None and starts[k] == addr:
            if isinstance(seg[1], Unknown):
                seg[1].first = i
            del segs[addr]
            starts.pop(k)
    units.reverse()
    return out, units


_NOWHERE = ("?",)
