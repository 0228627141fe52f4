"""`vram run` with CUDA graphs and memory pools: ``torch.cuda.graph``,
``CUDAGraph``, ``graph_pool_handle``, ``MemPool``, ``use_mem_pool``.

Expectations follow ``torch/cuda/graphs.py`` (``graph.__enter__``: synchronize, empty_cache,
side stream, ``capture_begin``), ``aten/src/ATen/cuda/CUDAGraph.cpp`` (the graph's own pool id
``(n, 0)``, capture on a non-default stream only, ``replay`` allocates nothing, the pool released
when the graph dies), ``aten/src/ATen/cuda/MemPool.cpp`` (ids ``(0, n)``, use counts,
``~MemPool``: releasePool then emptyCache(id)) and the allocator's rules (spec §5, §6, §11.1):
never from printing this module's output.
"""
from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")

from vram.run.runtime import simulated_cuda  # noqa: E402

MiB = 1024 * 1024


def pools() -> dict[tuple[int, int], int]:
    out: dict[tuple[int, int], int] = {}
    for s in torch.cuda.memory_snapshot():
        out[s["segment_pool_id"]] = out.get(s["segment_pool_id"], 0) + s["total_size"]
    return out


def test_graph_capture_keeps_its_tensors_in_its_pool_and_replay_allocates_nothing() -> None:
    with simulated_cuda(gpu="24GiB"):
        x = torch.ones(1024, 1024, device="cuda")          # 4 MiB static input, default pool
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = x * 2                                       # captured: the graph's private pool
        pid = g.pool()
        assert pid[1] == 0 and pid[0] >= 1                  # a graph's own pool: (n, 0)
        p = pools()
        assert p[pid] == 20 * MiB                           # 4 MiB request: a 20 MiB segment
        # the default generator's seed/offset (2 x 8 B) live in a default small segment
        assert p[(0, 0)] == 20 * MiB + 2 * MiB
        before = torch.cuda.memory_stats()
        for _ in range(3):
            g.replay()
        assert torch.cuda.memory_stats() == before
        torch.cuda.empty_cache()                            # the pool is in use: kept
        assert pools()[pid] == 20 * MiB
        del y                                               # the block returns to the graph's pool
        assert torch.cuda.memory_allocated() == 4 * MiB + 1024
        del g
        gc.collect()                                        # the graph dies: pool released, seeds freed
        torch.cuda.empty_cache()
        assert pools() == {(0, 0): 20 * MiB}
        assert torch.cuda.memory_allocated() == 4 * MiB


def test_graphs_share_a_pool_from_graph_pool_handle() -> None:
    with simulated_cuda(gpu="24GiB"):
        handle = torch.cuda.graph_pool_handle()
        assert handle[0] == 0 and handle[1] >= 1            # user-made: (0, n)
        x = torch.ones(256, device="cuda")
        g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(g1, pool=handle):
            a = x + 1
        del a                                               # freed into the shared pool
        with torch.cuda.graph(g2, pool=handle):
            b = x + 2                                       # reuses it: no new segment
        assert g1.pool() == g2.pool() == handle
        assert pools()[handle] == 2 * MiB
        assert b.data_ptr() != 0
        del g1
        gc.collect()
        torch.cuda.empty_cache()                            # g2 still uses the pool
        assert pools()[handle] == 2 * MiB


def test_capture_on_the_default_stream_is_refused() -> None:
    with simulated_cuda(gpu="24GiB"):
        g = torch.cuda.CUDAGraph()
        before = torch.cuda.memory_stats()
        with pytest.raises(RuntimeError, match=r"^CUDA graphs must be captured on a non-default stream"):
            g.capture_begin()
        assert torch.cuda.memory_stats() == before


def test_mempool_and_use_mem_pool() -> None:
    with simulated_cuda(gpu="24GiB"):
        pool = torch.cuda.MemPool()
        assert pool.id[0] == 0 and pool.id[1] >= 1 and pool.use_count() == 1
        with torch.cuda.use_mem_pool(pool):
            assert pool.use_count() == 2
            t = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
        assert pool.use_count() == 1
        u = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")   # outside: the default pool
        assert pools() == {pool.id: 20 * MiB, (0, 0): 20 * MiB}
        del t, u
        torch.cuda.empty_cache()                            # the MemPool is alive: kept
        assert pools() == {pool.id: 20 * MiB}
        del pool
        gc.collect()                                        # ~MemPool: release + emptyCache(id)
        assert pools() == {}
        assert torch.cuda.memory_reserved() == 0
