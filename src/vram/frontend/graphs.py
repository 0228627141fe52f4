"""Layer 4: CUDA graphs and memory pools on the simulated GPUs (``torch.cuda.CUDAGraph``,
``graph_pool_handle``, ``MemPool``, ``use_mem_pool``), as the allocator sees them.

Follows ``aten/src/ATen/cuda/CUDAGraph.cpp`` and ``MemPool.cpp`` (PyTorch 2.x): a capture routes
the capturing stream's allocations to the graph's private pool (its own, ``(n, 0)``, or one
shared through ``pool=``), ``replay()`` allocates nothing, and deleting the graph releases the
pool; the default CUDA generator keeps two 8-byte tensors (``seed_extragraph_`` and
``offset_extragraph_``) in the default pool while any graph of its device exists. ``MemPool()``
creates a pool ``(0, n)`` with one use; ``use_mem_pool`` routes the calling thread's
allocations to it; a deleted MemPool is released and its free segments returned at once.
A graph's kernels themselves are not simulated: memory is what the capture allocated.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vram.frontend import memory as _memory

#: ``MemPool::uid_``: ids of user-made pools, ``(0, n)`` (``MemPool()``, ``graph_pool_handle()``)
_uid = itertools.count(1)
#: ``MemPool::uuid_``: a graph's own pool, ``(n, 0)``, when it was given none
_uuid = itertools.count(1)
#: per device (its allocator): the graphs registered with the default generator, and the
#: addresses of its two tensors
_rng_graphs: dict[Any, tuple[set[int], tuple[int, int]]] = {}


def graph_pool_handle() -> tuple[int, int]:
    """``torch.cuda.graph_pool_handle``: a new pool id that graphs can share."""
    return (0, next(_uid))


def _register_graph(alloc: Any, graph: CUDAGraph, stream: int) -> None:
    """``CUDAGeneratorState::register_graph``: the first graph allocates seed and offset."""
    entry = _rng_graphs.get(alloc)
    if entry is None:
        seed = alloc.malloc(8, stream)
        entry = _rng_graphs[alloc] = (set(), (seed, alloc.malloc(8, stream)))
    entry[0].add(id(graph))


def _unregister_graph(alloc: Any, graph: CUDAGraph) -> None:
    """``unregister_graph``: the last graph frees them."""
    entry = _rng_graphs.get(alloc)
    if entry is not None and id(graph) in entry[0]:
        entry[0].discard(id(graph))
        if not entry[0]:
            del _rng_graphs[alloc]
            for ptr in entry[1]:
                alloc.free(ptr)


class CUDAGraph:
    """``torch.cuda.CUDAGraph``: capture_begin / capture_end / replay / reset / pool."""

    def __init__(self, keep_graph: bool = False) -> None:
        self._pool: tuple[int, int] | None = None
        self._alloc: Any = None
        self._stream = -1
        self._capturing = False
        self._ended = False
        self._registered = False

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global",
                      check_input_liveness: bool = False) -> None:
        if self._ended or self._capturing:
            raise RuntimeError("This CUDAGraph instance already owns a captured graph. "
                               "To capture a new graph, create a new instance.")
        stream = _memory.current_stream().cuda_stream
        if stream == 0:
            raise RuntimeError("CUDA graphs must be captured on a non-default stream. (However, after "
                               "capture, it's ok to replay them on the default stream.)")
        alloc = _memory.get_allocator()
        pool_id: tuple[int, int] = (tuple(pool) if pool is not None and tuple(pool) != (0, 0)
                                    else (next(_uuid), 0))
        _register_graph(alloc, self, stream)  # before the capture: in the default pool
        try:
            alloc.begin_allocate_to_pool(pool_id, stream)
        except BaseException:
            _unregister_graph(alloc, self)
            raise
        self._pool, self._alloc, self._stream = pool_id, alloc, stream
        self._capturing = self._registered = True

    def capture_end(self) -> None:
        if not self._capturing:
            raise RuntimeError("capture_end without capture_begin")
        if _memory.current_stream().cuda_stream != self._stream:
            raise RuntimeError("Capture must end on the same stream it began on.")
        assert self._pool is not None
        self._alloc.end_allocate_to_pool(self._pool)
        self._capturing, self._ended = False, True

    def instantiate(self) -> None:
        return None

    def replay(self) -> None:
        """Runs the captured work again: on a simulated GPU, nothing to allocate."""
        if not self._ended:
            raise RuntimeError("Called CUDAGraph::replay without a preceding successful capture.")

    def reset(self) -> None:
        """Delete the graph: its pool loses a use (freed by a later ``empty_cache`` at none)."""
        if self._ended:
            assert self._pool is not None
            self._ended = False
            self._alloc.release_pool(self._pool)

    def pool(self) -> tuple[int, int]:
        if not self._ended or self._pool is None:
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
        return self._pool

    def enable_debug_mode(self) -> None:
        return None

    def debug_dump(self, debug_path: str) -> None:
        return None

    def __del__(self) -> None:
        try:
            if self._registered:
                self._registered = False
                _unregister_graph(self._alloc, self)
            self.reset()
        except Exception:  # noqa: BLE001, S110 - as PyTorch's destructor: never raise from it
            pass


class MemPool:
    """``torch.cuda.MemPool``: a private pool ``(0, n)`` on the current device (one use)."""

    def __init__(self, allocator: Any = None, use_on_oom: bool = False, no_split: bool = False) -> None:
        self._alloc: Any = None
        if allocator is not None:  # (docs/replay.md, "Limits": why this is refused)
            raise NotImplementedError("MemPool(allocator=...) is not simulated: a custom allocator's "
                                      "alloc/free are its own C functions, which only a real GPU runs, "
                                      "and they decide where and whether each segment is allocated")
        pool_id = (0, next(_uid))
        alloc = _memory.get_allocator()
        alloc.create_pool(pool_id, use_on_oom, no_split)
        self._id, self._alloc = pool_id, alloc

    @property
    def id(self) -> tuple[int, int]:
        return self._id

    @property
    def allocator(self) -> None:
        return None

    def use_count(self) -> int:
        return int(self._alloc.pool_use_count(self._id))

    def snapshot(self, include_traces: bool = True) -> list[dict[str, Any]]:
        return _memory.memory_snapshot(self._id, include_traces)

    def __del__(self) -> None:
        """``~MemPool``: ``releasePool``, then ``emptyCache(id)`` on every device."""
        if self._alloc is None:
            return
        try:
            self._alloc.release_pool(self._id)
            for i in range(_memory.device_count()):
                _memory.get_allocator(i).empty_cache(self._id)
        except Exception:  # noqa: BLE001, S110 - never raise from a finalizer
            pass


@contextmanager
def use_mem_pool(pool: MemPool, device: Any = None) -> Iterator[None]:
    """``torch.cuda.use_mem_pool``: route this thread's allocations on `device` to `pool`."""
    with allocating_to_pool(pool.id, device):
        yield


@contextmanager
def allocating_to_pool(pool_id: tuple[int, int], device: Any = None) -> Iterator[None]:
    """This thread's allocations on `device` go to the private pool `pool_id` while inside
    (``beginAllocateToPool``, then ``endAllocateToPool`` and ``releasePool``: the pool's
    segments are freed once nothing uses it)."""
    alloc = _memory.get_allocator(device)
    alloc.begin_allocate_to_pool(pool_id)
    try:
        yield
    finally:
        alloc.end_allocate_to_pool(pool_id)
        alloc.release_pool(pool_id)


def is_current_stream_capturing() -> bool:
    """``torch.cuda.is_current_stream_capturing``: a graph capture routes the current stream."""
    alloc = _memory.get_allocator()
    stream = _memory.current_stream().cuda_stream
    return any(s == stream for _, s, _t in alloc.captures)
