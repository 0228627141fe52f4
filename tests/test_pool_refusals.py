"""What vram once refused about private pools, now done as PyTorch does it.

Expectations follow ``DeviceCachingAllocator`` in ``c10/cuda/CUDACachingAllocator.cpp``
(``alloc_block``/``try_allocate_expandable_block``/``unmap_block``/``release_cached_blocks`` for
expandable segments in private pools; ``free``/``recordStream``/
``insert_events_deferred_until_no_capture``/``remove_cudagraph_stream_uses`` for record_stream
frees during a capture; ``try_mempool_fallback`` over ``use_on_oom_pools``;
``snapshot(mempool_id)``/``get_private_pool_head_blocks``) and ``sherwood_v3_table`` in
``c10/util/flat_hash_map.h``, not from what vram printed.
"""
from __future__ import annotations

import pytest

from test_pool_replay import CASES  # noqa: E402
from vram import CachingAllocator, SimulatedDevice
from vram.allocator.hashset import PoolIdSet
from vram.allocator.history import ALL
from vram.views.snapshot import segments

MiB = 1 << 20
S = 7
G = (1, 0)
FIB = 11400714819323198485


def alloc(total: str = "1GiB", conf: str = "", **kw: object) -> CachingAllocator:
    a = CachingAllocator(SimulatedDevice(total, **kw), conf)
    a.history.configure(True, ALL, 100000, True)
    return a


def trace(a: CachingAllocator) -> list[tuple[str, int, object]]:
    return [(e.action, e.size, e.as_dict().get("pool_id")) for e in a.history.entries if e.action != "snapshot"]


# -- expandable segments in a private pool ------------------------------------------------------
def test_expandable_segments_map_into_the_private_pool_and_are_freed_with_it():
    a = alloc(conf="expandable_segments:True")
    a.begin_allocate_to_pool(G, S)
    p, q = a.malloc(1000, S), a.malloc(5 * MiB, S)   # a 2 MiB page (small), a 20 MiB page (large)
    a.end_allocate_to_pool(G)
    assert sorted((s["segment_pool_id"], s["total_size"], s["is_expandable"]) for s in segments(a)) == [
        (G, 2 * MiB, True), (G, 20 * MiB, True)]
    assert a.graph_pools[G].cuda_malloc_count == 2   # one per successful alloc_block
    a.free(p)
    a.empty_cache()                                  # the pool is live: nothing of it is unmapped
    assert a.memory_stats()["reserved_bytes.all.current"] == 22 * MiB
    a.release_pool(G)
    a.free(q)
    a.empty_cache()
    assert trace(a) == [("segment_map", 2 * MiB, G), ("alloc", 1000, G), ("segment_map", 20 * MiB, G),
                        ("alloc", 5 * MiB, G), ("free_requested", 1000, G), ("free_completed", 1000, G),
                        ("free_requested", 5 * MiB, G), ("free_completed", 5 * MiB, G),
                        ("segment_unmap", 2 * MiB, G), ("segment_unmap", 20 * MiB, G)]
    assert a.graph_pools == {} and a.expandable_segments == []   # cudaMalloc_count 0: pool deleted
    assert a.memory_stats()["reserved_bytes.all.current"] == 0


def test_a_private_pool_that_unmaps_more_runs_than_it_mapped_fails_pytorchs_assert():
    # One alloc_block maps 3 pages (count 1); two separate free pages then unmap twice:
    # PyTorch's TORCH_INTERNAL_ASSERT(cudaMalloc_count > 0) fails at the second unmap.
    a = alloc(conf="expandable_segments:True")
    a.begin_allocate_to_pool(G, S)
    a.free(a.malloc(60 * MiB, S))
    y = a.malloc(20 * MiB, S)
    a.malloc(20 * MiB, S)
    a.free(y)
    a.end_allocate_to_pool(G)
    a.release_pool(G)
    with pytest.raises(RuntimeError, match="^INTERNAL ASSERT FAILED: .*cudaMalloc_count > 0"):
        a.empty_cache()
    assert [e[0] for e in trace(a)].count("segment_unmap") == 1


