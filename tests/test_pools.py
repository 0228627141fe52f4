"""Private pools: CUDA graph pools and ``torch.cuda.MemPool`` in the allocator.

Every expectation below follows ``DeviceCachingAllocator`` in ``c10/cuda/CUDACachingAllocator.cpp``
(``get_pool``, ``beginAllocateToPool``/``endAllocateToPool``/``releasePool``,
``release_cached_blocks``, ``try_mempool_fallback``, ``should_split``, ``snapshot``) and
``at::cuda::MemPool`` (``aten/src/ATen/cuda/MemPool.cpp``), not from what vram printed.
"""
from __future__ import annotations

import threading

import pytest

from vram import CachingAllocator, SimulatedDevice
from vram.allocator.errors import OutOfMemoryError
from vram.allocator.history import ALL
from vram.views.snapshot import segments

MiB = 1 << 20
S = 7  # a side stream (graphs are captured on one)
G = (1, 0)  # a graph's own pool id ({capture id, 0})
M = (0, 1)  # a MemPool's / graph_pool_handle's id ({0, uid})


def alloc(total: str = "1GiB", conf: str = "") -> CachingAllocator:
    a = CachingAllocator(SimulatedDevice(total), conf)
    a.history.configure(True, ALL, 100000, True)
    return a


def pools_of(a: CachingAllocator) -> dict[int, tuple[int, int]]:
    return {s["address"]: s["segment_pool_id"] for s in segments(a)}


def actions(a: CachingAllocator) -> list[tuple[str, int, object]]:
    return [(e.action, e.size, e.as_dict().get("pool_id")) for e in a.history.entries]


def state(a: CachingAllocator) -> tuple:
    return (dict(a.memory_stats()), segments(a), list(a.captures), {k: v.use_count for k, v in a.graph_pools.items()},
            list(a.freeable_pools))


def test_capture_routes_its_stream_to_the_pool_and_other_streams_to_the_default_pool():
    a = alloc()
    a.begin_allocate_to_pool(G, S)
    p = a.malloc(1000, S)          # small request on the capturing stream: the graph's small pool
    q = a.malloc(1000, 0)          # another stream: the default pool
    r = a.malloc(5 * MiB, S)       # large request: the graph's large pool (a 20 MiB segment)
    a.end_allocate_to_pool(G)
    pools = pools_of(a)
    assert sorted(pools.values()) == [(0, 0), G, G]
    seg = {s["address"]: s for s in segments(a)}
    assert {(s["segment_type"], s["segment_pool_id"]) for s in seg.values()} == {
        ("small", G), ("large", G), ("small", (0, 0))}
    # stats count private pools like the default ones: `all` plus the pool's kind
    st = a.memory_stats()
    assert st["reserved_bytes.all.current"] == 2 * MiB + 2 * MiB + 20 * MiB
    assert st["reserved_bytes.small_pool.current"] == 4 * MiB
    assert st["allocated_bytes.large_pool.current"] == 5 * MiB
    assert st["segment.all.current"] == 3
    assert {p, q, r} <= set(a.active)


def test_private_blocks_never_serve_the_default_pool_and_are_reused_inside_it():
    a = alloc()
    a.begin_allocate_to_pool(G, S)
    p = a.malloc(4 * MiB, S)
    a.free(p)
    assert a.malloc(4 * MiB, S) == p          # inside the capture the pool reuses its block
    a.end_allocate_to_pool(G)
    a.free(p)
    q = a.malloc(4 * MiB, S)                  # after it, the same request on the same stream
    assert q != p and pools_of(a)[q] == (0, 0)  # needed a default segment of its own
    assert a.memory_stats()["segment.all.current"] == 2


def test_lifo_the_most_recent_matching_context_wins():
    a = alloc()
    a.begin_allocate_to_pool(G, S)            # routes stream S
    a.begin_allocate_to_pool(M)               # routes this thread, begun later: wins
    p = a.malloc(1000, S)
    a.end_allocate_to_pool(M)
    q = a.malloc(1000, S)
    a.end_allocate_to_pool(G)
    blocks = {b["address"]: s["segment_pool_id"] for s in segments(a) for b in s["blocks"]}
    assert blocks[p] == M and blocks[q] == G


