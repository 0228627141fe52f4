"""Tests for vram.summary: the memory_summary text of spec §17.

Two kinds of checks:

* the worked example of spec §17, with the stats dict written out by hand from the numbers of
  spec §20 Examples 1 and 3 and the accounting rules of §16.1/§16.3 (no allocator code involved);
* byte-for-byte agreement with PyTorch's own ``torch.cuda.memory.memory_summary`` fed the same
  flat stats dict (those tests are skipped when torch is not installed).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from vram.views.summary import (
    POOL_NAMES,
    STAT_ARRAY_NAMES,
    STAT_FIELDS,
    format_summary_count,
    format_summary_size,
    memory_summary_from_stats,
)

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

SCALAR_STATS = (
    "max_split_size",
    "num_alloc_retries",
    "num_device_alloc",
    "num_device_free",
    "num_ooms",
    "num_sync_all_streams",
)
OVERSIZE_STATS = ("oversize_allocations", "oversize_segments")


def stat(current: int, peak: int, allocated: int, freed: int) -> dict[str, int]:
    """One Stat (spec §16.1) as its four fields."""
    return {"current": current, "peak": peak, "allocated": allocated, "freed": freed}


def flatten(nested: Mapping[str, Any], prefix: str = "") -> dict[str, int]:
    """Flatten like ``torch.cuda.memory_stats`` (spec §16.2): keys joined with ``.``, sorted."""
    flat: dict[str, int] = {}
    for key, value in nested.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return dict(sorted(flat.items()))


def all_stat_keys() -> list[str]:
    """The 122 keys of a pre-2.15 memory_stats dict (spec §16.2)."""
    keys = [f"{a}.{p}.{f}" for a in STAT_ARRAY_NAMES for p in POOL_NAMES for f in STAT_FIELDS]
    keys += [f"{o}.{f}" for o in OVERSIZE_STATS for f in STAT_FIELDS]
    keys += list(SCALAR_STATS)
    return sorted(keys)


# ---------------------------------------------------------------------------------------------
# Spec §17 worked example: §20 Example 3 (A = 4 MiB, B = 4 MiB, C = 15 MiB, large pool) followed
# by §20 Example 1 (x = 1000 B, small pool), everything kept alive, nothing freed.
#
# Large pool, per §20 Example 3:
#   allocation / active      +1 per carve: A, B, C                                  -> 3
#   allocated/active bytes   block sizes 4 MiB + 4 MiB + 16 MiB (C rounds to a 16 MiB
#                            segment and is not split, so its block is 16 MiB)     -> 24 MiB
#   requested_bytes          4 MiB + 4 MiB + 15 MiB                                 -> 23 MiB
#   segment / reserved       20 MiB (for A, shared by B) + 16 MiB (C)               -> 2 / 36 MiB
#   inactive_split (§16.3)   A splits an unsplit 20 MiB block: +1 / +16 MiB
#                            B splits an already split block:  count same, -4 MiB
#                            C takes a whole new segment: no change
#                            -> count 1 (peak 1, allocated 1, freed 0)
#                            -> bytes current 12 MiB, peak 16 MiB, allocated 16 MiB, freed 4 MiB
# Small pool, per §20 Example 1 (1000 B rounds to 1024 B in a new 2 MiB segment, split):
#   allocation / active 1, allocated/active bytes 1024, requested 1000,
#   segment 1 / reserved 2 MiB, inactive_split 1 / 2 MiB - 1024 = 2,096,128.
# "all" = large + small for current/allocated/freed. Peaks equal currents because every stat
# only grew, except inactive_split{,_bytes} whose "all" timeline is
#   bytes: 16 MiB (A), 12 MiB (B), 12 MiB (C), 12 MiB + 2,096,128 (x) -> peak 16 MiB
#   count: 1, 1, 1, 2                                                    -> peak 2
# Counters: no OOM, no retry, no sync; three cudaMallocs; max_split_size unlimited (-1).
# ---------------------------------------------------------------------------------------------


def _grown(value: int) -> dict[str, int]:
    """A Stat that only ever increased to ``value``."""
    return stat(value, value, value, 0)


LARGE_BYTES = 4 * MiB + 4 * MiB + 16 * MiB
LARGE_REQUESTED = 4 * MiB + 4 * MiB + 15 * MiB
LARGE_RESERVED = 20 * MiB + 16 * MiB
SMALL_BYTES = 1024
SMALL_REQUESTED = 1000
SMALL_RESERVED = 2 * MiB
SMALL_INACTIVE = 2 * MiB - 1024

EXAMPLE_STATS: dict[str, int] = flatten({
    "allocation": {"all": _grown(4), "large_pool": _grown(3), "small_pool": _grown(1)},
    "active": {"all": _grown(4), "large_pool": _grown(3), "small_pool": _grown(1)},
    "segment": {"all": _grown(3), "large_pool": _grown(2), "small_pool": _grown(1)},
    "inactive_split": {
        "all": stat(2, 2, 2, 0),
        "large_pool": stat(1, 1, 1, 0),
        "small_pool": stat(1, 1, 1, 0),
    },
    "allocated_bytes": {
        "all": _grown(LARGE_BYTES + SMALL_BYTES),
        "large_pool": _grown(LARGE_BYTES),
        "small_pool": _grown(SMALL_BYTES),
    },
    "active_bytes": {
        "all": _grown(LARGE_BYTES + SMALL_BYTES),
        "large_pool": _grown(LARGE_BYTES),
        "small_pool": _grown(SMALL_BYTES),
    },
    "requested_bytes": {
        "all": _grown(LARGE_REQUESTED + SMALL_REQUESTED),
        "large_pool": _grown(LARGE_REQUESTED),
        "small_pool": _grown(SMALL_REQUESTED),
    },
    "reserved_bytes": {
        "all": _grown(LARGE_RESERVED + SMALL_RESERVED),
        "large_pool": _grown(LARGE_RESERVED),
        "small_pool": _grown(SMALL_RESERVED),
    },
    "inactive_split_bytes": {
        "all": stat(12 * MiB + SMALL_INACTIVE, 16 * MiB, 16 * MiB + SMALL_INACTIVE, 4 * MiB),
        "large_pool": stat(12 * MiB, 16 * MiB, 16 * MiB, 4 * MiB),
        "small_pool": stat(SMALL_INACTIVE, SMALL_INACTIVE, SMALL_INACTIVE, 0),
    },
    "oversize_allocations": stat(0, 0, 0, 0),
    "oversize_segments": stat(0, 0, 0, 0),
    "max_split_size": -1,
    "num_alloc_retries": 0,
    "num_device_alloc": 3,
    "num_device_free": 0,
    "num_ooms": 0,
    "num_sync_all_streams": 0,
})

# Copied verbatim from spec §17.
EXPECTED_EXAMPLE = """\
|===========================================================================|
|                  PyTorch CUDA memory summary, device ID 0                 |
|---------------------------------------------------------------------------|
|            CUDA OOMs: 0            |        cudaMalloc retries: 0         |
|===========================================================================|
|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |
|---------------------------------------------------------------------------|
| Allocated memory      |  24577 KiB |  24577 KiB |  24577 KiB |      0 B   |
|       from large pool |  24576 KiB |  24576 KiB |  24576 KiB |      0 B   |
|       from small pool |      1 KiB |      1 KiB |      1 KiB |      0 B   |
|---------------------------------------------------------------------------|
| Active memory         |  24577 KiB |  24577 KiB |  24577 KiB |      0 B   |
|       from large pool |  24576 KiB |  24576 KiB |  24576 KiB |      0 B   |
|       from small pool |      1 KiB |      1 KiB |      1 KiB |      0 B   |
|---------------------------------------------------------------------------|
| Requested memory      |  23552 KiB |  23552 KiB |  23552 KiB |      0 B   |
|       from large pool |  23552 KiB |  23552 KiB |  23552 KiB |      0 B   |
|       from small pool |      0 KiB |      0 KiB |      0 KiB |      0 B   |
|---------------------------------------------------------------------------|
| GPU reserved memory   |  38912 KiB |  38912 KiB |  38912 KiB |      0 B   |
|       from large pool |  36864 KiB |  36864 KiB |  36864 KiB |      0 B   |
|       from small pool |   2048 KiB |   2048 KiB |   2048 KiB |      0 B   |
|---------------------------------------------------------------------------|
| Non-releasable memory |  14335 KiB |  16384 KiB |  18431 KiB |   4096 KiB |
|       from large pool |  12288 KiB |  16384 KiB |  16384 KiB |   4096 KiB |
|       from small pool |   2047 KiB |   2047 KiB |   2047 KiB |      0 KiB |
|---------------------------------------------------------------------------|
| Allocations           |       4    |       4    |       4    |       0    |
|       from large pool |       3    |       3    |       3    |       0    |
|       from small pool |       1    |       1    |       1    |       0    |
|---------------------------------------------------------------------------|
| Active allocs         |       4    |       4    |       4    |       0    |
|       from large pool |       3    |       3    |       3    |       0    |
|       from small pool |       1    |       1    |       1    |       0    |
|---------------------------------------------------------------------------|
| GPU reserved segments |       3    |       3    |       3    |       0    |
|       from large pool |       2    |       2    |       2    |       0    |
|       from small pool |       1    |       1    |       1    |       0    |
|---------------------------------------------------------------------------|
| Non-releasable allocs |       2    |       2    |       2    |       0    |
|       from large pool |       1    |       1    |       1    |       0    |
|       from small pool |       1    |       1    |       1    |       0    |
|---------------------------------------------------------------------------|
| Oversize allocations  |       0    |       0    |       0    |       0    |
|---------------------------------------------------------------------------|
| Oversize GPU segments |       0    |       0    |       0    |       0    |
|===========================================================================|
"""


def test_example_stats_has_the_122_keys() -> None:
    assert list(EXAMPLE_STATS) == all_stat_keys()
    assert len(EXAMPLE_STATS) == 122


def test_worked_example_of_spec_17() -> None:
    assert memory_summary_from_stats(EXAMPLE_STATS, device=0) == EXPECTED_EXAMPLE


def test_worked_example_abbreviated_drops_pool_rows() -> None:
    expected = "".join(line for line in EXPECTED_EXAMPLE.splitlines(keepends=True) if "from " not in line)
    assert memory_summary_from_stats(EXAMPLE_STATS, abbreviated=True) == expected


def test_defaults_are_device_0_not_abbreviated() -> None:
    assert memory_summary_from_stats(EXAMPLE_STATS) == EXPECTED_EXAMPLE


def test_device_is_left_justified_in_17() -> None:
    text = memory_summary_from_stats(EXAMPLE_STATS, device=12)
    title = text.splitlines()[1]
    assert title == "|                  PyTorch CUDA memory summary, device ID 12                |"
    wide = memory_summary_from_stats(EXAMPLE_STATS, device=10**20).splitlines()[1]
    assert wide.endswith("device ID 100000000000000000000 |")


def test_every_line_is_77_characters_when_values_fit() -> None:
    for abbreviated in (False, True):
        text = memory_summary_from_stats(EXAMPLE_STATS, device=3, abbreviated=abbreviated)
        assert text.endswith("|\n")
        lines = text.splitlines()
        assert len(lines) == (47 if not abbreviated else 29)
        assert all(len(line) == 77 and line[0] == line[-1] == "|" for line in lines)


def test_header_counters() -> None:
    stats = dict(EXAMPLE_STATS, num_ooms=5, num_alloc_retries=12345678)
    line = memory_summary_from_stats(stats).splitlines()[3]
    assert line == "|            CUDA OOMs: 5            |        cudaMalloc retries: 12345678  |"


def test_stats_keys_named_like_format_fields_override_them() -> None:
    """PyTorch formats the header from {"_": "", "device": device} updated with every stat."""
    stats = dict(EXAMPLE_STATS, device=99, _=7)
    lines = memory_summary_from_stats(stats, device=0).splitlines()
    # an int "_" is right-aligned in its width (16 in the title, 9 and 6 in the counters line)
    assert lines[1] == "|                7 PyTorch CUDA memory summary, device ID 99                |"
    assert lines[3] == "|          7 CUDA OOMs: 0            |      7 cudaMalloc retries: 0         |"
    # a dotted key reaches the format dict with "-" instead of ".", so "x.y" cannot clash
    assert memory_summary_from_stats(dict(EXAMPLE_STATS, **{"de.vice": 5})) == EXPECTED_EXAMPLE


def test_missing_stat_raises_key_error() -> None:
    stats = dict(EXAMPLE_STATS)
    del stats["segment.small_pool.freed"]
    with pytest.raises(KeyError, match="segment.small_pool.freed"):
        memory_summary_from_stats(stats)
    stats = dict(EXAMPLE_STATS)
    del stats["num_ooms"]
    with pytest.raises(KeyError, match="num_ooms"):
        memory_summary_from_stats(stats)
    # small-pool rows are not read when abbreviated
    stats = dict(EXAMPLE_STATS)
    del stats["segment.small_pool.freed"]
    memory_summary_from_stats(stats, abbreviated=True)


# --------------------------------------------------------------------------------------------
# Formatters
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "ref", "expected"),
    [
        (0, 0, "     0 B  "),
        (1000, 1000, "  1000 B  "),
        (768 * KiB - 1, 768 * KiB - 1, "786431 B  "),
        (768 * KiB, 768 * KiB, "   768 KiB"),
        (20 * MiB, 20 * MiB, " 20480 KiB"),
        (768 * MiB - 1, 768 * MiB - 1, "786431 KiB"),
        (768 * MiB, 768 * MiB, "   768 MiB"),
        (GiB, GiB, "  1024 MiB"),
        (768 * GiB, 768 * GiB, "   768 GiB"),
        (768 * 1024 * GiB, 768 * 1024 * GiB, "   768 TiB"),
        (768 * 1024**2 * GiB, 768 * 1024**2 * GiB, "   768 PiB"),
        (768 * 1024**3 * GiB, 768 * 1024**3 * GiB, "786432 PiB"),  # no unit past PiB
        (1000, 4 * MiB, "     0 KiB"),  # sub-row floored in the all row's unit
        (0, 4 * MiB, "     0 KiB"),
        (5 * GiB, 1, "5368709120 B  "),  # the reference, not the value, picks the unit
        (-1, MiB, "    -1 KiB"),  # floor division
    ],
)
def test_format_summary_size(value: int, ref: int, expected: str) -> None:
    assert format_summary_size(value, ref) == expected


@pytest.mark.parametrize(
    ("value", "ref", "expected"),
    [
        (0, 0, "      0   "),
        (749_999, 749_999, " 749999   "),
        (750_000, 750_000, "    750 K "),
        (749_999_999, 749_999_999, " 749999 K "),
        (750_000_000, 750_000_000, "    750 M "),
        (750_000_000_000, 750_000_000_000, " 750000 M "),  # no unit past M
        (999, 750_000, "      0 K "),
        (-1, 750_000, "     -1 K "),
    ],
)
def test_format_summary_count(value: int, ref: int, expected: str) -> None:
    assert format_summary_count(value, ref) == expected


def test_size_reference_rounds_like_a_float_above_2_53() -> None:
    """The reference is true-divided, so it becomes a rounded float as in PyTorch."""
    threshold_pib = 768 * 1024**5
    just_below = threshold_pib - 1
    # exact arithmetic would stay in TiB; the float quotient rounds up onto the boundary
    assert format_summary_size(just_below, just_below) == "   767 PiB"


# --------------------------------------------------------------------------------------------
# Byte-for-byte agreement with torch.cuda.memory.memory_summary
# --------------------------------------------------------------------------------------------


@contextmanager
def torch_fed_with(stats: Mapping[str, int]) -> Iterator[Any]:
    """Make ``torch.cuda.memory.memory_summary`` format ``stats`` without a GPU.

    It resolves the device with ``_get_device_index(device, optional=True)`` (an int is
    returned as is; patched anyway so no CUDA query can happen) and then reads
    ``memory_stats(device=device)``; both are module globals of torch.cuda.memory.
    """
    torch = pytest.importorskip("torch")
    memory = torch.cuda.memory

    def fake_device_index(device: Any, optional: bool = False, allow_cpu: bool = False) -> int:
        assert isinstance(device, int)
        return device

    def fake_memory_stats(device: Any = None) -> dict[str, int]:
        return dict(stats)

    with mock.patch.object(memory, "_get_device_index", fake_device_index), \
            mock.patch.object(memory, "memory_stats", fake_memory_stats):
        yield memory


def torch_summary(stats: Mapping[str, int], device: int, abbreviated: bool) -> str:
    with torch_fed_with(stats) as memory:
        text = memory.memory_summary(device=device, abbreviated=abbreviated)
    assert isinstance(text, str)
    return text


def _boundaries() -> list[int]:
    """Every unit promotion boundary (±1) of both formatters, plus powers and extremes."""
    points = {0, 1, 2**50}
    for k in range(6):
        points.update({768 * 1024**k, 1024**k, 750 * 1000**k, 1000**k})
    return sorted(p + d for p in points for d in (-1, 0, 1) if p + d >= 0)


BOUNDARIES = _boundaries()
VALUES = st.one_of(st.sampled_from(BOUNDARIES), st.integers(0, 2**50))
WIDE_VALUES = st.one_of(VALUES, st.integers(-(2**63), 2**63 - 1))
DEVICES = st.one_of(
    st.integers(0, 16),
    st.sampled_from([10**16 - 1, 10**16, 10**17 - 1, 10**17, 10**18, 2**63 - 1, 2**64, 10**40]),
    st.integers(0, 2**128),
)


def stats_dicts(values: st.SearchStrategy[int]) -> st.SearchStrategy[dict[str, int]]:
    return st.fixed_dictionaries({key: values for key in all_stat_keys()})


def test_torch_matches_worked_example() -> None:
    pytest.importorskip("torch")
    for device in (0, 1, 7, 10**18):
        for abbreviated in (False, True):
            ours = memory_summary_from_stats(EXAMPLE_STATS, device=device, abbreviated=abbreviated)
            assert ours == torch_summary(EXAMPLE_STATS, device, abbreviated)
    assert torch_summary(EXAMPLE_STATS, 0, False) == EXPECTED_EXAMPLE


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stats=stats_dicts(VALUES), device=DEVICES, abbreviated=st.booleans())
@example(stats=dict.fromkeys(all_stat_keys(), 0), device=0, abbreviated=False)
@example(stats=dict.fromkeys(all_stat_keys(), 2**50), device=10**40, abbreviated=True)
def test_torch_matches_random_stats(stats: dict[str, int], device: int, abbreviated: bool) -> None:
    pytest.importorskip("torch")
    ours = memory_summary_from_stats(stats, device=device, abbreviated=abbreviated)
    assert ours == torch_summary(stats, device, abbreviated)


@pytest.mark.parametrize("value", BOUNDARIES)
@pytest.mark.parametrize("abbreviated", [False, True])
def test_torch_matches_at_every_boundary(value: int, abbreviated: bool) -> None:
    """All stats equal to one boundary value: each column's reference sits on it."""
    pytest.importorskip("torch")
    stats = dict.fromkeys(all_stat_keys(), value)
    # sub-rows one either side of the reference, so floor division shows up
    for key in stats:
        if ".large_pool." in key:
            stats[key] = value + 1
        elif ".small_pool." in key:
            stats[key] = max(value - 1, 0)
    ours = memory_summary_from_stats(stats, device=value % 17, abbreviated=abbreviated)
    assert ours == torch_summary(stats, value % 17, abbreviated)


