"""Layer 2: the iteration order of ``ska::flat_hash_set<MempoolId_t, MempoolIdHash>``.

PyTorch keeps the ``use_on_oom`` pools in such a set (``use_on_oom_pools``) and
``try_mempool_fallback`` tries them in its iteration order, which is not the order they were
added. `PoolIdSet` follows ``sherwood_v3_table`` in ``c10/util/flat_hash_map.h`` step by step:
``MempoolIdHash`` (``first != 0 ? first : second``), Fibonacci hashing
(``(11400714819323198485 * hash) >> shift``), Robin Hood insertion with ``max_lookups``
probes, growth at a load factor of 0.5 (``rehash`` re-inserting in slot order) and erase by
backward shift; iteration walks the slots in order.
"""
from __future__ import annotations

from collections.abc import Iterator

_FIB = 11400714819323198485
_MASK = (1 << 64) - 1
_MIN_LOOKUPS = 4


def _log2(value: int) -> int:
    return value.bit_length() - 1


class PoolIdSet:
    """An insertion/erase-exact model of the set; iterate it for PyTorch's order."""

    __slots__ = ("slots", "buckets", "max_lookups", "shift", "size")

    def __init__(self) -> None:
        # One entry per slot: None (empty) or [distance_from_desired, key]. The table has
        # ``buckets + max_lookups - 1`` usable slots (the last allocated one is the end marker).
        self.slots: list[list | None] = [None] * (_MIN_LOOKUPS - 1)
        self.buckets = 0
        self.max_lookups = _MIN_LOOKUPS - 1
        self.shift = 63
        self.size = 0

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter([e[1] for e in self.slots if e is not None])

    def __len__(self) -> int:
        return self.size

    def __contains__(self, key: object) -> bool:
        return any(e is not None and e[1] == key for e in self.slots)

    def _index(self, key: tuple[int, int]) -> int:
        h = key[0] if key[0] != 0 else key[1]
        return ((_FIB * h) & _MASK) >> self.shift

    def add(self, key: tuple[int, int]) -> None:
        """``emplace``: find the key along its probe run, else ``emplace_new_key``."""
        cur, dist = self._index(key), 0
        slots = self.slots
        while cur < len(slots) and slots[cur] is not None and slots[cur][0] >= dist:  # type: ignore[index]
            if slots[cur][1] == key:  # type: ignore[index]
                return
            cur += 1
            dist += 1
        if self.buckets == 0 or dist == self.max_lookups or self.size + 1 > self.buckets * 0.5:
            self._grow()
            self.add(key)
            return
        if slots[cur] is None:
            slots[cur] = [dist, key]
            self.size += 1
            return
        result = cur
        moving: list = [dist, key]
        slots[cur], moving = moving, slots[cur]  # type: ignore[assignment]
        moving[0] += 1
        cur += 1
        while True:
            entry = slots[cur]
            if entry is None:
                slots[cur] = moving
                self.size += 1
                return
            if entry[0] < moving[0]:
                slots[cur], moving = moving, entry
                moving[0] += 1
            else:
                moving[0] += 1
                if moving[0] == self.max_lookups:
                    # put the displaced key back where ours went, grow, then insert ours
                    ours = slots[result][1]  # type: ignore[index]
                    slots[result][1] = moving[1]  # type: ignore[index]
                    self._grow()
                    self.add(ours)
                    return
            cur += 1

    def discard(self, key: tuple[int, int]) -> None:
        """``erase``: remove the key and shift the following run back by one."""
        cur, dist = self._index(key), 0
        slots = self.slots
        while cur < len(slots) and slots[cur] is not None and slots[cur][0] >= dist:  # type: ignore[index]
            if slots[cur][1] == key:  # type: ignore[index]
                slots[cur] = None
                self.size -= 1
                nxt = cur + 1
                while nxt < len(slots) and slots[nxt] is not None and slots[nxt][0] > 0:  # type: ignore[index]
                    moved = slots[nxt]
                    moved[0] -= 1  # type: ignore[index]
                    slots[cur], slots[nxt] = moved, None
                    cur, nxt = nxt, nxt + 1
                return
            cur += 1
            dist += 1

    def _grow(self) -> None:
        """``grow``: ``rehash(max(4, 2 * bucket_count))``, re-inserting in slot order."""
        buckets = max(4, 2 * self.buckets, -(-self.size * 2))
        buckets = max(2, 1 << (buckets - 1).bit_length())
        old = [e[1] for e in self.slots if e is not None]
        self.buckets = buckets
        self.shift = 64 - _log2(buckets)
        self.max_lookups = max(_MIN_LOOKUPS, _log2(buckets))
        self.slots = [None] * (buckets + self.max_lookups - 1)
        self.size = 0
        for key in old:
            self.add(key)
