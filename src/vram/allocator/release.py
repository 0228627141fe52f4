"""Giving memory back to the device (spec §11, §12): whole free segments (``empty_cache`` and the
retry chain's last step), oversize cached blocks (retry step d, when ``max_split_size_mb`` is set)
and the garbage collector of old cached blocks (``garbage_collection_threshold``).
"""
from __future__ import annotations

from typing import Any

from vram.devices.base import Device

from .block import SIZE_SHIFT, STREAM_SHIFT, Block, BlockPool
from .config import SIZE_MAX, AllocatorConfig
from .history import History
from .native import mypyc_attr, trait
from .stats import DeviceStats


@trait
@mypyc_attr(allow_interpreted_subclasses=True)  # as CachingAllocator (vram.allocator.native)
class ReleaseMixin:
    """`CachingAllocator`'s release paths; every method runs with the allocator's lock held."""

    # State owned by `CachingAllocator` (declared for the type checker).
    config: AllocatorConfig
    device: Device
    stats: DeviceStats
    history: History
    small_blocks: BlockPool
    large_blocks: BlockPool
    total_allocated_memory: int
    allowed_memory_maximum: int | None

    # Implemented by `CachingAllocator` and `ExpandableSegmentsMixin` (before this class in the
    # allocator's bases); declared here for the type checker and mypyc (vram.allocator.native).
    def synchronize_and_free_events(self, frames: Any = None) -> None:
        raise NotImplementedError

    def _unmap_block(self, block: Block, frames: Any) -> None:
        raise NotImplementedError

    def _release_pool_blocks(self, pool_id: tuple[int, int], frames: Any) -> None:
        raise NotImplementedError

    def _release_cached_blocks(self, frames: Any) -> bool:
        """``release_cached_blocks(context, {0, 0})`` with no capture under way: the default
        pools, then the freeable private pools (`vram.allocator.pools`)."""
        self.synchronize_and_free_events(frames)
        self._release_blocks(self.large_blocks, frames)
        self._release_blocks(self.small_blocks, frames)
        self._release_pool_blocks((0, 0), frames)
        return True

    def _release_blocks(self, pool: BlockPool, frames: Any) -> None:
        to_unmap = []
        for block in pool:
            if block.expandable_segment is not None:
                to_unmap.append(block)
            elif block.prev is None and block.next is None:
                self._release_block(block, frames)
        for block in to_unmap:
            self._unmap_block(block, frames)

    def _release_block(self, block: Block, frames: Any) -> None:
        """cudaFree a whole free segment (spec §11.1)."""
        pool = block.pool
        self.history.record("segment_free", block.ptr, block.size, block.stream,
                            frames if frames is not None else block.segment_frames, pool.trace_id)
        self.device.free(block.ptr)
        if pool.owner is not None:
            pool.owner.cuda_malloc_count -= 1
        self.total_allocated_memory -= block.size
        stats = self.stats
        stats.on_segment(pool.stat_index, -1, -block.size)
        stats.num_device_free += 1
        if block.size >= self.config.max_split_size:
            stats.oversize_segments.decrease(1)
        pool.remove(block)

    def _release_available_cached_blocks(self, pool: BlockPool, stream: int, size: int, frames: Any) -> bool:
        """Retry step d (spec §11.2): free oversize cached blocks of this stream, when M is set."""
        max_split = self.config.max_split_size
        if max_split == SIZE_MAX:
            return False
        target = max(size, max_split)
        search = (stream << STREAM_SHIFT) | (target << SIZE_SHIFT)
        key = pool.keys.ceiling(search)
        block = pool.blocks[key] if key is not None else None
        if block is not None and block.stream == stream and block.expandable_segment is None:
            self._release_whole(block, frames)
            return True
        released = 0
        for key in pool.keys.reversed_below(search):
            block = pool.blocks[key]
            if released >= target or block.size < max_split or block.stream != stream:
                break
            if block.expandable_segment is None and self._release_whole(block, frames):
                released += block.size
        return released >= target

    def _release_whole(self, block: Block, frames: Any) -> bool:
        # A free block >= max_split_size is a whole segment in practice (oversize blocks never
        # split); cudaFree needs a segment base, so a split one is left alone.
        if block.prev is None and block.next is None:
            self._release_block(block, frames)
            return True
        return False

    def _garbage_collect_cached_blocks(self, frames: Any) -> None:
        """Free old unsplit cached large blocks until under the threshold (spec §12)."""
        allowed = self.allowed_memory_maximum or 0
        threshold = int(self.config.garbage_collection_threshold * float(allowed))
        if self.total_allocated_memory <= threshold:
            return
        target = self.total_allocated_memory - threshold
        pool = self.large_blocks
        clock = pool.get_free_blocks_call_count
        total_age = 0
        count = 0
        for b in pool:
            if b.prev is None and b.next is None and b.expandable_segment is None:
                total_age += clock - b.gc_count_base
                count += 1
        if count == 0:
            return
        reclaimed = 0
        freed = True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for b in pool:
                if (b.prev is None and b.next is None and b.expandable_segment is None
                        and float(clock - b.gc_count_base) >= age_threshold):
                    freed = True
                    reclaimed += b.size
                    total_age -= clock - b.gc_count_base
                    count -= 1
                    self._release_block(b, frames)