@settings(max_examples=150, deadline=None)
@given(stats=stats_dicts(WIDE_VALUES), device=st.integers(-(2**70), 2**70), abbreviated=st.booleans())
@example(stats=dict.fromkeys(all_stat_keys(), 768 * 1024**5 - 1), device=0, abbreviated=False)
@example(stats=dict.fromkeys(all_stat_keys(), 750 * 1000**2 - 1), device=-1, abbreviated=False)
def test_torch_matches_full_int64_range(stats: dict[str, int], device: int, abbreviated: bool) -> None:
    """Negative and > 2**53 values too (float rounding of the reference, floor division)."""
    pytest.importorskip("torch")
    ours = memory_summary_from_stats(stats, device=device, abbreviated=abbreviated)
    assert ours == torch_summary(stats, device, abbreviated)


@settings(max_examples=100, deadline=None)
@given(
    stats=stats_dicts(VALUES),
    extra=st.dictionaries(
        st.sampled_from(["_", "device", "num-ooms", "device.x", "zz.top", "num_ooms"]),
        st.integers(-(2**40), 2**40),
    ),
    device=DEVICES,
)
def test_torch_matches_with_keys_colliding_with_format_fields(
    stats: dict[str, int], extra: dict[str, int], device: int
) -> None:
    """A stat named ``_`` or ``device`` overrides PyTorch's own format fields; so does ours."""
    pytest.importorskip("torch")
    stats.update(extra)
    ours = memory_summary_from_stats(stats, device=device)
    assert ours == torch_summary(stats, device, False)


def test_torch_and_ours_fail_alike_on_missing_keys() -> None:
    pytest.importorskip("torch")
    for missing in ("segment.small_pool.freed", "oversize_segments.peak", "num_ooms", "num_alloc_retries"):
        stats = dict(EXAMPLE_STATS)
        del stats[missing]
        with pytest.raises(KeyError) as theirs:
            torch_summary(stats, 0, False)
        with pytest.raises(KeyError) as ours:
            memory_summary_from_stats(stats)
        assert ours.value.args == theirs.value.args
