"""Spec-derived tests: every worked example of spec §20 plus the rules they illustrate.

Source of every expected number: ``shared/spec/pytorch-allocator.md`` (the "spec"). Where the
spec states a number it is quoted; where it does not (peaks, Tot Alloc/Tot Freed, per-pool rows,
intermediate states) the derivation from the spec's rules (§16.1 stat semantics, §16.3
inactive_split, §8 split, §6 segment sizes, …) is written next to it. Nothing here was taken
from what ``vram`` prints.

Stat tuples are ``(current, peak, allocated, freed)`` (spec §16.1: an increase by a raises
current, peak=max(peak, current) and allocated; a decrease lowers current and raises freed).

Addresses: ``SimulatedDevice`` hands out segment bases top-down, so a later segment usually lies
*below* an earlier one, whereas spec §20 assumes increasing bases. Tests that depend on an
equal-size tie-break (Example 8) state the rule ("lowest address wins", §7) instead of
hard-coding which block that is.
"""
from __future__ import annotations

import pytest

from vram.allocator.caching import CachingAllocator, allocation_size, round_size
from vram.allocator.config import parse_alloc_conf
from vram.allocator.errors import OutOfMemoryError
from vram.devices.simulated import SimulatedDevice
from vram.units import format_size

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# -------------------------------------------------------------------------------------------
# helpers

ARRAY_STATS = (
    "active", "active_bytes", "allocated_bytes", "allocation", "inactive_split",
    "inactive_split_bytes", "requested_bytes", "reserved_bytes", "segment",
)
POOLS = ("all", "large_pool", "small_pool")
FIELDS = ("current", "peak", "allocated", "freed")
COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms",
            "num_sync_all_streams")
ZERO = (0, 0, 0, 0)


def grown(x: int) -> tuple[int, int, int, int]:
    """A stat that only ever increased, to `x` in total: current = peak = allocated = x."""
    return (x, x, x, 0)


def expected_stats(*, large: dict | None = None, small: dict | None = None,
                   all_: dict | None = None, oversize_allocations=ZERO, oversize_segments=ZERO,
                   max_split_size: int = -1, **counters: int) -> dict[str, int]:
    """The full flat ``memory_stats()`` dict (spec §16.2, the 122 pre-2.15 keys).

    Array stats not mentioned are all zero. A stat given for only one pool is the same for
    ``all`` (every update hits ``all`` plus the block's pool, §16.1); a stat that moves in both
    pools must be given for ``all_`` explicitly (its peak is not the sum of the pools' peaks).
    """
    large, small, all_ = dict(large or {}), dict(small or {}), dict(all_ or {})
    for name in set(large) | set(small):
        if name in all_:
            continue
        if name in large and name in small:
            raise AssertionError(f"{name}: give all_ explicitly when both pools move")
        all_[name] = large.get(name, small.get(name))
    unknown = (set(large) | set(small) | set(all_)) - set(ARRAY_STATS)
    assert not unknown, unknown
    unknown = set(counters) - set(COUNTERS)
    assert not unknown, unknown
    out: dict[str, int] = {}
    for name in ARRAY_STATS:
        for pool, table in (("all", all_), ("large_pool", large), ("small_pool", small)):
            for field, v in zip(FIELDS, table.get(name, ZERO)):
                out[f"{name}.{pool}.{field}"] = v
    for name, value in (("oversize_allocations", oversize_allocations),
                        ("oversize_segments", oversize_segments)):
        for field, v in zip(FIELDS, value):
            out[f"{name}.{field}"] = v
    out["max_split_size"] = max_split_size
    for name in COUNTERS:
        out[name] = counters.get(name, 0)
    return out


_MISSING = "<missing>"


def assert_stats(alloc: CachingAllocator, expected: dict[str, int]) -> None:
    """Compare the whole stats dict; on failure list only the differing keys (actual, expected)."""
    actual = dict(alloc.memory_stats())
    # 2.15 adds num_oom_rejections (§16.1); it must be 0 in every scenario here.
    if actual.get("num_oom_rejections", 0) == 0:
        actual.pop("num_oom_rejections", None)
    diff = {
        k: (actual.get(k, _MISSING), expected.get(k, _MISSING))
        for k in sorted(set(actual) | set(expected))
        if actual.get(k, _MISSING) != expected.get(k, _MISSING)
    }
    assert diff == {}, "differing stats, key: (actual, expected)"


def stat(alloc: CachingAllocator, key: str) -> int:
    return alloc.memory_stats()[key]