def test_thread_context_routes_only_its_thread():
    a = alloc()
    a.create_pool(M)
    a.begin_allocate_to_pool(M)
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(a.malloc(1000, 0)))
    t.start()
    t.join()
    mine = a.malloc(1000, 0)
    a.end_allocate_to_pool(M)
    blocks = {b["address"]: s["segment_pool_id"] for s in segments(a) for b in s["blocks"]}
    assert blocks[got[0]] == (0, 0) and blocks[mine] == M


def test_use_counts_follow_mempool_and_use_mem_pool():
    a = alloc()
    a.create_pool(M)                          # MemPool(): createOrIncrefPool -> 1
    assert a.pool_use_count(M) == 1
    a.begin_allocate_to_pool(M)               # use_mem_pool enter: beginAllocate... -> 2
    assert a.pool_use_count(M) == 2
    a.end_allocate_to_pool(M)
    a.release_pool(M)                         # use_mem_pool exit: end + releasePool -> 1
    assert a.pool_use_count(M) == 1
    a.begin_allocate_to_pool(M, S)            # a graph captured into the MemPool shares it -> 2
    a.end_allocate_to_pool(M)
    assert a.pool_use_count(M) == 2


def test_live_pool_survives_empty_cache_and_a_released_one_is_freed_and_deleted():
    a = alloc()
    a.begin_allocate_to_pool(G, S)
    p, q = a.malloc(1000, S), a.malloc(30 * MiB, S)
    a.end_allocate_to_pool(G)
    a.free(p)
    a.free(q)
    d = a.malloc(1000, 0)
    a.free(d)
    a.empty_cache()                           # frees the default segment only
    assert sorted(pools_of(a).values()) == [G, G]
    assert a.memory_stats()["reserved_bytes.all.current"] == 2 * MiB + 30 * MiB
    a.release_pool(G)                         # the graph is gone: use_count 0, freeable
    assert G in a.freeable_pools and a.pool_use_count(G) == 0
    a.history.configure(True, ALL, 100000, True)
    a.empty_cache()
    # PyTorch releases a freeable pool's small blocks before its large ones (the default pools:
    # large first)
    assert actions(a) == [("segment_free", 2 * MiB, G), ("segment_free", 30 * MiB, G)]
    assert a.memory_stats()["reserved_bytes.all.current"] == 0
    assert G not in a.graph_pools              # cudaMalloc_count 0: deleted
    with pytest.raises(RuntimeError, match=r"^no memory pool \(1, 0\) on this device$"):
        a.pool_use_count(G)


def test_freeable_pool_keeps_segments_with_live_blocks_and_their_frees_return_to_it():
    a = alloc()
    a.begin_allocate_to_pool(G, S)
    p = a.malloc(1000, S)
    q = a.malloc(1000, S)                     # same 2 MiB segment
    a.end_allocate_to_pool(G)
    a.release_pool(G)
    a.free(p)
    a.empty_cache()                           # the segment is split (q lives): nothing freed
    assert list(pools_of(a).values()) == [G] and G in a.graph_pools
    a.free(q)                                 # back into the graph's pool, not the default one
    assert len(a.graph_pools[G].small_blocks) == 1 and len(a.small_blocks) == 0
    a.empty_cache()
    assert pools_of(a) == {} and a.graph_pools == {}


