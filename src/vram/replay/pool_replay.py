"""Replay of recordings with private pools (CUDA graphs, ``torch.cuda.MemPool``; spec §5, §11.1).

What a recording holds (``torch/csrc/cuda/memory_snapshot.cpp``, c10/cuda/CUDACachingAllocator.cpp):
every segment has ``segment_pool_id`` (``owner_PrivatePool->id``, ``(0, 0)`` for the default
pool); newer releases also write ``pool_id`` on every trace entry (``TraceEntry::mempool_``:
``block->pool->owner_MempoolId()`` for alloc, free_requested, free_completed, segment_alloc and
segment_free; ``params.pool->owner_MempoolId()`` for oom), older ones on none. The trace has no
entry for a capture's begin or end (``beginAllocateToPool`` / ``endAllocateToPool``) nor for
``releasePool``, but it shows their effects, and those are what the replay needs:

* each request's pool is its entry's ``pool_id`` (or, in a recording without trace pool ids, the
  pool of the segment its address lies in, known for segments still alive at the end); the
  replay routes that one request there as a capture would (``captures_underway`` holding it:
  ``get_pool`` picks the pool, and ``malloc`` neither processes events nor empties the cache as
  its last resort, as during the recorded capture);
* a private pool's ``segment_free`` entries prove it was freeable then (``release_cached_blocks``
  frees only ``graph_pools_freeable``): at that run of segment frees the replay releases the pool
  and frees it as the recording did (``empty_cache(mempool_id)`` when the run frees no default
  segment), its pools in the order the recording freed them (PyTorch walks a hash map).

A pool released in the recording but never freed afterwards leaves no evidence: it stays in use in
the replay, which changes nothing under the recorded config (its segments were never freed) but
may under another. Refused in one line: a request or segment freed whose pool is unknown.
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
            alloc.freeable_pools.pop(pid, None)
            alloc.freeable_pools[pid] = pp
        if default or not pids:
            alloc.empty_cache()
        else:
            for pid in pids:
                alloc.empty_cache(pid)


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
    pool_of = _pools_by_id if with_ids else _pools_by_address
    pools = pool_of(segments, trace, device)
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


def _pools_by_id(segments: Sequence[Mapping[str, Any]], trace: Sequence[Mapping[str, Any]],
                 device: int) -> list[tuple[int, int] | None]:
    """Each entry's own ``pool_id`` (an entry without one is the default pool's: vram writes the
    key for private pools only)."""
    return [private_pool(e.get("pool_id")) for e in trace]


def _pools_by_address(segments: Sequence[Mapping[str, Any]], trace: Sequence[Mapping[str, Any]],
                      device: int) -> list[tuple[int, int] | None]:
    """A recording without trace pool ids (older PyTorch): the pool of the segment each entry's
    address lies in, walking back from the final segments (their ``segment_pool_id``); a segment
    freed in the trace has no recorded pool, so what touches it is refused."""
    unknown = ("?",)
    starts: list[int] = []
    segs: dict[int, tuple[int, Any]] = {}  # address -> (end, pool)
    for s in segments:
        segs[s["address"]] = (s["address"] + s["total_size"], private_pool(s.get("segment_pool_id")))
        insort(starts, s["address"])
    out: list[tuple[int, int] | None] = [None] * len(trace)
    for i in range(len(trace) - 1, -1, -1):
        e = trace[i]
        action = e["action"]
        if action == "oom":
            raise SnapshotError(f"device_traces[{device}][{i}]: an oom in a recording with private memory pools "
                                "and no trace pool ids: the pool the request was for is not recorded")
        if action not in ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
                          "segment_map", "segment_unmap"):
            continue
        addr = e["addr"]
        if action == "segment_free":
            segs[addr] = (addr + e["size"], unknown)
            insort(starts, addr)
        k = bisect_right(starts, addr) - 1
        seg = segs.get(starts[k]) if k >= 0 else None
        pid = seg[1] if seg is not None and addr < seg[0] else unknown
        if pid is unknown and action in ("alloc", "segment_free"):
            raise SnapshotError(f"device_traces[{device}][{i}] ({action} at {addr:#x}): its memory pool is not "
                                "recorded (a recording with private pools and no trace pool ids: only segments "
                                "alive at the end tell their pool)")
        out[i] = None if pid is unknown else pid  # type: ignore[assignment]
        if action == "segment_alloc" and seg is not None and starts[k] == addr:
            del segs[addr]
            starts.pop(k)
    return out