# -- a record_stream'ed block freed during a capture ---------------------------------------------
def test_free_during_capture_is_deferred_and_streams_recorded_in_the_capture_are_dropped():
    a = alloc()
    p = a.malloc(1000, 0)
    a.begin_allocate_to_pool(G, S)
    a.record_stream(p, 5)        # recorded during the capture: the graph orders it
    a.free(p)
    assert [b["state"] for s in segments(a) for b in s["blocks"] if b["address"] == p] == ["active_pending_free"]
    a.malloc(1000, 0)            # a capture is under way: no events processed, p is not reused
    a.end_allocate_to_pool(G)
    r = a.malloc(1000, 0)        # process_events: p has no stream left, so it is freed at once
    assert r == p
    acts = [x[0] for x in trace(a)]
    assert acts == ["segment_alloc", "alloc", "free_requested", "alloc", "free_completed", "alloc"]
    assert a.cuda_events == {}


def test_streams_recorded_before_the_capture_get_events_after_it():
    a = alloc(event_completion="on_sync")
    p = a.malloc(1000, 0)
    a.record_stream(p, 5)        # before the capture: it must still be waited for
    a.begin_allocate_to_pool(G, S)
    a.free(p)
    a.end_allocate_to_pool(G)
    q = a.malloc(1000, 0)        # events inserted now, on stream 5, not complete yet
    assert q != p and list(a.cuda_events) == [5]
    a.empty_cache()              # synchronize_and_free_events completes it
    assert [x[0] for x in trace(a)] == ["segment_alloc", "alloc", "free_requested", "alloc", "free_completed"]
    assert a.cuda_events == {} and a.memory_stats()["num_sync_all_streams"] == 1


def test_deferred_frees_are_inserted_by_empty_cache_too():
    a = alloc()
    p = a.malloc(1000, 0)
    a.begin_allocate_to_pool(G, S)
    a.record_stream(p, 5)
    a.free(p)
    a.end_allocate_to_pool(G)
    a.empty_cache()
    assert [x[0] for x in trace(a)] == ["segment_alloc", "alloc", "free_requested", "free_completed", "segment_free"]


# -- several use_on_oom pools ---------------------------------------------------------------------
def fib_slot(h: int, buckets: int) -> int:
    return ((FIB * h) % 2**64) >> (64 - (buckets.bit_length() - 1))


def test_pool_id_set_orders_by_fibonacci_slot():
    s = PoolIdSet()
    s.add((0, 1))
    s.add((0, 2))
    # 4 buckets (shift 62): (0, 2) hashes to slot 0, (0, 1) to slot 2
    assert (fib_slot(2, 4), fib_slot(1, 4)) == (0, 2)
    assert list(s) == [(0, 2), (0, 1)]
    s.add((0, 3))                 # 3 > 4 * 0.5: rehash to 8 buckets
    slots = {k: fib_slot(k[1], 8) for k in [(0, 1), (0, 2), (0, 3)]}
    assert list(s) == sorted(slots, key=lambda k: slots[k])  # no collisions at 8 buckets
    s.discard((0, 2))
    assert list(s) == [k for k in sorted(slots, key=lambda k: slots[k]) if k != (0, 2)]
    assert len(s) == 2 and (0, 1) in s and (0, 2) not in s


def test_several_use_on_oom_pools_are_tried_in_hash_set_order():
    a = alloc("64MiB")
    for pid in [(0, 1), (0, 2)]:
        a.create_pool(pid, use_on_oom=True)
        a.begin_allocate_to_pool(pid)
        a.free(a.malloc(24 * MiB, 0))      # each pool caches one 24 MiB block
        a.end_allocate_to_pool(pid)
    p = a.malloc(22 * MiB, 0)              # 16 MiB left: cudaMalloc fails, fallback
    owner = {b["address"]: s["segment_pool_id"] for s in segments(a) for b in s["blocks"]}
    assert owner[p] == (0, 2)              # (0, 2) sits in slot 0, (0, 1) in slot 2


# -- memory_snapshot(mempool_id) -------------------------------------------------------------------
def test_snapshot_of_one_pool_lists_its_head_blocks_only():
    a = alloc()
    a.malloc(1000, 0)
    a.begin_allocate_to_pool(G, S)
    a.malloc(5 * MiB, S)
    a.end_allocate_to_pool(G)
    segs = segments(a, G)
    assert [(s["segment_pool_id"], s["total_size"]) for s in segs] == [(G, 20 * MiB)]
    assert segments(a, (0, 9)) == []
    snaps = [e.as_dict() for e in a.history.entries if e.action == "snapshot"]
    assert snaps[-1]["pool_id"] == (0, 9) and snaps[-2]["pool_id"] == G and snaps[-2]["size"] == 5 * MiB


