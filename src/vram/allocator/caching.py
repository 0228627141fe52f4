"""Layer 2: PyTorch's CUDA caching allocator ("native" backend), one instance per device.

Follows the behavioural spec (``shared/spec/pytorch-allocator.md``) §4–§16 and the control flow of
``DeviceCachingAllocator`` in ``c10/cuda/CUDACachingAllocator.cpp``:
``malloc`` → best fit in the cache → GC → new segment → release oversize cached blocks → release
every cached segment and retry → OOM. ``free`` merges with free neighbours, or, for a block used
on other streams, waits for events first.
"""
from __future__ import annotations

import gc
import sys
import threading
import types
from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NoReturn

from vram.devices.base import Device, Event

from .block import SIZE_SHIFT, STREAM_SHIFT, Block, BlockPool, try_merge_blocks
from .checks import STREAM_MAX, Checked, check_ptr, check_size, check_stream
from .config import (
    AllocatorConfig,
    ConfigError,
    alloc_conf_from_env,
    as_int64,
    caching_disabled_from_env,
    parse_alloc_conf,
)
from .errors import EB_MESSAGE, OutOfMemoryError, oom_message
from .expandable import ExpandableSegment, ExpandableSegmentsMixin, unmapped_next_size
from .history import ALL, STATE, History
from .native import mypyc_attr
from .pools import DEFAULT_POOL, PrivatePoolsMixin, check_pool_id
from .stats import DeviceStats

# Constants, spec §2.
K_MIN_BLOCK_SIZE = 512
K_SMALL_SIZE = 1048576
K_SMALL_BUFFER = 2097152
K_MIN_LARGE_ALLOC = 10485760
K_ROUND_LARGE = 2097152
ONE_EB = 1 << 60


def round_size(size: int, divisions: list[int]) -> int:
    """Request rounding (spec §4): 512-byte multiples, or power-of-two divisions when configured."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    bucket = size.bit_length() - 21
    d = divisions[0 if bucket < 0 else (15 if bucket > 15 else bucket)]
    if d > 1 and size > K_MIN_BLOCK_SIZE * d:
        if size & (size - 1) == 0:
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor >> (d.bit_length() - 1)
        if step == 0:
            return floor << 1
        rounded = size & ~(step - 1)
        return size if rounded == size else rounded + step
    return (size + 511) & ~511


def allocation_size(size: int, large_segment_size: int = 20971520) -> int:
    """Segment size for a rounded request (spec §6): 2 MiB, 20 MiB, or a 2 MiB multiple."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return large_segment_size
    return (size + K_ROUND_LARGE - 1) // K_ROUND_LARGE * K_ROUND_LARGE


def _native(config: AllocatorConfig) -> AllocatorConfig:
    """Refuse ``backend:cudaMallocAsync``: vram is PyTorch's native caching allocator. The async
    backend hands every request to CUDA's stream-ordered pool (``cudaMallocAsync``), whose
    reservations follow the driver's release threshold and pool policy, which nothing records:
    simulating it as native would print wrong numbers."""
    if config.backend == "cudaMallocAsync":
        raise ConfigError("backend:cudaMallocAsync is not simulated: vram models PyTorch's native caching "
                          "allocator (CUDA's stream-ordered pool decides its own reservations); use "
                          "backend:native or leave the backend unset")
    return config


def _pause_collector() -> bool:
    """Pause Python's cyclic GC for an allocator operation (see `CachingAllocator.operation`);
    True when it was running, for the caller to ``gc.enable()`` afterwards."""
    if gc.isenabled():
        gc.disable()
        return True
    return False


def _report_unraisable(exc: BaseException, message: str) -> None:
    """Report `exc` as CPython reports an exception raised in a finalizer (``sys.unraisablehook``)."""
    sys.unraisablehook(types.SimpleNamespace(exc_type=type(exc), exc_value=exc,
                                             exc_traceback=exc.__traceback__, err_msg=message, object=None))