class RecordingDevice(SimulatedDevice):
    """A SimulatedDevice that logs cudaMalloc requests and cudaFree'd segment sizes, in order."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.malloc_requests: list[int] = []  # every cudaMalloc size asked for, granted or not
        self.sizes: dict[int, int] = {}
        self.freed: list[tuple[int, int]] = []  # (ptr, size) per cudaFree

    def malloc(self, size: int):
        self.malloc_requests.append(size)
        ptr = super().malloc(size)
        if ptr is not None:
            self.sizes[ptr] = size
        return ptr

    def free(self, ptr: int) -> None:
        self.freed.append((ptr, self.sizes.pop(ptr)))
        super().free(ptr)


def make(conf: str = "", total: int | str = "16GiB", device_cls=SimulatedDevice, **dev_kw):
    device = device_cls(total, context=0, **dev_kw)
    return device, CachingAllocator(device, alloc_conf=conf)


SPEC_17_SUMMARY = "\n".join([
    '|===========================================================================|',
    '|                  PyTorch CUDA memory summary, device ID 0                 |',
    '|---------------------------------------------------------------------------|',
    '|            CUDA OOMs: 0            |        cudaMalloc retries: 0         |',
    '|===========================================================================|',
    '|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |',
    '|---------------------------------------------------------------------------|',
    '| Allocated memory      |  24577 KiB |  24577 KiB |  24577 KiB |      0 B   |',
    '|       from large pool |  24576 KiB |  24576 KiB |  24576 KiB |      0 B   |',
    '|       from small pool |      1 KiB |      1 KiB |      1 KiB |      0 B   |',
    '|---------------------------------------------------------------------------|',
    '| Active memory         |  24577 KiB |  24577 KiB |  24577 KiB |      0 B   |',
    '|       from large pool |  24576 KiB |  24576 KiB |  24576 KiB |      0 B   |',
    '|       from small pool |      1 KiB |      1 KiB |      1 KiB |      0 B   |',
    '|---------------------------------------------------------------------------|',
    '| Requested memory      |  23552 KiB |  23552 KiB |  23552 KiB |      0 B   |',
    '|       from large pool |  23552 KiB |  23552 KiB |  23552 KiB |      0 B   |',
    '|       from small pool |      0 KiB |      0 KiB |      0 KiB |      0 B   |',
    '|---------------------------------------------------------------------------|',
    '| GPU reserved memory   |  38912 KiB |  38912 KiB |  38912 KiB |      0 B   |',
    '|       from large pool |  36864 KiB |  36864 KiB |  36864 KiB |      0 B   |',
    '|       from small pool |   2048 KiB |   2048 KiB |   2048 KiB |      0 B   |',
    '|---------------------------------------------------------------------------|',
    '| Non-releasable memory |  14335 KiB |  16384 KiB |  18431 KiB |   4096 KiB |',
    '|       from large pool |  12288 KiB |  16384 KiB |  16384 KiB |   4096 KiB |',
    '|       from small pool |   2047 KiB |   2047 KiB |   2047 KiB |      0 KiB |',
    '|---------------------------------------------------------------------------|',
    '| Allocations           |       4    |       4    |       4    |       0    |',
    '|       from large pool |       3    |       3    |       3    |       0    |',
    '|       from small pool |       1    |       1    |       1    |       0    |',
    '|---------------------------------------------------------------------------|',
    '| Active allocs         |       4    |       4    |       4    |       0    |',
    '|       from large pool |       3    |       3    |       3    |       0    |',
    '|       from small pool |       1    |       1    |       1    |       0    |',
    '|---------------------------------------------------------------------------|',
    '| GPU reserved segments |       3    |       3    |       3    |       0    |',
    '|       from large pool |       2    |       2    |       2    |       0    |',
    '|       from small pool |       1    |       1    |       1    |       0    |',
    '|---------------------------------------------------------------------------|',
    '| Non-releasable allocs |       2    |       2    |       2    |       0    |',
    '|       from large pool |       1    |       1    |       1    |       0    |',
    '|       from small pool |       1    |       1    |       1    |       0    |',
    '|---------------------------------------------------------------------------|',
    '| Oversize allocations  |       0    |       0    |       0    |       0    |',
    '|---------------------------------------------------------------------------|',
    '| Oversize GPU segments |       0    |       0    |       0    |       0    |',
    '|===========================================================================|',
]) + "\n"


# -------------------------------------------------------------------------------------------
# §20 Example 1 — one small tensor

def test_example1_small_tensor_malloc_stats():
    _, a = make()
    a.malloc(1000)
    # 1000 -> 1024, small pool, new 2 MiB segment, split leaving 2,096,128 (§20 Ex. 1).
    assert_stats(a, expected_stats(
        small={
            "allocation": grown(1), "active": grown(1),
            "allocated_bytes": grown(1024), "active_bytes": grown(1024),
            "requested_bytes": grown(1000),
            "segment": grown(1), "reserved_bytes": grown(2097152),
            "inactive_split": grown(1), "inactive_split_bytes": grown(2096128),
        },
        num_device_alloc=1,
    ))


def test_example1_free_merges_into_whole_free_segment():
    _, a = make()
    a.free(a.malloc(1000))
    # "allocated 0 (freed 1024), inactive_split 0 (freed 2,096,128), reserved still 2,097,152".
    # free completion merges the remainder: inactive_split count -1, bytes -2,096,128 (§16.3).
    assert_stats(a, expected_stats(
        small={
            "allocation": (0, 1, 1, 1), "active": (0, 1, 1, 1),
            "allocated_bytes": (0, 1024, 1024, 1024), "active_bytes": (0, 1024, 1024, 1024),
            "requested_bytes": (0, 1000, 1000, 1000),
            "segment": grown(1), "reserved_bytes": grown(2097152),
            "inactive_split": (0, 1, 1, 1), "inactive_split_bytes": (0, 2096128, 2096128, 2096128),
        },
        num_device_alloc=1,
    ))


def test_example1_empty_cache_releases_segment():
    _, a = make()
    a.free(a.malloc(1000))
    a.empty_cache()
    # "reserved 0, segment 0, num_device_free 1, num_sync_all_streams 1;
    #  max_memory_reserved 2,097,152" (= reserved_bytes.all.peak, §16.2).
    assert_stats(a, expected_stats(
        small={
            "allocation": (0, 1, 1, 1), "active": (0, 1, 1, 1),
            "allocated_bytes": (0, 1024, 1024, 1024), "active_bytes": (0, 1024, 1024, 1024),
            "requested_bytes": (0, 1000, 1000, 1000),
            "segment": (0, 1, 1, 1), "reserved_bytes": (0, 2097152, 2097152, 2097152),
            "inactive_split": (0, 1, 1, 1), "inactive_split_bytes": (0, 2096128, 2096128, 2096128),
        },
        num_device_alloc=1, num_device_free=1, num_sync_all_streams=1,
    ))
    assert stat(a, "reserved_bytes.all.peak") == 2097152


# -------------------------------------------------------------------------------------------
# §20 Example 2 — small packing

def test_example2_four_half_mib_blocks_fill_one_segment():
    _, a = make()
    ptrs = [a.malloc(524288) for _ in range(4)]
    # §8 carving takes the low front each time: consecutive addresses inside the segment.
    assert ptrs == [ptrs[0] + i * 524288 for i in range(4)]
    # inactive_split (§16.3): #1 splits an unsplit segment: +1, +1,572,864; #2 and #3 split an
    # already-split block: bytes -524,288 each; #4 takes the last 524,288 without split: -1,
    # -524,288. -> count (0,1,1,1), bytes (0, 1572864, 1572864, 1572864).
    assert_stats(a, expected_stats(
        small={
            "allocation": grown(4), "active": grown(4),
            "allocated_bytes": grown(2097152), "active_bytes": grown(2097152),
            "requested_bytes": grown(2097152),
            "segment": grown(1), "reserved_bytes": grown(2097152),
            "inactive_split": (0, 1, 1, 1), "inactive_split_bytes": (0, 1572864, 1572864, 1572864),
        },
        num_device_alloc=1,
    ))


def test_example2_one_byte_opens_a_new_small_segment():
    _, a = make()
    for _ in range(4):
        a.malloc(524288)
    a.malloc(1)
    # "allocated 2,097,664, reserved 4,194,304, segment 2, inactive_split 1 / 2,096,640,
    #  requested 2,097,153". inactive_split history: +1 (#1), -1 (#4), +1 (1 B) -> (1,1,2,1);
    # bytes: +1,572,864, -3x524,288, +2,096,640 -> (2096640, 2096640, 3669504, 1572864).
    assert_stats(a, expected_stats(
        small={
            "allocation": grown(5), "active": grown(5),
            "allocated_bytes": grown(2097664), "active_bytes": grown(2097664),
            "requested_bytes": grown(2097153),
            "segment": grown(2), "reserved_bytes": grown(4194304),
            "inactive_split": (1, 1, 2, 1), "inactive_split_bytes": (2096640, 2096640, 3669504, 1572864),
        },
        num_device_alloc=2,
    ))


# -------------------------------------------------------------------------------------------
# §20 Example 3 — mid-size requests share 20 MiB segments

def test_example3_first_4mib_gets_20mib_segment():
    _, a = make()
    a.malloc(4 * MiB)
    # "allocated 4,194,304, reserved 20,971,520, inactive_split 1 / 16,777,216".
    assert_stats(a, expected_stats(
        large={
            "allocation": grown(1), "active": grown(1),
            "allocated_bytes": grown(4194304), "active_bytes": grown(4194304),
            "requested_bytes": grown(4194304),
            "segment": grown(1), "reserved_bytes": grown(20971520),
            "inactive_split": grown(1), "inactive_split_bytes": grown(16777216),
        },
        num_device_alloc=1,
    ))


def test_example3_second_4mib_reuses_remainder():
    _, a = make()
    pa = a.malloc(4 * MiB)
    pb = a.malloc(4 * MiB)
    assert pb == pa + 4 * MiB  # carved from the front of A's remainder (§8)
    # "allocated 8,388,608, reserved 20,971,520, inactive_split 1 / 12,582,912";
    # split of an already split block: bytes -4 MiB, count unchanged (§16.3).
    assert_stats(a, expected_stats(
        large={
            "allocation": grown(2), "active": grown(2),
            "allocated_bytes": grown(8388608), "active_bytes": grown(8388608),
            "requested_bytes": grown(8388608),
            "segment": grown(1), "reserved_bytes": grown(20971520),
            "inactive_split": grown(1), "inactive_split_bytes": (12582912, 16777216, 16777216, 4194304),
        },
        num_device_alloc=1,
    ))


def test_example3_15mib_gets_own_16mib_segment_unsplit():
    _, a = make()
    a.malloc(4 * MiB)
    a.malloc(4 * MiB)
    a.malloc(15 * MiB)
    # "alloc_size = 16 MiB ... no split -> allocated 25,165,824, requested 24,117,248,
    #  reserved 37,748,736, segment 2".
    assert_stats(a, expected_stats(
        large={
            "allocation": grown(3), "active": grown(3),
            "allocated_bytes": grown(25165824), "active_bytes": grown(25165824),
            "requested_bytes": grown(24117248),
            "segment": grown(2), "reserved_bytes": grown(37748736),
            "inactive_split": grown(1), "inactive_split_bytes": (12582912, 16777216, 16777216, 4194304),
        },
        num_device_alloc=2,
    ))


def test_example3_plus_1000_bytes_gives_spec_17_memory_summary():
    from vram.views.summary import memory_summary_from_stats

    _, a = make()
    a.malloc(4 * MiB)
    a.malloc(4 * MiB)
    a.malloc(15 * MiB)
    a.malloc(1000)
    # "(Adding a 1000 B tensor here gives the memory_summary shown in §17.)"
    assert memory_summary_from_stats(a.memory_stats()) == SPEC_17_SUMMARY


def test_example3_free_a_stays_separate_and_empty_cache_releases_nothing():
    _, a = make()
    pa = a.malloc(4 * MiB)
    a.malloc(4 * MiB)
    a.malloc(15 * MiB)
    a.free(pa)
    # "inactive_split 2 / 16,777,216; allocated 20,971,520": free A has no free neighbour, the
    # result is split -> count +1, bytes +4 MiB (§16.3).
    before = dict(a.memory_stats())
    assert before["inactive_split.all.current"] == 2
    assert before["inactive_split_bytes.all.current"] == 16777216
    assert before["allocated_bytes.all.current"] == 20971520
    a.empty_cache()
    # "releases nothing (both segments in use), only num_sync_all_streams +1".
    assert_stats(a, expected_stats(
        large={
            # allocation: +3 -1; allocated_bytes: +4M +4M +16M, -4M
            "allocation": (2, 3, 3, 1), "active": (2, 3, 3, 1),
            "allocated_bytes": (20971520, 25165824, 25165824, 4194304),
            "active_bytes": (20971520, 25165824, 25165824, 4194304),
            # requested: +4M +4M +15M, -4M
            "requested_bytes": (19922944, 24117248, 24117248, 4194304),
            "segment": grown(2), "reserved_bytes": grown(37748736),
            # count: +1 (A), +1 (free A); bytes: +16M, -4M (B), +4M (free A)
            "inactive_split": grown(2), "inactive_split_bytes": (16777216, 16777216, 20971520, 4194304),
        },
        num_device_alloc=2, num_sync_all_streams=1,
    ))


def test_example3_free_b_merges_and_empty_cache_frees_20mib_segment():
    _, a = make()
    pa = a.malloc(4 * MiB)
    pb = a.malloc(4 * MiB)
    a.malloc(15 * MiB)
    a.free(pa)
    a.empty_cache()
    a.free(pb)
    # "merges with A and with the 12 MiB remainder -> ... inactive_split 0 / 0"
    assert stat(a, "inactive_split.all.current") == 0
    assert stat(a, "inactive_split_bytes.all.current") == 0
    a.empty_cache()
    # "reserved 16,777,216, segment 1, num_device_free 1, num_sync_all_streams 2".
    # free B: merge with 2 neighbours -> count -2, bytes -16 MiB (net, §16.3).
    assert_stats(a, expected_stats(
        large={
            "allocation": (1, 3, 3, 2), "active": (1, 3, 3, 2),
            "allocated_bytes": (16777216, 25165824, 25165824, 8388608),
            "active_bytes": (16777216, 25165824, 25165824, 8388608),
            "requested_bytes": (15728640, 24117248, 24117248, 8388608),
            "segment": (1, 2, 2, 1), "reserved_bytes": (16777216, 37748736, 37748736, 20971520),
            "inactive_split": (0, 2, 2, 2), "inactive_split_bytes": (0, 16777216, 20971520, 20971520),
        },
        num_device_alloc=2, num_device_free=1, num_sync_all_streams=2,
    ))


# -------------------------------------------------------------------------------------------
# §20 Example 4 / §8 — the ">1 MiB remaining" rule

def test_example4_19mib_keeps_whole_20mib_segment():
    _, a = make()
    a.malloc(19 * MiB)
    # "allocated_bytes 20,971,520 for a 19,922,944 request, inactive_split 0".
    assert_stats(a, expected_stats(
        large={
            "allocation": grown(1), "active": grown(1),
            "allocated_bytes": grown(20971520), "active_bytes": grown(20971520),
            "requested_bytes": grown(19922944),
            "segment": grown(1), "reserved_bytes": grown(20971520),
        },
        num_device_alloc=1,
    ))


def test_example4_9_5mib_gets_new_20mib_segment_and_splits():
    _, a = make()
    a.malloc(19 * MiB)
    a.malloc(9961472)
    # "allocated 30,932,992, reserved 41,943,040, inactive_split 1 / 11,010,048";
    # requested 19,922,944 + 9,961,472 = 29,884,416.
    assert_stats(a, expected_stats(
        large={
            "allocation": grown(2), "active": grown(2),
            "allocated_bytes": grown(30932992), "active_bytes": grown(30932992),
            "requested_bytes": grown(29884416),
            "segment": grown(2), "reserved_bytes": grown(41943040),
            "inactive_split": grown(1), "inactive_split_bytes": grown(11010048),
        },
        num_device_alloc=2,
    ))


def test_split_rule_large_remainder_just_over_1mib_splits():
    _, a = make()
    # 19 MiB - 512: alloc_size 20 MiB (§6), remaining 1 MiB + 512 > 1 MiB -> split (§8).
    a.malloc(19 * MiB - 512)
    assert stat(a, "allocated_bytes.all.current") == 19 * MiB - 512
    assert stat(a, "inactive_split_bytes.all.current") == MiB + 512
    assert stat(a, "inactive_split.all.current") == 1


def test_split_rule_small_pool_splits_at_512_remaining():
    _, a = make()
    # 1 MiB (exactly 1 MiB is small, §5) in a 2 MiB segment, split leaving 1 MiB; then
    # 1 MiB - 512 from that remainder leaves exactly 512 -> split (small pool: >= 512, §8).
    a.malloc(MiB)
    a.malloc(MiB - 512)
    assert stat(a, "segment.small_pool.current") == 1
    assert stat(a, "inactive_split.small_pool.current") == 1
    assert stat(a, "inactive_split_bytes.small_pool.current") == 512
    p = a.malloc(512)  # the 512 B remainder is reused: no new segment, no split left
    assert stat(a, "segment.small_pool.current") == 1
    assert stat(a, "inactive_split.small_pool.current") == 0
    assert p != 0


def test_split_rule_carving_without_split_from_split_block_large_pool():
    _, a = make()
    a.malloc(4 * MiB)  # 20 MiB segment, 16 MiB remainder (split: +1, +16 MiB)
    # 16 MiB - 512 KiB = 16,252,928: rounded as is; remainder of the cached 16 MiB block is
    # 512 KiB, not > 1 MiB -> no split: the whole 16 MiB is allocated (§8) and leaves
    # inactive_split: count -1, bytes -16 MiB (§16.3 third rule).
    a.malloc(16 * MiB - 512 * KiB)
    assert stat(a, "segment.all.current") == 1
    assert stat(a, "allocated_bytes.all.current") == 20 * MiB
    assert stat(a, "requested_bytes.all.current") == 4 * MiB + 16 * MiB - 512 * KiB
    assert stat(a, "inactive_split.large_pool.current") == 0
    assert stat(a, "inactive_split.large_pool.freed") == 1
    assert stat(a, "inactive_split_bytes.large_pool.current") == 0
    assert stat(a, "inactive_split_bytes.large_pool.freed") == 16 * MiB


def test_split_rule_oversize_request_never_splits():
    _, a = make("max_split_size_mb:200")
    # Reuse of a cached 300 MiB block for 290 MiB (>= M) keeps all 300 MiB: no split although
    # 10 MiB (> 1 MiB) remain, because the large-pool rule also needs size < M (§8).
    p = a.malloc(300 * MiB)
    a.free(p)
    q = a.malloc(290 * MiB)
    assert q == p
    assert stat(a, "allocated_bytes.all.current") == 300 * MiB
    assert stat(a, "inactive_split.all.allocated") == 0


# -------------------------------------------------------------------------------------------
# §20 Example 5 — max_split_size_mb:200

M200 = 209715200  # 200 MiB


def test_example5_oversize_block_reuse_and_rejection():
    dev, a = make("max_split_size_mb:200", device_cls=RecordingDevice)
    p300 = a.malloc(300 * MiB)
    # "300 MiB segment, not split; oversize_segments 1, oversize_allocations 1"
    assert stat(a, "oversize_segments.current") == 1
    assert stat(a, "oversize_allocations.current") == 1
    assert stat(a, "inactive_split.all.current") == 0
    a.free(p300)
    assert stat(a, "oversize_allocations.current") == 0  # "Free it (oversize_allocations 0,
    assert stat(a, "segment.all.current") == 1  # segment kept)"
    p290 = a.malloc(290 * MiB)
    # "290 >= M and 300 < 290 + 20 -> reused whole: allocated 314,572,800, requested
    #  304,087,040, reserved 314,572,800"
    assert p290 == p300
    assert stat(a, "allocated_bytes.all.current") == 314572800
    assert stat(a, "requested_bytes.all.current") == 304087040
    assert stat(a, "reserved_bytes.all.current") == 314572800
    a.free(p290)
    a.malloc(250 * MiB)
    # "300 >= 250 + 20 -> rejected -> new 250 MiB segment: reserved 576,716,800,
    #  oversize_segments 2"
    assert stat(a, "reserved_bytes.all.current") == 576716800
    assert stat(a, "oversize_segments.current") == 2
    a.malloc(100 * MiB)
    # "100 MiB (< M) -> the cached 300 MiB block is >= M -> rejected -> new 100 MiB segment:
    #  reserved 681,574,400, segment 3, allocated 367,001,600"
    assert dev.malloc_requests == [300 * MiB, 250 * MiB, 100 * MiB]
    # Full dict. allocated_bytes: +300M -300M +300M -300M +250M +100M;
    # requested: +300M -300M +290M -290M +250M +100M;
    # oversize_allocations: +1 -1 +1 -1 +1 (the 100 MiB block is < M).
    assert_stats(a, expected_stats(
        large={
            "allocation": (2, 2, 4, 2), "active": (2, 2, 4, 2),
            "allocated_bytes": (367001600, 367001600, 996147200, 629145600),
            "active_bytes": (367001600, 367001600, 996147200, 629145600),
            "requested_bytes": (367001600, 367001600, 985661440, 618659840),
            "segment": grown(3), "reserved_bytes": grown(681574400),
        },
        oversize_allocations=(1, 1, 3, 2), oversize_segments=grown(2),
        max_split_size=M200, num_device_alloc=3,
    ))


# -------------------------------------------------------------------------------------------
# §20 Example 6 — retry path on a 1 GiB device

def test_example6_default_config_release_all_then_retry_succeeds():
    dev, a = make(total="1GiB", device_cls=RecordingDevice)
    p1, p2, _ = (a.malloc(300 * MiB) for _ in range(3))
    assert stat(a, "reserved_bytes.all.current") == 943718400
    a.free(p1)
    a.free(p2)
    a.malloc(400 * MiB)
    # "sync (num_sync_all_streams 1), both cached 300 MiB segments freed (num_device_free 2),
    #  retry (num_alloc_retries 1) succeeds -> reserved 734,003,200, allocated 734,003,200,
    #  segment 2, num_device_alloc 4, num_ooms 0". cudaMalloc(400 MiB) asked twice (attempts 1, 3).
    assert dev.malloc_requests == [300 * MiB] * 3 + [400 * MiB] * 2
    assert_stats(a, expected_stats(
        large={
            # +3x300M (peak 900M) -2x300M +400M
            "allocation": (2, 3, 4, 2), "active": (2, 3, 4, 2),
            "allocated_bytes": (734003200, 943718400, 1363148800, 629145600),
            "active_bytes": (734003200, 943718400, 1363148800, 629145600),
            "requested_bytes": (734003200, 943718400, 1363148800, 629145600),
            "segment": (2, 3, 4, 2), "reserved_bytes": (734003200, 943718400, 1363148800, 629145600),
        },
        num_device_alloc=4, num_device_free=2, num_alloc_retries=1, num_sync_all_streams=1,
    ))


def test_example6_max_split_step_d_releases_largest_first_then_retries():
    dev, a = make("max_split_size_mb:200", total="1GiB", device_cls=RecordingDevice)
    p300 = a.malloc(300 * MiB)
    p250 = a.malloc(250 * MiB)
    a.free(p300)
    a.free(p250)
    a.malloc(600 * MiB)
    # "step d walks down from the largest: releases 300 MiB then 250 MiB, runs out -> returns
    #  false (but both are already freed); step e syncs, finds nothing more, retry succeeds ->
    #  reserved 629,145,600, num_device_free 2, num_alloc_retries 1, num_sync_all_streams 1".
    # Largest-first order (300 then 250) shows step d freed them: step e would walk the pool
    # in ascending (stream, size, address) order, 250 first (§11.1).
    assert [size for _, size in dev.freed] == [300 * MiB, 250 * MiB]
    assert_stats(a, expected_stats(
        large={
            # +300M +250M (peak 550M) -550M +600M
            "allocation": (1, 2, 3, 2), "active": (1, 2, 3, 2),
            "allocated_bytes": (629145600, 629145600, 1205862400, 576716800),
            "active_bytes": (629145600, 629145600, 1205862400, 576716800),
            "requested_bytes": (629145600, 629145600, 1205862400, 576716800),
            "segment": (1, 2, 3, 2), "reserved_bytes": (629145600, 629145600, 1205862400, 576716800),
        },
        # all three blocks / segments are >= M
        oversize_allocations=(1, 2, 3, 2), oversize_segments=(1, 2, 3, 2),
        max_split_size=M200,
        num_device_alloc=3, num_device_free=2, num_alloc_retries=1, num_sync_all_streams=1,
    ))


# -------------------------------------------------------------------------------------------
# §20 Example 7 — fraction limit OOM and the message (also §13, §15)

EXAMPLE7_CURRENT = (
    "CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a total capacity of 16.00 GiB of "
    "which 10.00 GiB is free. 8.00 GiB allowed; Of the allocated memory 6.00 GiB is allocated by "
    "PyTorch, and 0 bytes is reserved by PyTorch but unallocated. If reserved but unallocated "
    "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
    "fragmentation.  See documentation for Memory Management  "
    "(https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)"
)
EXAMPLE7_LEGACY = (
    "CUDA out of memory. Tried to allocate 3.00 GiB (GPU 0; 16.00 GiB total capacity; 6.00 GiB "
    "already allocated; 10.00 GiB free; 8.00 GiB allowed; 6.00 GiB reserved in total by PyTorch) "
    "If reserved memory is >> allocated memory try setting max_split_size_mb to avoid "
    "fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF"
)


def _example7(oom_format: str):
    dev = RecordingDevice(16 * GiB, context=0)
    a = CachingAllocator(dev, alloc_conf="", oom_format=oom_format)
    a.set_memory_fraction(0.5)
    a.malloc(6 * GiB)
    with pytest.raises(OutOfMemoryError) as info:
        a.malloc(3 * GiB)
    return dev, a, info


def test_example7_current_oom_message():
    _, a, info = _example7("current")
    assert str(info.value) == EXAMPLE7_CURRENT
    assert isinstance(info.value, RuntimeError)
    assert a.mem_get_info() == (10 * GiB, 16 * GiB)  # "device_free = 10,737,418,240"


def test_example7_legacy_oom_message():
    _, _, info = _example7("legacy")
    assert str(info.value) == EXAMPLE7_LEGACY


def test_example7_fraction_rejection_stats_and_no_driver_call():
    dev, a, _ = _example7("current")
    # "attempt 1 refused without a driver call; step e syncs (num_sync_all_streams 1), frees
    #  nothing, attempt 3 refused (num_alloc_retries 1) -> OOM (num_ooms 1)"
    assert dev.malloc_requests == [6 * GiB]
    assert_stats(a, expected_stats(
        large={
            "allocation": grown(1), "active": grown(1),
            "allocated_bytes": grown(6442450944), "active_bytes": grown(6442450944),
            "requested_bytes": grown(6442450944),
            "segment": grown(1), "reserved_bytes": grown(6442450944),
        },
        num_device_alloc=1, num_sync_all_streams=1, num_alloc_retries=1, num_ooms=1,
    ))


# -------------------------------------------------------------------------------------------
# §20 Example 8 / §12 — garbage collection

def test_example8_gc_releases_only_the_old_block():
    dev = RecordingDevice(GiB, context=0)  # 1,073,741,824
    a = CachingAllocator(dev, alloc_conf="garbage_collection_threshold:0.3")
    a.set_memory_fraction(0.8)
    # allowed = floor(0.8 x 1,073,741,824) = 858,993,459 (§13)
    assert a.get_memory_fraction() == 858993459 / 1073741824
    pa = a.malloc(200 * MiB)  # large-pool search clock 1 (fails; GC: 0 <= threshold)
    pb = a.malloc(200 * MiB)  # clock 2 (GC: 209,715,200 <= 257,698,037 -> nothing)
    a.free(pa)  # base 2
    a.free(pb)  # base 2
    # Equal-size tie -> lowest address (§7). The spec's increasing bases make that A; with our
    # top-down device B is lower. Either way the reused one is min(pa, pb); its base ends at 5,
    # the other keeps base 2.
    reused, old = min(pa, pb), max(pa, pb)
    for _ in range(3):  # clock 3, 4, 5
        p = a.malloc(200 * MiB)
        assert p == reused
        a.free(p)
    a.malloc(300 * MiB)
    # search fails (clock 6); threshold floor(0.3 x 858,993,459) = 257,698,037; reserved
    # 419,430,400 > it, target 161,732,363; ages old = 4, reused = 1, avg 2.5 -> only the old
    # one is released (209,715,200 >= target); then cudaMalloc 300 MiB.
    assert dev.freed == [(old, 200 * MiB)]
    assert dev.malloc_requests == [200 * MiB, 200 * MiB, 300 * MiB]
    # "reserved 524,288,000, allocated 314,572,800, segment 2, num_device_free 1,
    #  num_device_alloc 3, num_alloc_retries 0, num_sync_all_streams 0"
    # allocation: +2 (peak 2) -2, 3x(+1 -1), +1; bytes likewise with 200M / 300M.
    assert_stats(a, expected_stats(
        large={
            "allocation": (1, 2, 6, 5), "active": (1, 2, 6, 5),
            "allocated_bytes": (314572800, 419430400, 1363148800, 1048576000),
            "active_bytes": (314572800, 419430400, 1363148800, 1048576000),
            "requested_bytes": (314572800, 419430400, 1363148800, 1048576000),
            # +2 segs (400M), -1 (200M), +1 (300M)
            "segment": (2, 2, 3, 1), "reserved_bytes": (524288000, 524288000, 734003200, 209715200),
        },
        num_device_alloc=3, num_device_free=1,
    ))
    # The survivor is the reused block: a 200 MiB request takes it without a new segment.
    assert a.malloc(200 * MiB) == reused
    assert stat(a, "num_device_alloc") == 3


def test_gc_needs_a_fraction_below_one():
    # §12 (newest): GC runs only when a fraction limit < 1 is in force. Same sequence as
    # Example 8 without the fraction: nothing is released, 300 MiB just gets a new segment.
    dev = RecordingDevice(GiB, context=0)
    a = CachingAllocator(dev, alloc_conf="garbage_collection_threshold:0.3")
    a.set_memory_fraction(1.0)
    pa, pb = a.malloc(200 * MiB), a.malloc(200 * MiB)
    a.free(pa)
    a.free(pb)
    for _ in range(3):
        a.free(a.malloc(200 * MiB))
    a.malloc(300 * MiB)
    assert dev.freed == []
    assert stat(a, "reserved_bytes.all.current") == 734003200
    assert stat(a, "num_device_free") == 0


# -------------------------------------------------------------------------------------------
# §20 Example 9 — roundup_power2_divisions through the allocator

def test_example9_divisions_4():
    dev, a = make("roundup_power2_divisions:4", device_cls=RecordingDevice)
    a.malloc(1153434)  # "1.1 MiB ... becomes 1.25 MiB (large pool, 20 MiB segment)"
    a.malloc(600 * MiB)  # "600 MiB becomes 640 MiB (cudaMalloc 640 MiB)"
    a.malloc(1200)  # "1200 B stays 1536 B"
    assert dev.malloc_requests == [20 * MiB, 640 * MiB, 2 * MiB]
    # large: 1,310,720 in a 20 MiB segment (split, 19,660,800 left) + 671,088,640 whole segment;
    # small: 1536 in a 2 MiB segment (split, 2,095,616 left).
    assert_stats(a, expected_stats(
        large={
            "allocation": grown(2), "active": grown(2),
            "allocated_bytes": grown(672399360), "active_bytes": grown(672399360),
            "requested_bytes": grown(630299034),
            "segment": grown(2), "reserved_bytes": grown(692060160),
            "inactive_split": grown(1), "inactive_split_bytes": grown(19660800),
        },
        small={
            "allocation": grown(1), "active": grown(1),
            "allocated_bytes": grown(1536), "active_bytes": grown(1536),
            "requested_bytes": grown(1200),
            "segment": grown(1), "reserved_bytes": grown(2097152),
            "inactive_split": grown(1), "inactive_split_bytes": grown(2095616),
        },
        all_={
            "allocation": grown(3), "active": grown(3),
            "allocated_bytes": grown(672400896), "active_bytes": grown(672400896),
            "requested_bytes": grown(630300234),
            "segment": grown(3), "reserved_bytes": grown(694157312),
            "inactive_split": grown(2), "inactive_split_bytes": grown(21756416),
        },
        num_device_alloc=3,
    ))


def test_example9_divisions_list_newest():
    dev, a = make("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]", device_cls=RecordingDevice)
    a.malloc(600 * MiB)  # -> 768 MiB
    a.malloc(1395864371)  # ≈1.3 GiB -> 1.5 GiB (newest)
    assert dev.malloc_requests == [805306368, 1610612736]
    assert_stats(a, expected_stats(
        large={
            "allocation": grown(2), "active": grown(2),
            "allocated_bytes": grown(2415919104), "active_bytes": grown(2415919104),
            "requested_bytes": grown(629145600 + 1395864371),
            "segment": grown(2), "reserved_bytes": grown(2415919104),
        },
        num_device_alloc=2,
    ))


# -------------------------------------------------------------------------------------------
# §20 Example 10 / §14 — expandable segments

def _example10_start():
    dev, a = make("expandable_segments:True")
    p3 = a.malloc(3 * MiB)
    return dev, a, p3


def test_example10_first_3mib_maps_one_20mib_page():
    _, a, _ = _example10_start()
    # "allocated 3,145,728, reserved 20,971,520, segment 0, inactive_split 0, num_device_alloc 1"
    assert_stats(a, expected_stats(
        large={
            "allocation": grown(1), "active": grown(1),
            "allocated_bytes": grown(3145728), "active_bytes": grown(3145728),
            "requested_bytes": grown(3145728), "reserved_bytes": grown(20971520),
        },
        num_device_alloc=1,
    ))


def test_example10_30mib_extends_the_segment():
    _, a, p3 = _example10_start()
    p30 = a.malloc(30 * MiB)
    assert p30 == p3 + 3 * MiB  # carved from the extended 37 MiB block right after the 3 MiB
    # "allocated 34,603,008, reserved 41,943,040, num_device_alloc 2"
    assert_stats(a, expected_stats(
        large={
            "allocation": grown(2), "active": grown(2),
            "allocated_bytes": grown(34603008), "active_bytes": grown(34603008),
            "requested_bytes": grown(34603008), "reserved_bytes": grown(41943040),
        },
        num_device_alloc=2,
    ))


def test_example10_snapshot_shows_one_expandable_segment():
    from vram.views.snapshot import segments

    _, a, p3 = _example10_start()
    a.malloc(30 * MiB)
    segs = segments(a)
    # "Snapshot: one segment, is_expandable True, total_size 41,943,040, blocks 3 MiB / 30 MiB /
    #  7 MiB."
    assert len(segs) == 1
    seg = segs[0]
    assert seg["is_expandable"] is True
    assert seg["total_size"] == 41943040
    assert seg["address"] == p3
    assert [b["size"] for b in seg["blocks"]] == [3 * MiB, 30 * MiB, 7 * MiB]
    assert [b["state"] for b in seg["blocks"]] == ["active_allocated", "active_allocated", "inactive"]


def test_example10_empty_cache_cannot_unmap_partial_pages():
    _, a, p3 = _example10_start()
    a.malloc(30 * MiB)
    a.free(p3)
    a.empty_cache()
    # "no page lies entirely inside the 3 MiB or the 7 MiB free block -> nothing unmapped
    #  (num_device_free 0, num_sync_all_streams 1)"
    assert_stats(a, expected_stats(
        large={
            "allocation": (1, 2, 2, 1), "active": (1, 2, 2, 1),
            "allocated_bytes": (31457280, 34603008, 34603008, 3145728),
            "active_bytes": (31457280, 34603008, 34603008, 3145728),
            "requested_bytes": (31457280, 34603008, 34603008, 3145728),
            "reserved_bytes": grown(41943040),
        },
        num_device_alloc=2, num_device_free=0, num_sync_all_streams=1,
    ))


def test_example10_free_all_then_empty_cache_unmaps_both_pages_in_one_call():
    from vram.views.snapshot import segments

    _, a, p3 = _example10_start()
    p30 = a.malloc(30 * MiB)
    a.free(p3)
    a.empty_cache()
    a.free(p30)
    a.empty_cache()
    # "merges into one 40 MiB free block; empty_cache() -> both pages unmapped in one call
    #  (reserved 0, num_device_free 1), the virtual range is released." segment and
    #  inactive_split never move for expandable memory (§14, §16.3).
    assert_stats(a, expected_stats(
        large={
            "allocation": (0, 2, 2, 2), "active": (0, 2, 2, 2),
            "allocated_bytes": (0, 34603008, 34603008, 34603008),
            "active_bytes": (0, 34603008, 34603008, 34603008),
            "requested_bytes": (0, 34603008, 34603008, 34603008),
            "reserved_bytes": (0, 41943040, 41943040, 41943040),
        },
        num_device_alloc=2, num_device_free=1, num_sync_all_streams=2,
    ))
    assert segments(a) == []
    assert a.mem_get_info() == (16 * GiB, 16 * GiB)


# -------------------------------------------------------------------------------------------
# §4 request rounding — every row of the worked-values table

LIST_CONF = "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]"
# §3.4: "[256:1,512:2,1024:4,>:8] -> newest table [1,1,1,1,1,1,1,1,1,2,4,8,8,8,8,8];
#        older [1x9,2,8,8,8,8,8,8]"
LIST_TABLE_NEWEST = [1] * 9 + [2, 4] + [8] * 5
LIST_TABLE_LEGACY = [1] * 9 + [2] + [8] * 6

# (n, divisions table, alloc_conf giving that table, expected round_size)
ROUNDING_ROWS = [
    pytest.param(1000, [0] * 16, "", 1024, id="1000-d0"),
    pytest.param(1200, [4] * 16, "roundup_power2_divisions:4", 1536, id="1200-d4-plain"),
    pytest.param(3000, [4] * 16, "roundup_power2_divisions:4", 3072, id="3000-d4"),
    pytest.param(1153434, [4] * 16, "roundup_power2_divisions:4", 1310720, id="1.1MiB-d4"),
    pytest.param(5 * MiB + 1, [4] * 16, "roundup_power2_divisions:4", 6291456, id="5MiB+1-d4"),
    pytest.param(5 * MiB + 1, [0] * 16, "", 5243392, id="5MiB+1-d0"),
    pytest.param(600 * MiB, [4] * 16, "roundup_power2_divisions:4", 671088640, id="600MiB-d4"),
    pytest.param(600 * MiB, LIST_TABLE_NEWEST, LIST_CONF, 805306368, id="600MiB-list"),
    pytest.param(300 * MiB, LIST_TABLE_NEWEST, LIST_CONF, 314572800, id="300MiB-list"),
    pytest.param(1395864371, LIST_TABLE_NEWEST, LIST_CONF, 1610612736, id="1.3GiB-list-newest"),
    pytest.param(512 * MiB, [4] * 16, "roundup_power2_divisions:4", 512 * MiB, id="512MiB-d4-pow2"),
]


@pytest.mark.parametrize("divisions", [0, 1, 2, 4, 8, 16])
def test_round_size_minimum_512_for_any_divisions(divisions):
    assert round_size(1, [divisions] * 16) == 512


@pytest.mark.parametrize("n,table,conf,expected", ROUNDING_ROWS)
def test_round_size_table_row(n, table, conf, expected):
    assert round_size(n, table) == expected


def test_round_size_legacy_list_table_row():
    # "same | same list, <=2.8 | 1,476,395,008 (1.375 GiB) | bucket 10 overwritten to 8"
    assert round_size(1395864371, LIST_TABLE_LEGACY) == 1476395008


def test_roundup_list_table_newest_and_legacy():
    assert parse_alloc_conf(LIST_CONF).roundup_power2_divisions == LIST_TABLE_NEWEST
    assert parse_alloc_conf(LIST_CONF, legacy_roundup=True).roundup_power2_divisions == LIST_TABLE_LEGACY


@pytest.mark.parametrize("conf", ["", "roundup_power2_divisions:1", "roundup_power2_divisions:4",
                                  "roundup_power2_divisions:16", LIST_CONF])
def test_alloc_conf_rounds_one_byte_to_512(conf):
    _, a = make(conf)
    a.malloc(1)
    assert stat(a, "allocated_bytes.all.current") == 512
    assert stat(a, "requested_bytes.all.current") == 1


@pytest.mark.parametrize("n,table,conf,expected", ROUNDING_ROWS)
def test_alloc_conf_rounding_row_through_allocator(n, table, conf, expected):
    # Every row's rounded size is an exact block: small blocks split at >= 512 left, and each
    # large one either fills its own segment or leaves > 1 MiB of its 20 MiB segment (§6, §8).
    _, a = make(conf)
    a.malloc(n)
    assert stat(a, "allocated_bytes.all.current") == expected
    assert stat(a, "requested_bytes.all.current") == n


def test_alloc_conf_legacy_list_through_parse():
    table = parse_alloc_conf(LIST_CONF, legacy_roundup=True).roundup_power2_divisions
    assert round_size(1395864371, table) == 1476395008


# -------------------------------------------------------------------------------------------
# §5/§6 pool selection and segment sizes

@pytest.mark.parametrize("size,expected", [
    (512, 2 * MiB),
    (MiB, 2 * MiB),  # "size <= 1 MiB -> 2 MiB"
    (MiB + 512, 20 * MiB),  # "1 MiB < size < 10 MiB -> 20 MiB"
    (10 * MiB - 512, 20 * MiB),
    (10 * MiB, 10 * MiB),  # "size >= 10 MiB -> rounded up to a multiple of 2 MiB"
    (10 * MiB + 512, 12 * MiB),
    (15 * MiB, 16 * MiB),
    (19 * MiB, 20 * MiB),
    (20 * MiB + 512, 22 * MiB),
    (300 * MiB, 300 * MiB),
])
def test_allocation_size(size, expected):
    assert allocation_size(size) == expected


@pytest.mark.parametrize("n,reserved,pool", [
    (1000, 2 * MiB, "small_pool"),
    (MiB, 2 * MiB, "small_pool"),  # exactly 1 MiB is small (§5)
    (MiB + 1, 20 * MiB, "large_pool"),  # rounds to 1 MiB + 512 -> large, 20 MiB
    (10 * MiB - 512, 20 * MiB, "large_pool"),  # just below kMinLargeAlloc
    (10 * MiB, 10 * MiB, "large_pool"),  # at the 10 MiB boundary: own 10 MiB segment
    (10 * MiB + 1, 12 * MiB, "large_pool"),  # 10 MiB + 512 -> next 2 MiB multiple
])
def test_segment_size_through_allocator(n, reserved, pool):
    dev, a = make(device_cls=RecordingDevice)
    a.malloc(n)
    assert dev.malloc_requests == [reserved]
    assert stat(a, f"reserved_bytes.{pool}.current") == reserved
    assert stat(a, "reserved_bytes.all.current") == reserved
    assert stat(a, f"segment.{pool}.current") == 1


def test_failing_1000_byte_request_reports_tried_to_allocate_2mib():
    # §6: "a failing 1000-byte request reports 'Tried to allocate 2.00 MiB'". A 1 MiB device
    # cannot give a 2 MiB segment; message per §15.1 with no NVML and no fraction limit.
    _, a = make(total=MiB)
    with pytest.raises(OutOfMemoryError) as info:
        a.malloc(1000)
    assert str(info.value) == (
        "CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has a total capacity of 1024.00 KiB "
        "of which 1024.00 KiB is free. Of the allocated memory 0 bytes is allocated by PyTorch, and "
        "0 bytes is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
        "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
        "documentation for Memory Management  "
        "(https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)"
    )
    # step e ran (sync + retry), then the OOM (§9)
    assert_stats(a, expected_stats(num_alloc_retries=1, num_sync_all_streams=1, num_ooms=1))


# -------------------------------------------------------------------------------------------
# §10.1 record_stream illustration

S, T = 0, 7  # allocation stream S (default), other stream T


def _pending_4mib(event_completion: str):
    dev, a = make(event_completion=event_completion)
    p = a.malloc(4 * MiB, stream=S)
    a.record_stream(p, T)
    a.free(p)
    return dev, a, p


# state right after the free of the record_stream'ed 4 MiB block: allocation/allocated_bytes
# drop, active/active_bytes/requested_bytes stay (only free completion lowers them, §10.2).
PENDING_4MIB = dict(
    large={
        "allocation": (0, 1, 1, 1), "allocated_bytes": (0, 4 * MiB, 4 * MiB, 4 * MiB),
        "active": grown(1), "active_bytes": grown(4 * MiB), "requested_bytes": grown(4 * MiB),
        "segment": grown(1), "reserved_bytes": grown(20 * MiB),
        "inactive_split": grown(1), "inactive_split_bytes": grown(16 * MiB),
    },
    num_device_alloc=1,
)


@pytest.mark.parametrize("mode", ["immediate", "on_sync"])
def test_record_stream_free_keeps_block_active(mode):
    from vram.views.snapshot import segments

    _, a, p = _pending_4mib(mode)
    # "allocation and allocated_bytes drop (0 / 0) but active stays 1 and active_bytes 4 MiB"
    assert_stats(a, expected_stats(**PENDING_4MIB))
    # "the snapshot block state is active_pending_free"
    (seg,) = segments(a)
    assert seg["blocks"][0]["address"] == p
    assert seg["blocks"][0]["state"] == "active_pending_free"


def test_record_stream_immediate_next_malloc_completes_free():
    _, a, _ = _pending_4mib("immediate")
    a.malloc(1000, stream=T)  # "At the next malloc (any size, any stream)"
    # process_events runs first: the 4 MiB block completes (active -1, merges with its 16 MiB
    # remainder: inactive_split -1 / -16 MiB), then the 1000 B small block is carved.
    assert_stats(a, expected_stats(
        large={
            "allocation": (0, 1, 1, 1), "active": (0, 1, 1, 1),
            "allocated_bytes": (0, 4 * MiB, 4 * MiB, 4 * MiB),
            "active_bytes": (0, 4 * MiB, 4 * MiB, 4 * MiB),
            "requested_bytes": (0, 4 * MiB, 4 * MiB, 4 * MiB),
            "segment": grown(1), "reserved_bytes": grown(20 * MiB),
            "inactive_split": (0, 1, 1, 1), "inactive_split_bytes": (0, 16 * MiB, 16 * MiB, 16 * MiB),
        },
        small={
            "allocation": grown(1), "active": grown(1),
            "allocated_bytes": grown(1024), "active_bytes": grown(1024), "requested_bytes": grown(1000),
            "segment": grown(1), "reserved_bytes": grown(2 * MiB),
            "inactive_split": grown(1), "inactive_split_bytes": grown(2096128),
        },
        all_={
            # large +1 -1, small +1 (active: completion happens before the carve -> peak 1)
            "allocation": (1, 1, 2, 1), "active": (1, 1, 2, 1),
            "allocated_bytes": (1024, 4 * MiB, 4 * MiB + 1024, 4 * MiB),
            "active_bytes": (1024, 4 * MiB, 4 * MiB + 1024, 4 * MiB),
            "requested_bytes": (1000, 4 * MiB, 4 * MiB + 1000, 4 * MiB),
            "segment": grown(2), "reserved_bytes": grown(22 * MiB),
            "inactive_split": (1, 1, 2, 1),
            "inactive_split_bytes": (2096128, 16 * MiB, 16 * MiB + 2096128, 16 * MiB),
        },
        num_device_alloc=2,
    ))


def test_record_stream_immediate_block_reusable_at_next_malloc():
    _, a, p = _pending_4mib("immediate")
    # free completes at the start of this malloc, merges back into the whole 20 MiB segment,
    # which is then the best fit: same address again, no new segment.
    assert a.malloc(4 * MiB, stream=S) == p
    assert stat(a, "num_device_alloc") == 1


def test_record_stream_on_sync_block_not_reused_before_sync():
    _, a, p = _pending_4mib("on_sync")
    # T's event is not complete: the pending block can be neither merged nor reused; the next
    # 4 MiB comes from the front of the 16 MiB remainder.
    assert a.malloc(4 * MiB, stream=S) == p + 4 * MiB
    assert stat(a, "active.large_pool.current") == 2
    assert stat(a, "num_device_alloc") == 1


def test_record_stream_on_sync_needs_synchronize_and_next_malloc():
    dev, a, _ = _pending_4mib("on_sync")
    a.malloc(1000)
    assert stat(a, "active.large_pool.current") == 1  # event still pending
    assert stat(a, "active_bytes.large_pool.current") == 4 * MiB
    dev.synchronize()
    # completion is only noticed by process_events at the next malloc (§10.3)
    assert stat(a, "active.large_pool.current") == 1
    a.malloc(1000)
    assert stat(a, "active.large_pool.current") == 0
    assert stat(a, "active_bytes.large_pool.current") == 0
    assert stat(a, "inactive_split.large_pool.current") == 0  # merged with its remainder
    assert stat(a, "num_sync_all_streams") == 0


def test_record_stream_on_sync_synchronize_other_stream_only():
    dev, a, _ = _pending_4mib("on_sync")
    dev.synchronize(S)  # the allocation stream is not the one the event was recorded on
    a.malloc(1000)
    assert stat(a, "active.large_pool.current") == 1
    dev.synchronize(T)
    a.malloc(1000)
    assert stat(a, "active.large_pool.current") == 0


def test_record_stream_on_sync_empty_cache_waits_and_releases_segment():
    _, a, _ = _pending_4mib("on_sync")
    a.empty_cache()
    # "empty_cache() would instead wait for the event (synchronize_and_free_events) and then
    #  release the segment if whole": free completion merges to 20 MiB unsplit -> cudaFree.
    assert_stats(a, expected_stats(
        large={
            "allocation": (0, 1, 1, 1), "active": (0, 1, 1, 1),
            "allocated_bytes": (0, 4 * MiB, 4 * MiB, 4 * MiB),
            "active_bytes": (0, 4 * MiB, 4 * MiB, 4 * MiB),
            "requested_bytes": (0, 4 * MiB, 4 * MiB, 4 * MiB),
            "segment": (0, 1, 1, 1), "reserved_bytes": (0, 20 * MiB, 20 * MiB, 20 * MiB),
            "inactive_split": (0, 1, 1, 1), "inactive_split_bytes": (0, 16 * MiB, 16 * MiB, 16 * MiB),
        },
        num_device_alloc=1, num_device_free=1, num_sync_all_streams=1,
    ))


def test_record_stream_on_own_stream_is_ignored():
    _, a = make(event_completion="on_sync")
    p = a.malloc(4 * MiB, stream=S)
    a.record_stream(p, S)  # "ignored if t is the block's own allocation stream"
    a.free(p)
    assert stat(a, "active.all.current") == 0
    assert stat(a, "inactive_split.all.current") == 0


# -------------------------------------------------------------------------------------------
# §11.2 release_available_cached_blocks (retry step d)

def test_release_available_is_a_no_op_without_max_split():
    # Default M (unlimited): step d returns false; step e frees in pool order (ascending size:
    # 250 MiB then 300 MiB), costing a sync and a retry.
    dev, a = make(total="1GiB", device_cls=RecordingDevice)
    p300, p250 = a.malloc(300 * MiB), a.malloc(250 * MiB)
    a.free(p300)
    a.free(p250)
    a.malloc(600 * MiB)  # 550 + 600 MiB > 1 GiB
    assert [size for _, size in dev.freed] == [250 * MiB, 300 * MiB]
    assert stat(a, "num_sync_all_streams") == 1
    assert stat(a, "num_alloc_retries") == 1


def test_release_available_frees_smallest_single_block_at_least_key():
    dev, a = make("max_split_size_mb:200", total="1GiB", device_cls=RecordingDevice)
    a.malloc(100 * MiB)  # stays allocated
    p300, p400 = a.malloc(300 * MiB), a.malloc(400 * MiB)
    a.free(p300)
    a.free(p400)
    a.malloc(250 * MiB)
    # search: 300 MiB >= 250 + 20 -> no reuse; cudaMalloc: 800 + 250 MiB > 1 GiB -> fail;
    # step d: key = max(250 MiB, M) = 250 MiB; smallest free block >= key is 300 MiB -> released,
    # true -> attempt 2 (not a retry) succeeds; no sync.
    assert [size for _, size in dev.freed] == [300 * MiB]
    assert dev.malloc_requests == [100 * MiB, 300 * MiB, 400 * MiB, 250 * MiB, 250 * MiB]
    assert_stats(a, expected_stats(
        large={
            # +100M +300M +400M (peak 800M) -700M +250M
            "allocation": (2, 3, 4, 2), "active": (2, 3, 4, 2),
            "allocated_bytes": (367001600, 838860800, 1101004800, 734003200),
            "active_bytes": (367001600, 838860800, 1101004800, 734003200),
            "requested_bytes": (367001600, 838860800, 1101004800, 734003200),
            # +3 segs (800M), -300M, +250M
            "segment": (3, 3, 4, 1), "reserved_bytes": (786432000, 838860800, 1101004800, 314572800),
        },
        # >= M: 300, 400, 250 (not 100)
        oversize_allocations=(1, 2, 3, 2), oversize_segments=(2, 2, 3, 1),
        max_split_size=M200, num_device_alloc=4, num_device_free=1,
    ))


def test_release_available_walk_down_succeeds_without_retry():
    dev, a = make("max_split_size_mb:200", total="1GiB", device_cls=RecordingDevice)
    p300, p250 = a.malloc(300 * MiB), a.malloc(250 * MiB)
    a.free(p300)
    a.free(p250)
    a.malloc(500 * MiB)
    # 550 + 500 MiB > 1 GiB; key 500 MiB, no single block >= key; walking down from the
    # largest: 300 (released 300 < 500), 250 (550 >= 500) -> true -> attempt 2 succeeds.
    assert [size for _, size in dev.freed] == [300 * MiB, 250 * MiB]
    assert stat(a, "num_alloc_retries") == 0
    assert stat(a, "num_sync_all_streams") == 0
    assert stat(a, "reserved_bytes.all.current") == 500 * MiB


def test_release_available_only_considers_the_request_stream():
    dev, a = make("max_split_size_mb:200", total="1GiB", device_cls=RecordingDevice)
    a.malloc(400 * MiB, stream=0)
    a.free(a.malloc(500 * MiB, stream=1))
    a.malloc(250 * MiB, stream=0)
    # 900 + 250 MiB > 1 GiB. Step d only looks at stream 0's free blocks: none -> false. Step e
    # (sync, retry) releases the stream-1 block, then the retry succeeds.
    assert [size for _, size in dev.freed] == [500 * MiB]
    assert stat(a, "num_alloc_retries") == 1
    assert stat(a, "num_sync_all_streams") == 1
    assert stat(a, "reserved_bytes.all.current") == 650 * MiB


# -------------------------------------------------------------------------------------------
# §13 per-process memory fraction

def test_fraction_allowed_is_floor_and_boundary_is_strict_greater():
    dev, a = make(total="1GiB", device_cls=RecordingDevice)
    a.set_memory_fraction(0.8)  # allowed floor(858,993,459.2) = 858,993,459
    a.malloc(818 * MiB)  # 857,735,168 <= allowed
    assert stat(a, "reserved_bytes.all.current") == 818 * MiB
    a2_dev, a2 = make(total="1GiB", device_cls=RecordingDevice)
    a2.set_memory_fraction(0.8)
    with pytest.raises(OutOfMemoryError):
        a2.malloc(820 * MiB)  # 859,832,320 > allowed: refused before any driver call
    assert a2_dev.malloc_requests == []
    assert_stats(a2, expected_stats(num_alloc_retries=1, num_sync_all_streams=1, num_ooms=1))


def test_fraction_exactly_allowed_is_accepted():
    _, a = make(total="16GiB")
    a.set_memory_fraction(0.5)  # 8 GiB
    a.malloc(8 * GiB)  # total + alloc_size == allowed: not >, accepted
    assert stat(a, "reserved_bytes.all.current") == 8 * GiB
    assert stat(a, "num_alloc_retries") == 0


def test_fraction_cached_blocks_still_reused_beyond_limit():
    _, a = make(total="16GiB")
    p = a.malloc(6 * GiB)
    a.free(p)
    a.set_memory_fraction(0.25)  # 4 GiB, below what is already reserved
    assert a.malloc(6 * GiB) == p  # served from the cache: enforcement is only in alloc_block
    assert stat(a, "num_device_alloc") == 1
    assert stat(a, "num_alloc_retries") == 0
    assert stat(a, "num_ooms") == 0


def test_fraction_one_removes_the_limit():
    _, a = make(total="16GiB")
    a.set_memory_fraction(0.5)
    a.set_memory_fraction(1.0)
    a.malloc(12 * GiB)
    assert stat(a, "reserved_bytes.all.current") == 12 * GiB
    assert a.get_memory_fraction() == 1.0


def test_fraction_out_of_range_value_error():
    _, a = make()
    with pytest.raises(ValueError, match=r"^Invalid fraction value: 1\.5\. Allowed range: 0~1$"):
        a.set_memory_fraction(1.5)
    with pytest.raises(ValueError, match=r"^Invalid fraction value: -0\.1\. Allowed range: 0~1$"):
        a.set_memory_fraction(-0.1)


def test_fraction_int_rejected_with_type_error():
    # §13: "fraction must be a Python float (an int such as 1 is rejected: TypeError
    # ``Invalid type for fraction argument, must be `float` ``)"
    _, a = make()
    with pytest.raises(TypeError, match=r"^Invalid type for fraction argument, must be `float`$"):
        a.set_memory_fraction(1)


# -------------------------------------------------------------------------------------------
# §15 format_size boundaries

@pytest.mark.parametrize("size,text", [
    (0, "0 bytes"),
    (1, "1 bytes"),
    (1024, "1024 bytes"),  # b <= 1024 -> bytes
    (1025, "1.00 KiB"),
    (1536, "1.50 KiB"),
    (1048576, "1024.00 KiB"),  # b <= 1 MiB -> KiB
    (1048577, "1.00 MiB"),
    (2097152, "2.00 MiB"),
    (1073741824, "1024.00 MiB"),  # "exactly 1 GiB prints 1024.00 MiB"
    (1073741825, "1.00 GiB"),
    (3 * GiB, "3.00 GiB"),
    (10737418240, "10.00 GiB"),
    (16 * GiB, "16.00 GiB"),
])
def test_format_size(size, text):
    assert format_size(size) == text


# -------------------------------------------------------------------------------------------
# §16.3 inactive_split accounting: the net change on free completion

def test_inactive_split_net_change_on_free_completion():
    _, a = make()
    # four 512 KiB blocks a < b < c < d fill one 2 MiB small segment (carved front-first, §8):
    # after them count (0,1,1,1), bytes (0, 1572864, 1572864, 1572864) — see Example 2.
    pa, pb, pc, pd = (a.malloc(512 * KiB) for _ in range(4))
    a.free(pa)  # no free neighbour, still split: +1, +512 KiB
    a.free(pc)  # neighbours b, d allocated: +1, +512 KiB
    assert stat(a, "inactive_split.small_pool.current") == 2
    assert stat(a, "inactive_split_bytes.small_pool.current") == MiB
    a.free(pb)
    # merges a and c: -2 / -1 MiB, result (1.5 MiB) still split: +1 / +1.5 MiB; the *net*
    # change is applied: count -1 (freed +1), bytes +512 KiB (allocated +512 KiB).
    s = a.memory_stats()
    assert [s[f"inactive_split.small_pool.{f}"] for f in FIELDS] == [1, 2, 3, 2]
    assert [s[f"inactive_split_bytes.small_pool.{f}"] for f in FIELDS] == [
        1572864, 1572864, 3145728, 1572864]
    a.free(pd)  # merges with the 1.5 MiB block, result unsplit: net -1 / -1.5 MiB
    assert_stats(a, expected_stats(
        small={
            "allocation": (0, 4, 4, 4), "active": (0, 4, 4, 4),
            "allocated_bytes": (0, 2 * MiB, 2 * MiB, 2 * MiB),
            "active_bytes": (0, 2 * MiB, 2 * MiB, 2 * MiB),
            "requested_bytes": (0, 2 * MiB, 2 * MiB, 2 * MiB),
            "segment": grown(1), "reserved_bytes": grown(2 * MiB),
            "inactive_split": (0, 2, 3, 3), "inactive_split_bytes": (0, 1572864, 3145728, 3145728),
        },
        num_device_alloc=1,
    ))


# -------------------------------------------------------------------------------------------
# §9 step 0: 1 EB guard and zero-byte requests

def test_one_exabyte_guard_message_and_no_stats():
    dev, a = make(device_cls=RecordingDevice)
    with pytest.raises(OutOfMemoryError) as info:
        a.malloc(2**60)
    assert str(info.value) == "CUDA out of memory. Tried to allocate more than 1EB memory."
    assert dev.malloc_requests == []
    assert_stats(a, expected_stats())  # "no stats touched" (num_ooms stays 0)


def test_just_below_one_exabyte_takes_the_normal_oom_path():
    _, a = make()
    # 2^60 - 1 rounds to 2^60 (512 multiple), alloc_size 2^60 -> format_size = 2^30 GiB.
    with pytest.raises(OutOfMemoryError) as info:
        a.malloc(2**60 - 1)
    assert str(info.value).startswith("CUDA out of memory. Tried to allocate 1073741824.00 GiB. ")
    assert_stats(a, expected_stats(num_alloc_retries=1, num_sync_all_streams=1, num_ooms=1))


def test_zero_byte_malloc_returns_null_and_touches_nothing():
    dev, a = make(device_cls=RecordingDevice)
    assert a.malloc(0) == 0
    assert dev.malloc_requests == []
    assert_stats(a, expected_stats())