def test_empty_cache_of_one_pool_id():
    a = alloc()
    for pid in (M, (0, 2)):
        a.create_pool(pid)
        a.begin_allocate_to_pool(pid)
        a.free(a.malloc(3 * MiB, 0))
        a.end_allocate_to_pool(pid)
        a.release_pool(pid)                   # use_mem_pool's exit
    d = a.malloc(1000, 0)
    a.free(d)
    a.release_pool(M)                         # ~MemPool: releasePool, then emptyCache(id)
    syncs = a.memory_stats()["num_sync_all_streams"]
    a.empty_cache(M)
    assert sorted(pools_of(a).values()) == [(0, 0), (0, 2)]   # only M's segment went
    assert a.memory_stats()["num_sync_all_streams"] == syncs + 1   # its events were waited for


def test_no_default_release_while_a_context_is_under_way():
    a = alloc("64MiB")
    d = a.malloc(40 * MiB, 0)
    a.free(d)                                 # a cached 40 MiB default segment
    a.begin_allocate_to_pool(G, S)
    a.empty_cache()                           # during a capture: the default pools are left alone
    assert a.memory_stats()["reserved_bytes.all.current"] == 40 * MiB
    before = a.memory_stats()["num_alloc_retries"]
    with pytest.raises(OutOfMemoryError, match="Tried to allocate 40.00 MiB"):
        a.malloc(40 * MiB, S)                 # no release_cached_blocks as the last resort
    assert a.memory_stats()["num_alloc_retries"] == before
    a.end_allocate_to_pool(G)
    a.malloc(40 * MiB, 3)                     # without a capture the same request empties the cache
    assert a.memory_stats()["num_alloc_retries"] == before + 1


def test_oom_message_counts_free_private_blocks():
    a = alloc("64MiB")
    a.begin_allocate_to_pool(G, S)
    a.free(a.malloc(20 * MiB, S))             # 20 MiB free in the graph's pool
    a.end_allocate_to_pool(G)
    with pytest.raises(OutOfMemoryError) as e:
        a.malloc(50 * MiB, 0)
    msg = str(e.value)
    assert ("Of the allocated memory 20.00 MiB is allocated by PyTorch, with 20.00 MiB allocated in private "
            "pools (e.g., CUDA Graphs), and 0 bytes is reserved by PyTorch but unallocated.") in msg


def test_no_split_pool_gives_whole_blocks():
    a = alloc()
    a.create_pool(M, no_split=True)
    a.begin_allocate_to_pool(M)
    p = a.malloc(1000, 0)
    a.end_allocate_to_pool(M)
    (seg,) = segments(a)
    assert seg["blocks"] == [{"address": p, "size": 2 * MiB, "requested_size": 1000, "state": "active_allocated",
                              "frames": seg["blocks"][0]["frames"]}]
    assert a.memory_stats()["allocated_bytes.all.current"] == 2 * MiB


def test_use_on_oom_pool_serves_a_failed_default_request_from_its_cache():
    a = alloc("64MiB")
    a.create_pool(M, use_on_oom=True)
    a.begin_allocate_to_pool(M)
    a.free(a.malloc(40 * MiB, 0))             # a 40 MiB free block cached in the MemPool
    a.end_allocate_to_pool(M)
    p = a.malloc(30 * MiB, 0)                 # cudaMalloc of 30 MiB fails (24 MiB left): fallback
    blocks = {b["address"]: s["segment_pool_id"] for s in segments(a) for b in s["blocks"]}
    assert blocks[p] == M
    # the carve follows the large-pool split rule: 10 MiB remain (> 1 MiB), so it splits
    assert [b["size"] for s in segments(a) for b in s["blocks"]] == [30 * MiB, 10 * MiB]
    assert a.memory_stats()["num_alloc_retries"] == 0


def test_trace_entries_of_private_pools_carry_the_pool_id():
    a = alloc()
    a.begin_allocate_to_pool(G, S)
    a.free(a.malloc(1000, S))
    a.end_allocate_to_pool(G)
    a.free(a.malloc(1000, 0))
    assert actions(a) == [("segment_alloc", 2 * MiB, G), ("alloc", 1000, G), ("free_requested", 1000, G),
                          ("free_completed", 1000, G), ("segment_alloc", 2 * MiB, None), ("alloc", 1000, None),
                          ("free_requested", 1000, None), ("free_completed", 1000, None)]