@mypyc_attr(allow_interpreted_subclasses=True)  # see vram.allocator.native
class CachingAllocator(ExpandableSegmentsMixin, PrivatePoolsMixin):
    """PyTorch's caching allocator for one device (spec §1–§16).

    `alloc_conf` is a ``PYTORCH_CUDA_ALLOC_CONF``-style string; when None the environment is read
    (``PYTORCH_CUDA_ALLOC_CONF``, then ``PYTORCH_ALLOC_CONF``). ``oom_format="legacy"`` gives the
    torch ≤ 2.0 OOM text. Thread-safe: one re-entrant lock per device, as PyTorch.
    """

    def __init__(self, device: Device, alloc_conf: Checked = None, *,
                 environ: Mapping[str, str] | None = None, oom_format: Checked = "current") -> None:
        if oom_format not in ("current", "legacy"):
            raise ValueError(f"oom_format must be 'current' or 'legacy', got {oom_format!r}")
        text = alloc_conf if alloc_conf is not None else alloc_conf_from_env(environ)
        self.config: AllocatorConfig = _native(parse_alloc_conf(text))
        self.caching_disabled = caching_disabled_from_env(environ)
        self.device = device
        self.oom_format = oom_format
        self.lock = threading.RLock()
        self.small_blocks = BlockPool(is_small=True)
        self.large_blocks = BlockPool(is_small=False)
        #: active blocks (allocated, or freed but waiting for events), by address
        self.active: dict[int, Block] = {}
        # The stat is M as int64 at creation (spec §16.1): SIZE_MAX shows as -1.
        self.stats = DeviceStats(as_int64(self.config.max_split_size))
        self.total_allocated_memory = 0
        self.allowed_memory_maximum: int | None = None
        self.cuda_events: dict[int, deque[tuple[Event, Block]]] = {}
        self.expandable_segments: list[ExpandableSegment] = []
        self.uncached: dict[int, int] = {}  # bypass mode (PYTORCH_NO_CUDA_MEMORY_CACHING): ptr -> size
        self.history = History()
        self._init_pools()  # private pools (vram.allocator.pools)
        self._busy = False  # an operation is under way on the thread holding the lock
        self._deferred: deque[int] = deque()  # frees that arrived during it (see `_end_operation`)
        if self.config.per_process_memory_fraction < 1.0:
            self._set_fraction(self.config.per_process_memory_fraction)

    # -- configuration ----------------------------------------------------------------------
    def set_allocator_settings(self, text: Checked) -> None:
        """``torch.cuda.memory._set_allocator_settings``: re-parse (spec §3.1); bad text changes nothing."""
        with self.lock:
            self.config = _native(parse_alloc_conf(text, self.config))

    def _set_fraction(self, fraction: float) -> None:
        if fraction < 1.0:
            self.allowed_memory_maximum = int(fraction * float(self.device.total_memory))
        else:
            self.allowed_memory_maximum = None

    def set_memory_fraction(self, fraction: Checked) -> None:
        """Cap this allocator's driver allocations at ``floor(fraction × total)`` (spec §13)."""
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        with self.lock:
            self._set_fraction(float(fraction))

    def get_memory_fraction(self) -> float:
        if self.allowed_memory_maximum is None:
            return 1.0
        return self.allowed_memory_maximum / self.device.total_memory

    def _gc_active(self) -> bool:
        return self.allowed_memory_maximum is not None and self.config.garbage_collection_threshold > 0.0

    # -- malloc -----------------------------------------------------------------------------
    def malloc(self, size: Checked, stream: Checked = 0) -> int:
        """Allocate `size` bytes on `stream`; returns the block address (0 for 0 bytes) (spec §9)."""
        if type(size) is not int or size < 0:
            size = check_size(size)
        if type(stream) is not int or not 0 <= stream <= STREAM_MAX:
            stream = check_stream(stream)
        if size >= ONE_EB:
            raise OutOfMemoryError(EB_MESSAGE)
        if size == 0:
            return 0
        with self.lock:
            if self._busy:
                raise RuntimeError("CachingAllocator.malloc re-entered during another allocator "
                                   "operation on the same thread (from a finalizer?)")
            self._busy = True
            collecting = _pause_collector()
            try:
                return self._malloc(size, stream)
            finally:
                if collecting:
                    gc.enable()
                if self._deferred:
                    self._end_operation()
                else:
                    self._busy = False

    def _malloc(self, size: int, stream: int) -> int:
        """`malloc` with the lock held and arguments checked."""
        if self.caching_disabled:
            return self._malloc_uncached(size)
        history = self.history
        frames = history.gather(STATE) if history.context >= STATE else None
        config = self.config
        rounded = round_size(size, config.roundup_power2_divisions)
        alloc_size = allocation_size(rounded, config.large_segment_size)
        if self.captures:  # a graph capture or MemPool context is under way (vram.allocator.pools)
            return self._malloc_routed(size, rounded, alloc_size, stream, frames)
        if self.cuda_events or self.deferred_frees:
            self.process_events(frames)
        pool = self.small_blocks if rounded <= K_SMALL_SIZE else self.large_blocks
        es = config.expandable_segments
        block = self._get_free_block(pool, stream, rounded, es)
        if block is None:
            block, found = self._new_block(pool, stream, rounded, alloc_size, frames)
            es, pool = es and found is pool, found  # (a ``use_on_oom`` pool's block: not expandable)
        return self._alloc_found_block(block, pool, stream, rounded, size, frames, es)

    def _new_block(self, pool: BlockPool, stream: int, size: int, alloc_size: int,
                   frames: Any) -> tuple[Block, BlockPool]:
        """No cached block fits (spec §9 step 4): GC, a new segment, a ``use_on_oom`` MemPool's
        cached block, oversize releases, then — unless a graph capture or MemPool context is under
        way — every cached segment; or the OOM. Returns the block and the pool it came from."""
        if self._gc_active():
            self._garbage_collect_cached_blocks(frames)
        block = self._alloc_block(pool, stream, size, alloc_size, False, frames)
        if block is None and self.oom_pools and pool.owner is None:
            found = self._mempool_fallback(stream, size)
            if found is not None:
                return found
        if block is None and self._release_available_cached_blocks(pool, stream, size, frames):
            block = self._alloc_block(pool, stream, size, alloc_size, False, frames)
        if block is None and not self.captures:
            self._release_cached_blocks(frames)
            block = self._alloc_block(pool, stream, size, alloc_size, True, frames)
        if block is None:
            self._raise_oom(pool, stream, size, alloc_size, frames)
        return block, pool

    def _get_free_block(self, pool: BlockPool, stream: int, size: int, es: bool) -> Block | None:
        """Best fit (spec §7): smallest free block of this stream ≥ size, lowest address on ties;
        `es`: ``AllocParams::is_expandable_segments_active`` (else expandable blocks are passed over)."""
        config = self.config
        if self.allowed_memory_maximum is not None and config.garbage_collection_threshold > 0.0:
            pool.get_free_blocks_call_count += 1
        keys = pool.keys
        key = keys.ceiling((stream << STREAM_SHIFT) | (size << SIZE_SHIFT))
        if key is None or key >> STREAM_SHIFT != stream:
            return None
        block = pool.blocks[key]
        if block.expandable_segment is not None:
            if es:
                # Best fit by the size a block can grow to: pass over a block that fronts the
                # unmapped tail of its segment when a smaller candidate follows (spec §7.3).
                xsize = block.size + unmapped_next_size(block)
                while block.expandable_segment is not None:
                    nkey = keys.higher(key)
                    if nkey is None or nkey >> STREAM_SHIFT != stream:
                        break
                    nblock = pool.blocks[nkey]
                    nx = nblock.size + unmapped_next_size(nblock)
                    if nx >= xsize:
                        break
                    key, block, xsize = nkey, nblock, nx
            else:
                while block.expandable_segment is not None:
                    key = keys.higher(key)
                    if key is None or key >> STREAM_SHIFT != stream:
                        return None
                    block = pool.blocks[key]
        max_split = config.max_split_size
        if size < max_split:
            if block.size >= max_split:
                return None
        elif block.size >= size + config.max_non_split_rounding:
            return None
        pool.remove(block)
        return block

    def _alloc_block(self, pool: BlockPool, stream: int, size: int, alloc_size: int,
                     is_retry: bool, frames: Any) -> Block | None:
        """Get a new segment from the device (spec §9.1)."""
        stats = self.stats
        if is_retry:
            stats.num_alloc_retries += 1
        if (self.allowed_memory_maximum is not None
                and self.total_allocated_memory + alloc_size > self.allowed_memory_maximum):
            return None
        if self.config.expandable_segments:
            return self._try_allocate_expandable_block(pool, stream, size, frames)
        ptr = self.device.malloc(alloc_size)
        if ptr is None:
            return None
        block = Block(stream, alloc_size, pool, ptr)
        block.segment_frames = frames
        if pool.owner is not None:
            pool.owner.cuda_malloc_count += 1
        self.total_allocated_memory += alloc_size
        stats.on_segment(pool.stat_index, 1, alloc_size)
        if alloc_size >= self.config.max_split_size:
            stats.oversize_segments.increase(1)
        stats.num_device_alloc += 1
        if self.history.enabled:
            self.history.record("segment_alloc", ptr, alloc_size, stream, frames, pool.trace_id)
        return block

    def _alloc_found_block(self, block: Block, pool: BlockPool, stream: int, size: int,
                           orig_size: int, frames: Any, es: bool) -> int:
        """Split (spec §8), mark allocated, update stats (spec §16), trace ``alloc``."""
        stats = self.stats
        i = pool.stat_index
        remaining = block.size - size
        config = self.config
        if pool.is_small or es:  # ``should_split``
            split = remaining >= K_MIN_BLOCK_SIZE
        else:
            split = size < config.max_split_size and remaining > K_SMALL_SIZE
        if split and pool.no_split:
            split = False
        already_split = block.prev is not None or block.next is not None
        is_expandable = block.expandable_segment is not None
        if split:
            rest = block
            block = Block(stream, size, pool, rest.ptr)
            block.expandable_segment = rest.expandable_segment
            block.segment_frames = rest.segment_frames
            rest.segment_frames = None
            prev = block.prev = rest.prev
            if prev is not None:
                prev.next = block
            block.next = rest
            rest.prev = block
            rest.ptr += size
            rest.size = remaining
            pool.insert(rest)
            if not is_expandable:
                if already_split:  # an inactive split block shrinks by `size`
                    stats.on_inactive_split(i, 0, -size)
                else:  # a whole segment becomes split: its remainder is a new inactive split block
                    stats.on_inactive_split(i, 1, remaining)
        elif already_split and not is_expandable:  # an inactive split block becomes active
            stats.on_inactive_split(i, -1, -block.size)
        block.allocated = True
        block.requested_size = orig_size
        block.frames = frames
        ptr = block.ptr
        self.active[ptr] = block
        bsize = block.size
        stats.on_alloc(i, bsize, orig_size)
        if bsize >= config.max_split_size:
            stats.oversize_allocations.increase(1)
        if self.history.enabled:
            self.history.record("alloc", ptr, orig_size, stream, frames, pool.trace_id)
        return ptr

    def _raise_oom(self, pool: BlockPool, stream: int, size: int, alloc_size: int, frames: Any) -> NoReturn:
        """Count the OOM, trace it and raise PyTorch's message (spec §15)."""
        device_free, device_total = self.device.mem_get_info()
        self.history.record("oom", device_free, size, stream, frames, pool.trace_id)
        self.stats.num_ooms += 1
        nvml = getattr(self.device, "nvml", False)
        msg = oom_message(
            device=self.device.index, alloc_size=alloc_size, device_total=device_total,
            device_free=device_free, allocated=self.stats.allocated_bytes[0].current,
            reserved=self.stats.reserved_bytes[0].current, allowed=self.allowed_memory_maximum,
            private_pool_free=self._private_pool_free() if self.graph_pools else 0,
            processes=self.device.process_memory() if nvml else None,  # type: ignore[attr-defined]
            own_pid=getattr(self.device, "pid", None), legacy=self.oom_format == "legacy")
        raise OutOfMemoryError(msg)

    def _malloc_uncached(self, size: int) -> int:
        """PYTORCH_NO_CUDA_MEMORY_CACHING=1: a direct cudaMalloc, no stats, no trace (spec §3.5)."""
        ptr = self.device.malloc(size)
        if ptr is None:
            raise OutOfMemoryError("CUDA error: out of memory")
        self.uncached[ptr] = size
        return ptr

    # -- free -------------------------------------------------------------------------------
    def free(self, ptr: Checked) -> None:
        """The last reference to the block at `ptr` died (spec §10.1)."""
        if type(ptr) is not int:
            ptr = check_ptr(ptr)
        if ptr == 0:
            return
        with self.lock:
            if self._busy:  # a finalizer ran inside another operation (GC): finish that first
                self._deferred.append(ptr)
                return
            self._busy = True
            collecting = _pause_collector()
            try:
                self._free(ptr)
            finally:
                if collecting:
                    gc.enable()
                if self._deferred:
                    self._end_operation()
                else:
                    self._busy = False

    # -- operations and the frees that arrive during them -------------------------------------
    # Python's cyclic GC can run at any allocation of Python objects, and its finalizers may free
    # or allocate memory. No Python code runs inside CUDACachingAllocator's C++, so the collector
    # is paused for the length of an operation (`_pause_collector`): a finalizer that allocates
    # (``__del__``) runs before or after it, never half-way through. A free arriving on the same
    # thread all the same (the lock is re-entrant) must not touch the pools half-way through the
    # operation: it is queued, and `_end_operation` applies the queue once the operation is done.

    def _end_operation(self) -> None:
        """Apply the frees queued during the operation, in order, each exactly once, then clear
        `_busy`. Iterative: frees that arrive while the queue drains (GC again) join its end.

        A queued free that fails (a double free from a finalizer) is reported as Python reports
        an exception in a finalizer, through ``sys.unraisablehook``, because that is where the
        free came from; the other queued frees still run.
        """
        deferred = self._deferred
        try:
            while deferred:
                ptr = deferred.popleft()
                try:
                    self._free(ptr)
                except Exception as exc:  # noqa: BLE001 - reported below, not swallowed
                    _report_unraisable(exc, f"Exception ignored in a deferred free of {ptr:#x}")
        finally:
            self._busy = False

    @contextmanager
    def operation(self, mutates: bool = True) -> Iterator[None]:
        """Hold the lock for a compound operation; frees arriving meanwhile wait for its end.

        A read-only operation (`mutates=False`: a snapshot, the stats) nested inside another one
        on the same thread simply runs; a mutating one cannot, as in `malloc`.
        """
        with self.lock:
            if self._busy:
                if mutates:
                    raise RuntimeError("CachingAllocator operation re-entered during another allocator "
                                       "operation on the same thread (from a finalizer?)")
                yield
                return
            self._busy = True
            collecting = _pause_collector()
            try:
                yield
            finally:
                if collecting:
                    gc.enable()
                self._end_operation()

    def _operation(self, mutates: bool) -> Any:  # `operation` for the mixins (mypyc traits)
        return self.operation(mutates)

    def _free(self, ptr: int) -> None:
        """`free` with the lock held."""
        if self.caching_disabled:
            if ptr not in self.uncached:
                raise RuntimeError(f"invalid device pointer: {ptr:#x}")
            del self.uncached[ptr]
            self.device.free(ptr)
            return
        block = self.active.get(ptr)
        if block is None or not block.allocated:
            raise RuntimeError(f"invalid device pointer: {ptr:#x}")
        history = self.history
        frames = history.gather(ALL) if history.context >= ALL else None
        block.allocated = False
        stats = self.stats
        bsize = block.size
        stats.on_free_requested(block.pool.stat_index, bsize)
        if history.enabled:
            history.record("free_requested", ptr, block.requested_size, block.stream,
                           frames if frames is not None else block.frames, block.pool.trace_id)
        if bsize >= self.config.max_split_size:
            stats.oversize_allocations.decrease(1)
        if not block.stream_uses:
            self._free_block(block, frames)
        elif self.captures:  # ``needs_events_deferred_until_no_capture``: no events during capture
            self.deferred_frees.append(block)
        else:
            self._insert_events(block)

    def _free_block(self, block: Block, frames: Any) -> None:
        """Free completion (spec §10.2): merge with free neighbours, back into the pool, stats."""
        if self.history.enabled:
            self.history.record("free_completed", block.ptr, block.requested_size, block.stream,
                                frames if frames is not None else block.frames, block.pool.trace_id)
        block.frames = None
        original_size = block.size
        requested = block.requested_size
        pool = block.pool
        del self.active[block.ptr]
        net_blocks = 0
        net_bytes = 0
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:  # (try_merge_blocks checks all)
                absorbed = try_merge_blocks(block, neighbour, pool)
                if absorbed:
                    net_blocks -= 1
                    net_bytes -= absorbed
        pool.insert(block)
        if block.prev is not None or block.next is not None:
            net_blocks += 1
            net_bytes += block.size
        stats = self.stats
        i = pool.stat_index
        if block.expandable_segment is None and (net_blocks or net_bytes):
            stats.on_inactive_split(i, net_blocks, net_bytes)
        stats.on_free_completed(i, original_size, requested)

    # -- streams and events (spec §10.1, §10.3, §10.4) -----------------------------------------
    def record_stream(self, ptr: Checked, stream: Checked) -> None:
        """``Tensor.record_stream``: the block is in use on `stream` too; its free waits for it."""
        stream = check_stream(stream)
        ptr = check_ptr(ptr)
        with self.operation():
            if self.caching_disabled:
                return
            block = self.active.get(ptr)
            if block is None or not block.allocated:
                raise RuntimeError(f"invalid device pointer: {ptr:#x}")
            if stream == block.stream:
                return
            if block.stream_uses is None:
                block.stream_uses = set()
            block.stream_uses.add(stream)
            if self.captures:  # ``block_to_cudagraph_stream_uses``
                self.graph_stream_uses.setdefault(block, set()).add(stream)

    def _insert_events(self, block: Block) -> None:
        uses = sorted(block.stream_uses or ())
        block.stream_uses = None
        for stream in uses:
            event = self.device.record_event(stream)
            block.event_count += 1
            self.cuda_events.setdefault(stream, deque()).append((event, block))

    def process_events(self, frames: Any = None) -> None:
        """Free blocks whose events have all completed; per stream, stop at the first pending one."""
        self._insert_deferred_events(frames)
        query = self.device.query_event
        for stream in list(self.cuda_events):
            queue = self.cuda_events[stream]
            while queue:
                event, block = queue[0]
                if not query(event):
                    break
                queue.popleft()
                block.event_count -= 1
                if block.event_count == 0:
                    self._free_block(block, frames)
            if not queue:
                del self.cuda_events[stream]

    def synchronize_and_free_events(self, frames: Any = None) -> None:
        """Wait for every outstanding event and free its block (spec §10.4)."""
        self.stats.num_sync_all_streams += 1
        self._insert_deferred_events(frames)
        sync = self.device.synchronize_event
        events, self.cuda_events = self.cuda_events, {}
        for queue in events.values():
            for event, block in queue:
                sync(event)
                block.event_count -= 1
                if block.event_count == 0:
                    self._free_block(block, frames)

    # -- releasing memory (spec §11, §12) -----------------------------------------------------
    def empty_cache(self, mempool_id: Checked = DEFAULT_POOL) -> None:
        """``torch.cuda.empty_cache``: release every whole free segment (spec §11.1); given a
        private pool's id, only that pool's, if freeable (``emptyCache(mempool_id)``)."""
        if mempool_id != DEFAULT_POOL:
            mempool_id = check_pool_id(mempool_id)
        with self.operation():
            if not self.caching_disabled:
                history = self.history
                self._empty_cache(history.gather(ALL) if history.context >= ALL else None, mempool_id)

    # -- observability ----------------------------------------------------------------------
    def memory_stats(self) -> dict[str, int]:
        """``torch.cuda.memory_stats`` for this device (spec §16.2)."""
        with self.operation(mutates=False):
            return self.stats.as_flat_dict()

    def reset_peak_memory_stats(self) -> None:
        with self.lock:
            self.stats.reset_peak()

    def reset_accumulated_memory_stats(self) -> None:
        with self.lock:
            self.stats.reset_accumulated()

    def mem_get_info(self) -> tuple[int, int]:
        return self.device.mem_get_info()

    def all_blocks(self) -> list[Block]:
        """Every mapped block: the free ones in every pool (private ones too) and the active ones."""
        out = list(self.large_blocks.blocks.values()) + list(self.small_blocks.blocks.values())
        for pp in self.graph_pools.values():
            out += list(pp.small_blocks.blocks.values()) + list(pp.large_blocks.blocks.values())
        return out + list(self.active.values())

    def record_snapshot_entry(self, total_active: int, pool_id: tuple[int, int] | None = None) -> None:
        self.history.record("snapshot", 0, total_active, 0, None, pool_id)
