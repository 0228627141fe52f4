"""Frees run by Python's garbage collector.

A tensor that dies in a reference cycle is finalized whenever the cyclic GC runs: at any
allocation of Python objects, so also inside an allocator operation on the same thread. Such a
free is queued and applied when the operation ends, in order and exactly once, without recursion
(`CachingAllocator._end_operation`). Nothing may be lost: once every tensor is gone and the cache
is emptied, nothing is allocated or reserved, and every invariant of tests/invariants.py holds.
"""
from __future__ import annotations

import gc
import os
import random
import sys
import threading
from typing import Any

import pytest

import vram
import vram.allocator.caching as caching
from vram.frontend.tensor import Tensor

sys.path.insert(0, os.path.dirname(__file__))
from invariants import check_invariants  # noqa: E402

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _gc_state():
    threshold = gc.get_threshold()
    was_enabled = gc.isenabled()
    vram.simulate("16GiB")
    gc.collect()
    gc.freeze()  # what earlier tests left in this process: not this test's, and not to be walked at every collection
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)
    if was_enabled:
        gc.enable()
    vram.simulate()


def _in_cycle(t: Tensor) -> None:
    """Leave `t` reachable only from a reference cycle: it dies at the next collection."""
    c: list[Any] = [t]
    c.append(c)


def _assert_nothing_lost() -> None:
    gc.collect()
    vram.synchronize()
    vram.empty_cache()
    a = vram.get_allocator(0)
    assert vram.memory_allocated() == 0
    assert vram.memory_reserved() == 0
    assert not a.active and not a._deferred and not a._busy
    check_invariants(a)


def test_thousand_cycle_frees_inside_one_malloc(monkeypatch):
    """1,000 tensors in cycles, all finalized by one collection inside malloc: 1,000 queued frees.
    Draining them recursively overflowed the stack and lost about half of them."""
    gc.disable()  # the one collection is the one inside malloc
    for _ in range(1000):
        _in_cycle(vram.empty(512, dtype="uint8"))  # 1,000 blocks of 512 B in 2 MiB segments
    assert vram.memory_allocated() == 1000 * 512
    collected = []

    class GCBlock(caching.Block):
        __slots__ = ()

        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            if not collected:
                collected.append(gc.collect())  # finalizes all 1,000 inside malloc

    monkeypatch.setattr(caching, "Block", GCBlock)
    # a fresh 20 MiB segment: its remainder is split off as a new Block -> the collection
    big = vram.empty(3 * MiB, dtype="uint8")
    monkeypatch.undo()
    assert collected and collected[0] >= 1000
    assert vram.memory_allocated() == 3 * MiB  # all 1,000 freed once malloc was done
    stats = vram.memory_stats()
    assert stats["allocation.all.freed"] == 1000
    assert stats["num_alloc_retries"] == 0
    check_invariants(vram.get_allocator(0))
    del big
    _assert_nothing_lost()


def test_frees_arriving_while_the_queue_drains_join_its_end(monkeypatch):
    """A collection during the drain (a queued free runs Python code that allocates) queues
    further frees behind the remaining ones: applied after them, once, without recursion."""
    gc.disable()  # collections only where this test runs them
    a = vram.get_allocator(0)
    first = [vram.empty(MiB) for _ in range(3)]
    first_ptrs = {t.data_ptr() for t in first}
    keep = [vram.empty(MiB)]
    second_ptr = keep[0].data_ptr()
    order: list[int] = []
    real_free = caching.CachingAllocator._free

    def spying_free(self: Any, ptr: int) -> None:
        order.append(ptr)
        real_free(self, ptr)
        if len(order) == 1:
            _in_cycle(keep.pop())
            gc.collect()  # finalizes the fourth tensor while the queue drains

    monkeypatch.setattr(caching.CachingAllocator, "_free", spying_free)
    for t in first:
        _in_cycle(t)
    del first, t
    with a.operation():
        gc.collect()  # three frees queued
        assert order == [] and len(a._deferred) == 3
    monkeypatch.undo()
    assert set(order[:3]) == first_ptrs and order[3:] == [second_ptr]
    _assert_nothing_lost()


def test_a_failing_deferred_free_is_reported_not_swallowed(monkeypatch):
    """A double free queued from a finalizer is reported through sys.unraisablehook, as Python
    reports exceptions raised in finalizers; the frees queued after it still run."""
    reports: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", reports.append)
    a = vram.get_allocator(0)
    good = vram.empty(MiB)
    ptr = good.data_ptr()
    with a.operation():
        a.free(0xDEAD000)  # not a block: queued, fails when applied
        a.free(ptr)  # queued behind it
        assert vram.memory_allocated() == 4 * MiB
        good._storage._ptr = 0  # the storage no longer owns it (freed above)
    assert vram.memory_allocated() == 0
    assert len(reports) == 1
    assert reports[0].exc_type is RuntimeError
    assert "invalid device pointer: 0xdead000" in str(reports[0].exc_value)
    del good
    _assert_nothing_lost()


def test_mutating_operation_reentered_from_a_finalizer_is_refused():
    a = vram.get_allocator(0)
    with a.operation():
        with pytest.raises(RuntimeError, match="re-entered"):
            a.malloc(1024)
        with pytest.raises(RuntimeError, match="re-entered"):
            a.empty_cache()
        assert a.memory_stats()["allocation.all.current"] == 0  # read-only: runs nested
    _assert_nothing_lost()


def _random_ops(seed: int, steps: int, check_every: int = 0) -> None:
    rng = random.Random(seed)
    live: list[Tensor] = []
    side = vram.Stream()
    for step in range(steps):
        r = rng.random()
        if r < 0.45 or not live:
            n = rng.choice([rng.randrange(1, 4096), rng.randrange(1, MiB), rng.randrange(MiB, 30 * MiB)])
            t = vram.empty(n, dtype="uint8", stream=side if rng.random() < 0.2 else None)
            if rng.random() < 0.35:
                _in_cycle(t)
            else:
                live.append(t)
            del t
        elif r < 0.85:
            live.pop(rng.randrange(len(live)))
        elif r < 0.9:
            live[rng.randrange(len(live))].record_stream(side)
        elif r < 0.93:
            vram.empty_cache()
        elif r < 0.96:
            vram.memory_snapshot()
        else:
            gc.collect()
        if check_every and step % check_every == 0:
            a = vram.get_allocator(0)
            with a.operation():
                check_invariants(a)
    live.clear()


@pytest.mark.parametrize("seed", [0, 1])
def test_random_workload_with_frequent_collections(seed):
    """The collector runs every few allocations, so inside malloc, free, empty_cache, snapshots."""
    gc.set_threshold(3, 1, 1)
    _random_ops(seed, 4000, check_every=97)
    gc.set_threshold(700, 10, 10)
    _assert_nothing_lost()


def test_eight_threads_with_cycles_and_collections():
    """8 threads allocate, drop cycles and collect at once: the lock orders them, and frees
    finalized on any thread during another thread's operation wait for the lock."""
    gc.set_threshold(5, 1, 1)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            _random_ops(seed, 600)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(100 + i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    gc.set_threshold(700, 10, 10)
    assert not errors, errors
    _assert_nothing_lost()
