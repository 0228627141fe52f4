"""Allocator statistics (spec §16): the numbers behind ``torch.cuda.memory_stats()``.

A `Stat` has current / peak / allocated / freed. Array stats have one Stat per pool kind:
index 0 ``all``, 1 ``small_pool``, 2 ``large_pool`` (every update hits ``all`` plus the pool kind
of the block's pool).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

POOL_KEYS = ("all", "small_pool", "large_pool")
ARRAY_STATS = (
    "allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
    "active_bytes", "inactive_split_bytes", "requested_bytes",
)
#: plain counters; ``num_oom_rejections`` exists from torch 2.13 on (123 keys in all)
COUNTERS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
            "num_device_free", "num_oom_rejections")


class Stat:
    """One statistic (spec §16.1): increase raises peak; decrease leaves it."""

    __slots__ = ("current", "peak", "allocated", "freed")

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self.allocated = 0
        self.freed = 0

    def increase(self, amount: int) -> None:
        c = self.current + amount
        self.current = c
        if c > self.peak:
            self.peak = c
        self.allocated += amount

    def decrease(self, amount: int) -> None:
        self.current -= amount
        self.freed += amount

    def reset_peak(self) -> None:
        self.peak = self.current

    def reset_accumulated(self) -> None:
        self.allocated = 0
        self.freed = 0

    def as_dict(self) -> dict[str, int]:
        return {"current": self.current, "peak": self.peak, "allocated": self.allocated,
                "freed": self.freed}


def _change(stats: tuple[Stat, ...], n: int) -> None:
    """Increase (n > 0) or decrease (n < 0) each stat by |n|."""
    for s in stats:
        if n > 0:
            s.increase(n)
        elif n < 0:
            s.decrease(-n)


def stat_array() -> list[Stat]:
    return [Stat(), Stat(), Stat()]


class DeviceStats:
    """Every statistic of one device's allocator (spec §16.1)."""

    __slots__ = ARRAY_STATS + ("oversize_allocations", "oversize_segments", "max_split_size") + COUNTERS + (
        "_counts", "_bytes", "_requested", "_allocation", "_allocated_bytes", "_active",
        "_active_bytes", "_segment", "_reserved", "_split", "_split_bytes", "_run_peaks")

    # Set from ARRAY_STATS and COUNTERS in __init__ (declared for the type checker).
    allocation: list[Stat]
    segment: list[Stat]
    active: list[Stat]
    inactive_split: list[Stat]
    allocated_bytes: list[Stat]
    reserved_bytes: list[Stat]
    active_bytes: list[Stat]
    inactive_split_bytes: list[Stat]
    requested_bytes: list[Stat]
    num_alloc_retries: int
    num_ooms: int
    num_sync_all_streams: int
    num_device_alloc: int
    num_device_free: int
    num_oom_rejections: int

    def __init__(self, max_split_size: int = -1) -> None:
        for name in ARRAY_STATS:
            setattr(self, name, stat_array())
        self.oversize_allocations = Stat()
        self.oversize_segments = Stat()
        self.max_split_size = max_split_size
        for name in COUNTERS:
            setattr(self, name, 0)
        self._run_peaks: dict[str, int] = {}   # peaks before the last reset_peak (see run_peak)
        # Per pool index (1 small, 2 large): the Stats each allocator event moves, `all` included.
        def group(*names: str) -> list[tuple[Stat, ...]]:
            return [()] + [tuple(getattr(self, n)[k] for n in names for k in (0, i)) for i in (1, 2)]
        self._counts = group("allocation", "active")
        self._bytes = group("allocated_bytes", "active_bytes")
        self._requested = group("requested_bytes")
        self._allocation = group("allocation")
        self._allocated_bytes = group("allocated_bytes")
        self._active = group("active")
        self._active_bytes = group("active_bytes")
        self._segment = group("segment")
        self._reserved = group("reserved_bytes")
        self._split = group("inactive_split")
        self._split_bytes = group("inactive_split_bytes")

    # Allocator events (spec §16.1 table). `i` is the pool's stat index: 1 small, 2 large.
    # The bodies repeat Stat.increase/decrease inline: this is the allocator's hot path.
    def on_alloc(self, i: int, size: int, requested: int) -> None:
        """A block was carved: allocation, active (+1), allocated/active bytes, requested bytes."""
        for s in self._counts[i]:
            c = s.current + 1
            s.current = c
            if c > s.peak:
                s.peak = c
            s.allocated += 1
        for s in self._bytes[i]:
            c = s.current + size
            s.current = c
            if c > s.peak:
                s.peak = c
            s.allocated += size
        for s in self._requested[i]:
            c = s.current + requested
            s.current = c
            if c > s.peak:
                s.peak = c
            s.allocated += requested

    def on_free_requested(self, i: int, size: int) -> None:
        """The last reference died: allocation −1, allocated bytes −size (spec §10.1)."""
        for s in self._allocation[i]:
            s.current -= 1
            s.freed += 1
        for s in self._allocated_bytes[i]:
            s.current -= size
            s.freed += size

    def on_free_completed(self, i: int, size: int, requested: int) -> None:
        """The block went back to its pool: active −1, active and requested bytes (spec §10.2)."""
        for s in self._active[i]:
            s.current -= 1
            s.freed += 1
        for s in self._active_bytes[i]:
            s.current -= size
            s.freed += size
        for s in self._requested[i]:
            s.current -= requested
            s.freed += requested

    def on_segment(self, i: int, count: int, size: int) -> None:
        """Segments allocated (count, size > 0) or freed (< 0); expandable mappings pass count 0."""
        _change(self._segment[i], count)
        _change(self._reserved[i], size)

    def on_inactive_split(self, i: int, count: int, size: int) -> None:
        """Net change of the non-releasable (inactive split) blocks (spec §16.3)."""
        for stats, n in ((self._split[i], count), (self._split_bytes[i], size)):
            if n > 0:
                for s in stats:
                    c = s.current + n
                    s.current = c
                    if c > s.peak:
                        s.peak = c
                    s.allocated += n
            elif n < 0:
                for s in stats:
                    s.current += n
                    s.freed -= n

    def all_stats(self) -> list[Stat]:
        """Every Stat object: the array stats' and the two oversize stats."""
        out = [s for name in ARRAY_STATS for s in getattr(self, name)]
        return out + [self.oversize_allocations, self.oversize_segments]

    def reset_peak(self) -> None:
        for name in ARRAY_STATS:
            self._run_peaks[name] = self.run_peak(name)
        for s in self.all_stats():
            s.reset_peak()

    def run_peak(self, name: str) -> int:
        """The ``all`` peak of array stat `name` since this allocator was made: what
        ``reset_peak_memory_stats`` hides from ``memory_stats()`` (a script that resets its peaks
        each step, as torchtitan's metrics do, still has a whole-run peak to report)."""
        return max(self._run_peaks.get(name, 0), getattr(self, name)[0].peak)

    def reset_accumulated(self) -> None:
        for s in self.all_stats():
            s.reset_accumulated()
        for name in COUNTERS:
            setattr(self, name, 0)

    def as_nested_dict(self) -> dict[str, Any]:
        """``torch.cuda.memory_stats_as_nested_dict`` shape (spec §16.2)."""
        out: dict[str, Any] = {}
        for name in ARRAY_STATS:
            arr = getattr(self, name)
            out[name] = {POOL_KEYS[i]: arr[i].as_dict() for i in range(3)}
        out["oversize_allocations"] = self.oversize_allocations.as_dict()
        out["oversize_segments"] = self.oversize_segments.as_dict()
        out["max_split_size"] = self.max_split_size
        for name in COUNTERS:
            out[name] = getattr(self, name)
        return out

    def as_flat_dict(self) -> OrderedDict[str, int]:
        """``torch.cuda.memory_stats``: nested keys joined with '.', sorted by key (spec §16.2)."""
        return flatten_stats(self.as_nested_dict())


def flatten_stats(nested: dict[str, Any]) -> OrderedDict[str, int]:
    """Flatten like torch.cuda.memory_stats: depth-first '.'-joined keys, sorted lexicographically."""
    items: list[tuple[str, Any]] = []

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                k = "_".join(str(x) for x in k) if isinstance(k, tuple) else k
                walk(prefix + "." + k if prefix else k, v)
        else:
            items.append((prefix, obj))

    walk("", nested)
    items.sort()
    return OrderedDict(items)
