"""Replay of recordings with private pools (vram.replay.pool_replay).

The recordings are made by vram's allocator with private pools and history on, then written by
`vram.views.snapshot.snapshot` the way ``torch.cuda.memory._snapshot()`` writes them
(torch/csrc/cuda/memory_snapshot.cpp): ``segment_pool_id`` on every segment; ``pool_id`` on the
trace entries of private pools (newer PyTorch writes it on every entry, ``(0, 0)`` for the default
pool: the `every_entry` variant; older PyTorch writes none: the `no_ids` variant).
"""
from __future__ import annotations

import pickle

import pytest

from vram import CachingAllocator, SimulatedDevice
from vram.allocator.history import ALL
from vram.replay import ccore
from vram.replay.engine import replay
from vram.replay.loader import load_snapshot
from vram.views.snapshot import segments, snapshot

MiB = 1 << 20
S = 7  # the capture stream
G, H = (1, 0), (2, 0)  # graphs' own pools
M = (0, 1)  # a graph_pool_handle / MemPool id


def alloc() -> CachingAllocator:
    a = CachingAllocator(SimulatedDevice("4GiB"), "")
    a.history.configure(True, ALL, 100000, True)
    return a


def graph_capture(a: CachingAllocator) -> None:
    x = a.malloc(3 * MiB)
    a.begin_allocate_to_pool(G, S)            # torch.cuda.graph: its own pool
    t = [a.malloc(n, S) for n in (4 * MiB, 600, 12 * MiB, 3000)]
    a.free(t[0])
    a.free(t[3])
    t.append(a.malloc(2 * MiB, S))            # reuses the freed 4 MiB block of the graph's pool
    a.end_allocate_to_pool(G)
    a.free(x)
    a.malloc(3 * MiB, S)                      # default pool: not the graph's cached blocks
    a.malloc(500)


def shared_pool(a: CachingAllocator) -> None:
    for _ in range(2):                        # two graphs, one graph_pool_handle
        a.begin_allocate_to_pool(M, S)
        y = a.malloc(5 * MiB, S)
        a.malloc(700, S)
        a.free(y)
        a.end_allocate_to_pool(M)
    a.malloc(5 * MiB, S)


def mem_pool(a: CachingAllocator) -> None:
    a.create_pool(M)                          # MemPool()
    a.begin_allocate_to_pool(M)               # use_mem_pool: this thread
    p = [a.malloc(n) for n in (1000, 8 * MiB, 30 * MiB)]
    a.end_allocate_to_pool(M)
    a.release_pool(M)                         # use_mem_pool's exit
    a.free(p[1])
    a.malloc(8 * MiB)                         # default pool


def release_then_empty(a: CachingAllocator) -> None:
    a.malloc(1 * MiB)
    big = a.malloc(40 * MiB)
    a.begin_allocate_to_pool(G, S)
    g = [a.malloc(n, S) for n in (6 * MiB, 100, 25 * MiB)]
    a.end_allocate_to_pool(G)
    a.begin_allocate_to_pool(H, S)
    h = a.malloc(9 * MiB, S)
    a.end_allocate_to_pool(H)
    for p in g:
        a.free(p)
    a.free(h)
    a.free(big)
    a.release_pool(G)                         # graph G reset; H still alive
    a.empty_cache()                           # frees default and G's segments, not H's
    a.malloc(6 * MiB)
    a.release_pool(H)
    a.empty_cache(H)                          # only H's (empty_cache(mempool_id))


def mid_run(a: CachingAllocator) -> None:
    a.history.configure(False, ALL, 100000, True)
    a.begin_allocate_to_pool(G, S)
    g = [a.malloc(n, S) for n in (6 * MiB, 800, 21 * MiB)]
    a.end_allocate_to_pool(G)
    d = a.malloc(7 * MiB)
    a.history.configure(True, ALL, 100000, True)  # the trace starts here
    a.free(g[1])
    a.begin_allocate_to_pool(G, S)
    a.malloc(512, S)
    a.malloc(3 * MiB, S)
    a.end_allocate_to_pool(G)
    a.free(g[0])
    a.free(g[2])
    a.free(d)
    a.release_pool(G)
    a.empty_cache()
    a.malloc(2 * MiB)