def test_snapshot_of_one_pool_skips_expandable_runs_that_do_not_start_their_segment():
    a = alloc(conf="expandable_segments:True")
    a.begin_allocate_to_pool(G, S)
    x = a.malloc(20 * MiB, S)
    y = a.malloc(20 * MiB, S)
    a.end_allocate_to_pool(G)
    a.free(x)
    a.release_pool(G)
    a.empty_cache()                          # unmaps x's page: y's run now follows an unmapped block
    assert [s["address"] for s in segments(a)] == [y]
    assert segments(a, G) == []              # get_private_pool_head_blocks: y has a prev


# -- replay of recordings with expandable segments in private pools ------------------------------
def es_capture(a: CachingAllocator) -> None:
    x = a.malloc(3 * MiB)
    a.begin_allocate_to_pool(G, S)
    t = [a.malloc(n, S) for n in (4 * MiB, 600, 12 * MiB, 3000, 30 * MiB)]
    a.free(t[0])
    a.free(t[3])
    t.append(a.malloc(2 * MiB, S))
    a.end_allocate_to_pool(G)
    a.free(x)
    a.malloc(3 * MiB, S)
    a.malloc(500)
    for p in t[1:]:
        if p != t[3]:
            a.free(p)
    a.release_pool(G)
    a.empty_cache()                       # unmaps the default run and both of G's segments
    a.malloc(7 * MiB)


@pytest.mark.parametrize("case", [es_capture, *CASES], ids=lambda c: c.__name__)
def test_expandable_private_pool_recordings_replay_exactly(case):
    import pickle

    from vram.replay.engine import replay
    from vram.replay.loader import load_snapshot
    from vram.views.snapshot import snapshot

    a = alloc("4GiB", "expandable_segments:True")
    case(a)
    snap = load_snapshot(pickle.dumps(snapshot([a])))
    assert any(e.get("pool_id") and e["action"] in ("segment_map", "segment_unmap") for e in snap["device_traces"][0]) \
        or any(s.get("segment_pool_id") and s["is_expandable"] for s in snap["segments"])
    r = replay(snap, verify=True, gpu="4GiB")   # the recording's GPU: its reserve size (docs/replay.md)
    v = r.verification
    assert all(v[k]["matched"] == v[k]["total"] for k in
               ("segment_maps", "segment_unmaps", "alloc_addresses", "final_segments", "final_blocks"))
    assert not v["divergences"] and not v["notes"]
    want = sorted((s["address"], s.get("segment_pool_id") or (0, 0)) for s in snap["segments"])
    assert sorted((s["address"], s["segment_pool_id"]) for s in segments(r.allocator)) == want


# -- the order emptyCache walks the freeable pools -------------------------------------------------
def test_freeable_pools_are_released_in_hash_map_slot_order():
    # graph_pools_freeable is a ska::flat_hash_map keyed by MempoolIdHash (second when first is 0):
    # with 4 buckets (0, 2) sits in slot 0 and (0, 1) in slot 2, so (0, 2)'s segment is freed
    # first although (0, 1) became freeable first. The same segments go either way.
    a = alloc()
    for pid in [(0, 1), (0, 2)]:
        a.create_pool(pid)
        a.begin_allocate_to_pool(pid)
        a.free(a.malloc((3 if pid == (0, 1) else 5) * MiB, 0))
        a.end_allocate_to_pool(pid)
        a.release_pool(pid)                     # use_mem_pool's exit: the MemPool still holds it
    a.release_pool((0, 1))                      # the MemPools die: (0, 1) freeable first
    a.release_pool((0, 2))
    assert list(a.freeable_slots) == [(0, 2), (0, 1)] == sorted(a.freeable_slots, key=lambda k: fib_slot(k[1], 4))
    a.empty_cache()
    assert [(x[0], x[2]) for x in trace(a) if x[0] == "segment_free"] == [("segment_free", (0, 2)),
                                                                        ("segment_free", (0, 1))]
    assert a.graph_pools == {} and list(a.freeable_slots) == []
