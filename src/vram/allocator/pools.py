"""Private pools (spec §1, §5, §11.1): the pools of CUDA graphs and ``torch.cuda.MemPool``.

Follows ``DeviceCachingAllocator`` in ``c10/cuda/CUDACachingAllocator.cpp``: a `PrivatePool` owns
its own small and large `BlockPool` and is found by its id (``graph_pools``); while an
allocation context is under way (``captures_underway``: a graph capture routing one stream, a
``use_mem_pool`` routing one thread) ``get_pool`` sends matching requests to the most recently
begun context's pool (LIFO). Blocks never leave the pool they were carved from: a freed block
returns to its own pool, so a private pool's memory serves only that pool. ``releasePool``
(a graph reset, a MemPool's end) drops the pool's use count; at zero the pool is "freeable" and
the next ``release_cached_blocks`` (``empty_cache``, the retry chain's last step) frees its whole
free segments, deleting the pool once it has no segment left (``cudaMalloc_count`` = 0).

While any context is under way, ``malloc`` neither processes cross-stream events nor empties the
cache as its last resort, and ``empty_cache`` leaves the default pools alone (PyTorch's
``captures_underway.empty()`` checks).
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Any

from vram.devices.base import Event

from .block import Block, BlockPool
from .hashset import PoolIdSet
from .native import mypyc_attr, trait
from .release import ReleaseMixin

K_SMALL_SIZE = 1048576

#: the default pool's id (``MempoolId_t{0, 0}``)
DEFAULT_POOL = (0, 0)


class PrivatePool:
    """``PrivatePool``: an id, a use count (live graphs / MemPools / contexts using it), the count
    of its segments not yet freed (``cudaMalloc_count``) and its own small and large pools."""

    __slots__ = ("id", "use_count", "cuda_malloc_count", "large_blocks", "small_blocks")

    def __init__(self, pool_id: tuple[int, int]) -> None:
        self.id = pool_id
        self.use_count = 1
        self.cuda_malloc_count = 0
        self.large_blocks = BlockPool(False, self, pool_id)
        self.small_blocks = BlockPool(True, self, pool_id)


def check_pool_id(pool_id: Any) -> tuple[int, int]:
    """A pool id: two non-negative ints, not both 0 (``(0, 0)`` is the default pool)."""
    if (not isinstance(pool_id, tuple) or len(pool_id) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**64 for x in pool_id)):
        raise TypeError(f"a memory pool id is a tuple of two ints in [0, 2**64), got {pool_id!r}")
    if pool_id == DEFAULT_POOL:
        raise ValueError("memory pool id (0, 0) is the default pool, not a private pool")
    return (int(pool_id[0]), int(pool_id[1]))


@trait
@mypyc_attr(allow_interpreted_subclasses=True)  # as CachingAllocator (vram.allocator.native)
class PrivatePoolsMixin(ReleaseMixin):
    """`CachingAllocator`'s private pools; every method runs with the allocator's lock held
    except the public ones, which take it."""

    # State owned by `CachingAllocator` (declared for the type checker; more in ReleaseMixin).
    cuda_events: dict[int, deque[tuple[Event, Block]]]
    active: dict[int, Block]
    #: ``graph_pools``: every private pool alive, by id
    graph_pools: dict[tuple[int, int], PrivatePool]
    #: ``graph_pools_freeable``: pools no graph or MemPool uses any more
    freeable_pools: dict[tuple[int, int], PrivatePool]
    #: the same ids in the iteration order of PyTorch's ``ska::flat_hash_map`` (`_release_pool_blocks`)
    freeable_slots: PoolIdSet
    #: pools a replay releases in the recorded order (`vram.replay.pool_replay`), after the others
    release_order: list[tuple[int, int]]
    #: ``captures_underway``: (pool id, stream routed or -1, thread routed or -1), oldest first
    captures: list[tuple[tuple[int, int], int, int]]
    #: ``use_on_oom_pools``, in the iteration order of PyTorch's hash set
    oom_pools: PoolIdSet
    #: ``needs_events_deferred_until_no_capture``: blocks used on other streams freed during a
    #: capture, in the order freed
    deferred_frees: list[Block]
    #: ``block_to_cudagraph_stream_uses``: streams a block was recorded on during a capture
    graph_stream_uses: dict[Block, set[int]]

    # Implemented by the allocator's other parts (declared for the type checker and mypyc).
    def _operation(self, mutates: bool) -> Any:
        raise NotImplementedError

    def _get_free_block(self, pool: BlockPool, stream: int, size: int, es: bool) -> Block | None:
        raise NotImplementedError

    def _insert_events(self, block: Block) -> None:
        raise NotImplementedError

    def _free_block(self, block: Block, frames: Any) -> None:
        raise NotImplementedError

    def _new_block(self, pool: BlockPool, stream: int, size: int, alloc_size: int,
                   frames: Any) -> tuple[Block, BlockPool]:
        raise NotImplementedError

    def _alloc_found_block(self, block: Block, pool: BlockPool, stream: int, size: int,
                           orig_size: int, frames: Any, es: bool) -> int:
        raise NotImplementedError

    def _init_pools(self) -> None:
        self.graph_pools = {}
        self.freeable_pools = {}
        self.freeable_slots = PoolIdSet()
        self.release_order = []
        self.captures = []
        self.oom_pools = PoolIdSet()
        self.deferred_frees = []
        self.graph_stream_uses = {}

    # -- the public API (``CUDAAllocator``'s pool methods) -----------------------------------
    def create_pool(self, pool_id: Any, use_on_oom: bool = False, no_split: bool = False) -> None:
        """``createOrIncrefPool`` (+ ``setUseOnOOM``, ``setNoSplit``): what ``MemPool()`` does."""
        pool_id = check_pool_id(pool_id)
        with self._operation(True):
            pp = self.graph_pools.get(pool_id)
            if pp is not None and pp.use_count == 0:
                raise RuntimeError(f"memory pool {pool_id} was released: its id cannot be used again")
            self._create_or_incref(pool_id)
            if use_on_oom:  # ``setUseOnOOM``
                self.oom_pools.add(pool_id)
            if no_split:
                pool = self.graph_pools[pool_id]
                pool.small_blocks.no_split = pool.large_blocks.no_split = True

    def begin_allocate_to_pool(self, pool_id: Any, stream: Any = None) -> None:
        """``beginAllocateToPool``: route `stream`'s allocations (a graph capture), or, with
        `stream` None, the calling thread's (``beginAllocateCurrentThreadToPool``, what
        ``use_mem_pool`` does), to the pool, creating it or adding a use."""
        pool_id = check_pool_id(pool_id)
        if stream is not None and (isinstance(stream, bool) or not isinstance(stream, int) or stream < 0):
            raise TypeError(f"stream must be a stream handle (an int >= 0), got {stream!r}")
        with self._operation(True):
            # Checked before the use is added (PyTorch adds it, then raises): a refused call
            # leaves the allocator as it was.
            if any(c[0] == pool_id for c in self.captures):
                raise RuntimeError(f"beginAllocateToPool: already recording to mempool_id {pool_id}")
            pp = self.graph_pools.get(pool_id)
            if pp is not None and pp.use_count == 0:
                raise RuntimeError(f"memory pool {pool_id} was released: nothing can allocate to it again")
            self._create_or_incref(pool_id)
            if stream is None:
                self.captures.append((pool_id, -1, threading.get_ident()))
            else:
                self.captures.append((pool_id, int(stream), -1))

    def end_allocate_to_pool(self, pool_id: Any) -> None:
        """``endAllocateToPool``: stop routing allocations to the pool."""
        pool_id = check_pool_id(pool_id)
        with self._operation(True):
            for i, c in enumerate(self.captures):
                if c[0] == pool_id:
                    del self.captures[i]
                    return
            raise RuntimeError(f"endAllocatePool: not currently recording to mempool_id {pool_id}")

    def release_pool(self, pool_id: Any) -> None:
        """``releasePool`` (a graph's reset, a MemPool's end, the end of ``use_mem_pool``): one use
        fewer; at none the pool is freeable, its segments freed by the next ``empty_cache``."""
        pool_id = check_pool_id(pool_id)
        with self._operation(True):
            pp = self._private_pool(pool_id)
            if pp.use_count == 0:
                raise RuntimeError(f"releasePool: memory pool {pool_id} was already released")
            if pp.use_count == 1 and any(c[0] == pool_id for c in self.captures):
                raise RuntimeError(f"releasePool: memory pool {pool_id} is still being allocated to "
                                   "(end its graph capture or use_mem_pool first)")
            pp.use_count -= 1
            if pp.use_count == 0:
                self.freeable_pools[pool_id] = pp
                self.freeable_slots.add(pool_id)
                self.oom_pools.discard(pool_id)  # (PyTorch would assert at its next OOM fallback)

    def pool_use_count(self, pool_id: Any) -> int:
        """``getPoolUseCount`` (``MemPool.use_count()``)."""
        pool_id = check_pool_id(pool_id)
        with self._operation(False):
            return self._private_pool(pool_id).use_count

    # -- internals ----------------------------------------------------------------------------
    def _private_pool(self, pool_id: tuple[int, int]) -> PrivatePool:
        pp = self.graph_pools.get(pool_id)
        if pp is None:
            raise RuntimeError(f"no memory pool {pool_id} on this device")
        return pp

    def _create_or_incref(self, pool_id: tuple[int, int]) -> None:
        pp = self.graph_pools.get(pool_id)
        if pp is None:
            self.graph_pools[pool_id] = PrivatePool(pool_id)
        else:
            pp.use_count += 1

    def _route(self, size: int, stream: int) -> BlockPool:
        """``get_pool``: the pool of the most recently begun context that takes `stream` (graph
        capture) or this thread (MemPool), else the default pool; small iff size ≤ 1 MiB."""
        tid = -2
        for pool_id, s, t in reversed(self.captures):
            if t != -1:
                if tid == -2:
                    tid = threading.get_ident()
                if t != tid:
                    continue
            elif s != stream:
                continue
            pp = self.graph_pools[pool_id]
            return pp.small_blocks if size <= K_SMALL_SIZE else pp.large_blocks
        return self.small_blocks if size <= K_SMALL_SIZE else self.large_blocks

    def _malloc_routed(self, orig_size: int, size: int, alloc_size: int, stream: int, frames: Any) -> int:
        """``malloc`` while a context is under way (spec §9 with ``captures_underway`` not empty):
        the pool from `_route`; no event processing, and no emptying of the cache as the last
        resort before the OOM (`CachingAllocator._new_block`)."""
        pool = self._route(size, stream)
        es = self.config.expandable_segments  # (active in private pools too: spec §14)
        block = self._get_free_block(pool, stream, size, es)
        if block is None:
            block, found = self._new_block(pool, stream, size, alloc_size, frames)
            es, pool = es and found is pool, found
        return self._alloc_found_block(block, pool, stream, size, orig_size, frames, es)

    def _mempool_fallback(self, stream: int, size: int) -> tuple[Block, BlockPool] | None:
        """``try_mempool_fallback``: a cached block of the ``use_on_oom`` MemPool, when a request
        for the default pool found neither a cached block nor a new segment (never a new
        segment for the MemPool; best fit as with expandable segments off: ``AllocParams(...,
        false)``, so expandable blocks are passed over and the found block splits by the rule of
        ordinary segments)."""
        for pool_id in self.oom_pools:
            pp = self.graph_pools[pool_id]
            pool = pp.small_blocks if size <= K_SMALL_SIZE else pp.large_blocks
            block = self._get_free_block(pool, stream, size, False)
            if block is not None:
                return block, pool
        return None

    def pool_head_blocks(self, pool_id: tuple[int, int]) -> list[Block]:
        """``get_private_pool_head_blocks``: the first block of each segment of the pool, its
        active ones first, then its free mapped ones ([] for no such pool). An expandable run
        that does not start its segment has an unmapped block before it, so it is not a head."""
        pp = self.graph_pools.get(pool_id)
        if pp is None:
            return []
        heads = [b for b in self.active.values() if b.pool.owner is pp and b.prev is None]
        for pool in (pp.small_blocks, pp.large_blocks):
            heads += [b for b in pool.blocks.values() if b.prev is None]
        return heads

    def _private_pool_free(self) -> int:
        """Bytes of free cached blocks in private pools (the OOM message's "allocated in private
        pools", spec §15.1)."""
        total = 0
        for pp in self.graph_pools.values():
            for pool in (pp.large_blocks, pp.small_blocks):
                for b in pool.blocks.values():
                    total += b.size
        return total

    def _empty_cache(self, frames: Any, mempool_id: tuple[int, int]) -> None:
        """``release_cached_blocks(context, mempool_id)``: the default pools unless a context is
        under way or a private pool is named, then the freeable private pools."""
        if mempool_id == DEFAULT_POOL and not self.captures:
            self._release_cached_blocks(frames)
        elif mempool_id != DEFAULT_POOL and self.captures and mempool_id in self.freeable_pools:
            raise RuntimeError("empty_cache of a freeable memory pool while a graph capture or MemPool "
                               "context is under way (PyTorch asserts: it cannot wait for events then)")
        else:
            self._release_pool_blocks(mempool_id, frames)

    def _release_pool_blocks(self, pool_id: tuple[int, int], frames: Any) -> None:
        """``release_cached_blocks``' second half: free the whole free segments of freeable pools
        (all of them, or only `pool_id` when it is not the default pool's id), small then large,
        deleting a pool with no segment left. PyTorch walks ``graph_pools_freeable``, a
        ``ska::flat_hash_map<MempoolId_t, PrivatePool*, MempoolIdHash>``, erasing as it goes
        (``it = erase(it)``: the backward shift moves the next entries into the erased slot and
        the loop reads that slot again), so the pools are visited in the table's slot order at the
        call (`PoolIdSet`). The order changes no block released, only the order of the
        ``segment_free`` entries and cudaFree calls."""
        if not self.freeable_pools:
            return
        default = pool_id == DEFAULT_POOL
        forced = [pid for pid in self.release_order if pid in self.freeable_pools]
        last = set(forced)
        order = [pid for pid in self.freeable_slots if pid not in last] + forced
        for pid in order:
            pp = self.freeable_pools[pid]
            if not default:
                if pid != pool_id:
                    continue
                self._sync_pool_events(pp, frames)
            self._release_blocks(pp.small_blocks, frames)
            self._release_blocks(pp.large_blocks, frames)
            if pp.cuda_malloc_count == 0:
                del self.graph_pools[pid]
                del self.freeable_pools[pid]
                self.freeable_slots.discard(pid)

    def _sync_pool_events(self, pp: PrivatePool, frames: Any) -> None:
        """``synchronize_and_free_events(context, pool)``: wait only for the events of blocks of `pp`."""
        self.stats.num_sync_all_streams += 1
        self._insert_deferred_events(frames)
        for stream in list(self.cuda_events):
            queue = self.cuda_events[stream]
            keep: deque[tuple[Event, Block]] = deque()
            for event, block in queue:
                if block.pool.owner is not pp:
                    keep.append((event, block))
                    continue
                self.device.synchronize_event(event)
                block.event_count -= 1
                if block.event_count == 0:
                    self._free_block(block, frames)
            if keep:
                self.cuda_events[stream] = keep
            else:
                del self.cuda_events[stream]

    def _insert_deferred_events(self, frames: Any) -> None:
        """``insert_events_deferred_until_no_capture`` (first thing in ``process_events`` and
        ``synchronize_and_free_events``, which run only with no capture under way): the frees
        deferred during a capture get their events now, on the streams recorded before the
        capture only (``remove_cudagraph_stream_uses``: the graph orders the others); a block
        with none left is freed at once. In the order freed (PyTorch ≤ 2.8 keeps a vector; later
        ones a hash map keyed by the block's address, whose order no recording shows)."""
        if not self.deferred_frees:
            return
        blocks, self.deferred_frees = self.deferred_frees, []
        for block in blocks:
            during = self.graph_stream_uses.pop(block, None)
            if during is not None and block.stream_uses:
                block.stream_uses = {s for s in block.stream_uses if s not in during}
            self._insert_events(block)
            if block.event_count == 0:
                self._free_block(block, frames)