CASES = [graph_capture, shared_pool, mem_pool, release_then_empty, mid_run]


def recording(case, style: str = "private") -> dict:
    a = alloc()
    case(a)
    snap = pickle.loads(pickle.dumps(snapshot([a])))
    for e in snap["device_traces"][0]:
        if style == "every_entry":
            e.setdefault("pool_id", (0, 0))
        elif style == "no_ids":
            e.pop("pool_id", None)
    return load_snapshot(pickle.dumps(snap))


def exact(v: dict) -> bool:
    counts = [v[k] for k in ("segment_allocs", "segment_frees", "alloc_addresses", "final_segments", "final_blocks")]
    return all(c["matched"] == c["total"] for c in counts) and not v["divergences"] and not v["notes"]


@pytest.mark.parametrize("style", ["private", "every_entry"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_private_pool_recordings_replay_exactly(case, style):
    snap = recording(case, style)
    assert any(e.get("pool_id", (0, 0)) != (0, 0) for e in snap["device_traces"][0])
    r = replay(snap, verify=True)
    assert exact(r.verification), r.verification
    assert not r.engine.startswith("C")
    want = sorted((s["address"], s.get("segment_pool_id") or (0, 0)) for s in snap["segments"])
    assert sorted((s["address"], s["segment_pool_id"]) for s in segments(r.allocator)) == want


def test_release_then_empty_cache_frees_the_pools_segments_in_the_recorded_order():
    snap = recording(release_then_empty)
    frees = [e for e in snap["device_traces"][0] if e["action"] == "segment_free"]
    assert {e.get("pool_id") for e in frees} == {None, G, H}
    r = replay(snap, verify=True)
    assert r.verification["segment_frees"] == {"matched": len(frees), "total": len(frees)}
    assert H not in r.allocator.graph_pools and G not in r.allocator.graph_pools


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_what_if_keeps_the_pool_routing(case):
    snap = recording(case)
    r = replay(snap, conf="roundup_power2_divisions:4,max_split_size_mb:40")
    pools = {s["segment_pool_id"] for s in segments(r.allocator)}
    assert pools == {s.get("segment_pool_id") or (0, 0) for s in snap["segments"]}
    r = replay(snap, conf="expandable_segments:True")   # (a what-if: private pools map pages too)
    assert {s["segment_pool_id"] for s in segments(r.allocator)} == pools
    assert any(s["is_expandable"] for s in segments(r.allocator))  # (imported segments stay as they were)


def test_the_c_core_leaves_private_pools_to_python():
    snap = recording(graph_capture)
    r = replay(snap, verify=True, skip_cycles=False)
    assert "private memory pools" in r.engine or "not built" in r.engine
    a = CachingAllocator(SimulatedDevice("1GiB"), "")
    a.create_pool(G)
    why = ccore.unsupported(a, a.device, empty_cache_at=())
    assert why is not None


def test_without_trace_pool_ids_the_final_segments_tell_the_pools():
    r = replay(recording(graph_capture, "no_ids"), verify=True)
    assert exact(r.verification)


def release_g_keep_h(a: CachingAllocator) -> None:
    a.begin_allocate_to_pool(H, S)
    a.malloc(9 * MiB, S)                      # H's segment lives to the end: its pool is recorded
    a.end_allocate_to_pool(H)
    a.begin_allocate_to_pool(G, S)
    a.free(a.malloc(6 * MiB, S))
    a.end_allocate_to_pool(G)
    a.release_pool(G)
    a.empty_cache()                           # G's segment: freed, its pool in no recorded segment


def test_with_trace_pool_ids_a_freed_segment_replays_exactly():
    """(Without them, its pool is searched for by replay: tests/test_pool_search.py.)"""
    assert exact(replay(recording(release_g_keep_h), verify=True).verification)
