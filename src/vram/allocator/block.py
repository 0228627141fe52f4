"""Blocks and block pools (spec §1).

A `Block` is a sub-range of a segment; blocks of one segment form a doubly linked list in
address order (`prev`/`next`). A `BlockPool` holds the *free* blocks of one kind (small or
large), ordered by PyTorch's ``BlockComparatorSize``: (stream, size, address), ascending.

The order is kept as one sorted sequence of integer keys ``stream << 128 | size << 64 | ptr``
(sizes are < 2**60 and addresses < 2**64, so the packing is order-preserving). `SortedKeys`
stores them as a list of short sorted lists with a parallel list of their maxima — the layout of
sortedcontainers' SortedList without its positional index, which best fit does not need — so a
search is two C-level bisects and an insert or delete moves at most a few hundred pointers.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterator
from typing import Any

STREAM_SHIFT = 128
SIZE_SHIFT = 64
PTR_MASK = (1 << 64) - 1
SIZE_MASK = (1 << 64) - 1

_LOAD = 512


def block_key(stream: int, size: int, ptr: int) -> int:
    """The pool order key (stream, size, address) packed into one int."""
    return (stream << STREAM_SHIFT) | (size << SIZE_SHIFT) | ptr


class Block:
    """One block of a segment (spec §1). ``stream_uses`` is None until ``record_stream``."""

    __slots__ = (
        "stream", "size", "requested_size", "ptr", "pool", "allocated", "prev", "next",
        "event_count", "stream_uses", "gc_count_base", "mapped", "expandable_segment",
        "key", "frames", "segment_frames",
    )

    def __init__(self, stream: int, size: int, pool: BlockPool, ptr: int) -> None:
        self.stream = stream
        self.size = size
        self.requested_size = 0
        self.ptr = ptr
        self.pool = pool
        self.allocated = False
        self.prev: Block | None = None
        self.next: Block | None = None
        self.event_count = 0
        self.stream_uses: set[int] | None = None
        self.gc_count_base = 0
        self.mapped = True
        self.expandable_segment: Any = None
        self.key = 0
        self.frames: list[dict[str, Any]] | None = None  # stack of the current allocation
        self.segment_frames: list[dict[str, Any]] | None = None  # stack of the cudaMalloc (head only)

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else ("mapped" if self.mapped else "unmapped")
        return f"Block(ptr={self.ptr:#x}, size={self.size}, stream={self.stream}, {state})"


class SortedKeys:
    """A sorted multiset-free sequence of ints: insert, remove, first key >= x, ordered walks."""

    __slots__ = ("_lists", "_maxes", "_len")

    def __init__(self) -> None:
        self._lists: list[list[int]] = []
        self._maxes: list[int] = []
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def add(self, key: int) -> None:
        maxes = self._maxes
        if not maxes:
            self._lists.append([key])
            maxes.append(key)
        else:
            i = bisect_left(maxes, key)
            if i == len(maxes):
                i -= 1
                sub = self._lists[i]
                sub.append(key)
                maxes[i] = key
            else:
                sub = self._lists[i]
                insort(sub, key)
            if len(sub) > 2 * _LOAD:
                self._lists[i + 1:i + 1] = [sub[_LOAD:]]
                del sub[_LOAD:]
                maxes.insert(i, sub[-1])
        self._len += 1

    def remove(self, key: int) -> None:
        maxes = self._maxes
        i = bisect_left(maxes, key)
        sub = self._lists[i]
        j = bisect_left(sub, key)
        if sub[j] != key:
            raise KeyError(key)
        del sub[j]
        self._len -= 1
        if not sub:
            del self._lists[i], maxes[i]
        elif j == len(sub):
            maxes[i] = sub[-1]

    def ceiling(self, key: int) -> int | None:
        """The smallest stored key >= `key`, or None."""
        maxes = self._maxes
        i = bisect_left(maxes, key)
        if i == len(maxes):
            return None
        sub = self._lists[i]
        return sub[bisect_left(sub, key)]

    def floor_below(self, key: int) -> int | None:
        """The largest stored key < `key`, or None."""
        maxes = self._maxes
        i = bisect_left(maxes, key)
        if i < len(maxes):
            sub = self._lists[i]
            j = bisect_left(sub, key)
            if j:
                return sub[j - 1]
        return self._lists[i - 1][-1] if i else None

    def higher(self, key: int) -> int | None:
        """The smallest stored key > `key`, or None."""
        return self.ceiling(key + 1)

    def __iter__(self) -> Iterator[int]:
        for sub in self._lists:
            yield from sub

    def irange_from(self, key: int) -> Iterator[int]:
        """Keys >= `key` in ascending order (a snapshot: safe against later mutation)."""
        maxes = self._maxes
        i = bisect_left(maxes, key)
        if i == len(maxes):
            return iter(())
        lists = self._lists
        first = lists[i][bisect_left(lists[i], key):]
        rest = [k for sub in lists[i + 1:] for k in sub]
        return iter(first + rest)

    def reversed_below(self, key: int) -> Iterator[int]:
        """Keys < `key` in descending order (a snapshot)."""
        out: list[int] = []
        for sub in self._lists:
            if sub[0] >= key:
                break
            out.extend(sub[:bisect_left(sub, key)])
        out.reverse()
        return iter(out)


class BlockPool:
    """The free blocks of one pool kind (spec §1): mapped ones ordered by (stream, size, address),
    and the unmapped pieces of expandable segments ordered by (stream, address)."""

    __slots__ = ("keys", "blocks", "is_small", "get_free_blocks_call_count", "unmapped_keys",
                 "unmapped", "stat_index", "name", "owner", "pool_id", "trace_id", "no_split",
                 "largest_expandable")

    def __init__(self, is_small: bool, owner: Any = None, pool_id: tuple[int, int] = (0, 0)) -> None:
        self.is_small = is_small
        #: the `vram.allocator.pools.PrivatePool` owning this pool, None for a default pool
        #: (``BlockPool::owner_PrivatePool``); its id is `pool_id` (``owner_MempoolId()``), also
        #: written to trace entries as `trace_id` (None for the default pools: no key)
        self.owner = owner
        self.pool_id = pool_id
        self.trace_id: tuple[int, int] | None = pool_id if owner is not None else None
        self.no_split = False  # a MemPool made with no_split=True (``no_split_pools``)
        self.name = "small" if is_small else "large"
        self.stat_index = 1 if is_small else 2  # index into a StatArray: 0 all, 1 small, 2 large
        self.keys = SortedKeys()
        self.blocks: dict[int, Block] = {}
        self.get_free_blocks_call_count = 0
        self.unmapped_keys = SortedKeys()  # (stream << 128 | ptr)
        self.unmapped: dict[int, Block] = {}
        #: the size of the largest expandable segment any unmapped block ever came from: no
        #: search from an unmapped block finds more room than that (a segment's blocks tile its range)
        self.largest_expandable = 0

    def insert(self, block: Block) -> None:
        """Insert a free block; its GC age clock restarts now (spec §12)."""
        block.gc_count_base = self.get_free_blocks_call_count
        key = block.key = (block.stream << STREAM_SHIFT) | (block.size << SIZE_SHIFT) | block.ptr
        self.keys.add(key)
        self.blocks[key] = block

    def remove(self, block: Block) -> None:
        key = block.key
        self.keys.remove(key)
        del self.blocks[key]

    def __contains__(self, block: Block) -> bool:
        return self.blocks.get(block.key) is block

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self) -> Iterator[Block]:
        """Free blocks in pool order (stream, size, address)."""
        blocks = self.blocks
        return (blocks[k] for k in list(self.keys))

    def insert_unmapped(self, block: Block) -> None:
        key = block.key = (block.stream << STREAM_SHIFT) | block.ptr
        self.unmapped_keys.add(key)
        self.unmapped[key] = block
        room = block.expandable_segment.size
        if room > self.largest_expandable:
            self.largest_expandable = room

    def remove_unmapped(self, block: Block) -> None:
        key = block.key
        self.unmapped_keys.remove(key)
        del self.unmapped[key]


def try_merge_blocks(dst: Block, src: Block | None, pool: BlockPool) -> int:
    """Merge free neighbour `src` into `dst` (spec §10.2 step 2); returns the bytes absorbed.

    A neighbour merges only if it exists, is not allocated, waits for no event, has no recorded
    stream uses and has the same mapped state. It leaves its pool (mapped or unmapped set).
    """
    if (src is None or src.allocated or src.event_count > 0 or src.stream_uses
            or src.mapped != dst.mapped):
        return 0
    if dst.prev is src:
        dst.ptr = src.ptr
        prev = dst.prev = src.prev
        if prev is not None:
            prev.next = dst
        dst.segment_frames = src.segment_frames
    else:
        nxt = dst.next = src.next
        if nxt is not None:
            nxt.prev = dst
    dst.size += src.size
    if src.mapped:
        pool.remove(src)
    else:
        pool.remove_unmapped(src)
    return src.size