@pytest.mark.parametrize("call, message", [
    (lambda a: a.end_allocate_to_pool((5, 0)), r"^endAllocatePool: not currently recording to mempool_id \(5, 0\)$"),
    (lambda a: a.begin_allocate_to_pool(G, S), r"^beginAllocateToPool: already recording to mempool_id \(1, 0\)$"),
    (lambda a: a.release_pool((5, 0)), r"^no memory pool \(5, 0\) on this device$"),
    (lambda a: a.release_pool(G), r"^releasePool: memory pool \(1, 0\) is still being allocated to"),
    (lambda a: a.release_pool((0, 9)), r"^releasePool: memory pool \(0, 9\) was already released$"),
    (lambda a: a.begin_allocate_to_pool((0, 9), S), r"^memory pool \(0, 9\) was released"),
    (lambda a: a.create_pool((0, 9)), r"^memory pool \(0, 9\) was released"),
    (lambda a: a.pool_use_count((0, 0)), r"^memory pool id \(0, 0\) is the default pool"),
    (lambda a: a.begin_allocate_to_pool((1, 2, 3)), r"^a memory pool id is a tuple of two ints"),
    (lambda a: a.begin_allocate_to_pool(G, -1), r"^stream must be a stream handle"),
])
def test_bad_pool_calls_say_why_and_change_nothing(call, message):
    a = alloc()
    a.create_pool((0, 7), use_on_oom=True)
    a.create_pool((0, 9))
    a.begin_allocate_to_pool((0, 9))
    a.free(a.malloc(1000, 0))
    a.end_allocate_to_pool((0, 9))
    a.release_pool((0, 9))
    a.release_pool((0, 9))                    # freeable, its free segment still cached
    a.begin_allocate_to_pool(G, S)            # use_count 1, capture under way
    a.malloc(1000, S)
    before = state(a)
    with pytest.raises((RuntimeError, ValueError, TypeError), match=message):
        call(a)
    assert state(a) == before


# -- recordings with private pools (replay) -------------------------------------------------------

def _recording(with_trace: bool = True) -> bytes:
    """A snapshot written as ``torch.cuda.memory._snapshot()`` does (``segment_pool_id`` on every
    segment, from ``owner_MempoolId()``; ``pool_id`` on the private pool's trace entries)."""
    import pickle

    from vram.views.snapshot import snapshot
    a = alloc()
    a.malloc(1000, 0)
    a.begin_allocate_to_pool(G, S)
    a.malloc(5 * MiB, S)
    a.end_allocate_to_pool(G)
    snap = snapshot([a])
    if not with_trace:
        snap["device_traces"] = [[]]
    return pickle.dumps(snap)


def test_loader_keeps_private_pool_ids_and_refuses_bad_ones():
    from vram.replay.loader import load_snapshot
    from vram.replay.messages import SnapshotError
    snap = load_snapshot(_recording())
    assert sorted(str(s.get("segment_pool_id")) for s in snap["segments"]) == ["(1, 0)", "None"]
    assert [e.get("pool_id") for e in snap["device_traces"][0]] == [None, None, G, G]
    import pickle
    raw = pickle.loads(_recording())
    raw["segments"][0]["segment_pool_id"] = (1, "x")
    with pytest.raises(SnapshotError, match=r"segment_pool_id\[1\]"):
        load_snapshot(pickle.dumps(raw))


@pytest.mark.parametrize("with_trace", [True, False])
def test_replay_verifies_recordings_with_private_pools(with_trace):
    """(Once refused; now replayed: vram.replay.pool_replay, tests/test_pool_replay.py.)"""
    from vram.replay.engine import replay
    from vram.replay.loader import load_snapshot
    snap = load_snapshot(_recording(with_trace))
    v = replay(snap, verify=True).verification
    assert v["final_blocks"]["matched"] == v["final_blocks"]["total"] == 4 and not v["divergences"]
