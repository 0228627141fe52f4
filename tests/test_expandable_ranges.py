"""Where expandable segments' reserved ranges lie, and what that decides.

``find_expandable_block`` (CUDACachingAllocator.cpp) walks a pool's unmapped blocks in address
order and takes the first with room; a request larger than every range's room reserves a new
range (1 1/8 of ``totalGlobalMem``), which is never given back while unmapped. So where the
driver puts a new range decides which range later requests grow. On an H200 (driver 580, CUDA
13.0; ``../shared/gpu-truth/h200-2026-11-27``, ``expandable_pressure``) a process's three ranges
were reserved at 0x302000000, 0x2a56000000 and 0x51a8000000: ascending, each at the first 32 MiB
boundary after the one before (ranges of 168,883,650,560 and 168,875,261,952 bytes: 8,053 pages of
20 MiB, 80,527 of 2 MiB, for 1 1/8 of 150,110,011,392).
"""
from __future__ import annotations

from typing import Any

from hostile_files import entry, segment, snap
from vram.allocator.caching import CachingAllocator
from vram.devices.simulated import SimulatedDevice
from vram.replay.engine import replay
from vram.replay.loader import load_snapshot

MiB, GiB = 1 << 20, 1 << 30
H200 = 150_110_011_392
PAGE = 20 * MiB


def test_the_driver_places_each_reserved_range_above_the_one_before() -> None:
    """The H200's three ranges, in the order it reserved them (large pool, then two small)."""
    dev = SimulatedDevice(H200)
    bases = [dev.reserve(168_883_650_560), dev.reserve(168_875_261_952), dev.reserve(168_875_261_952)]
    assert [b - bases[0] for b in bases] == [0, 0x2A56000000 - 0x302000000, 0x51A8000000 - 0x302000000]
    assert bases[0] % (32 * MiB) == 0


def test_after_an_oom_too_large_for_any_range_requests_grow_the_old_range() -> None:
    """A request larger than 1 1/8 of the card reserves two ranges (the first try, and the try
    after the cache is emptied: ``malloc``'s retry) and fails. The new ranges lie above the old
    one, so the next request maps the old range's tail, right after what it already holds."""
    dev = SimulatedDevice("8GiB", 0)
    alloc = CachingAllocator(dev, "expandable_segments:True")
    a = alloc.malloc(100 * PAGE, 0)
    try:
        alloc.malloc(20 * GiB, 0)
    except Exception as e:  # noqa: BLE001 - the simulator's OutOfMemoryError
        assert "out of memory" in str(e).lower()
    else:
        raise AssertionError("20 GiB fit an 8 GiB card")
    assert len(alloc.expandable_segments) == 3
    assert alloc.malloc(PAGE, 0) == a + 100 * PAGE


def _real_8gib_recording() -> dict[str, Any]:
    """What an 8 GiB card (500 MiB of context) records for this, by CUDACachingAllocator.cpp:
    A (300 pages) mapped at the range's base B; x (one page) after it; A freed and its pages
    unmapped (``empty_cache``); a 10 GiB request finds no room (the hole before x holds 300 pages,
    the tail after it 461 - 301 = 160: the range is 1 1/8 of 8 GiB, 461 pages) and reserves R1
    (at B + 461 pages rounded up to 32 MiB) and R2 above it, fails to map and is an OOM with
    8 GiB - 500 MiB - x free; then 7 GiB (359 pages) finds no room in the first range either and
    maps the start of R1, the lowest range with room."""
    base = 0x302000000
    r1 = base + -(-461 * PAGE // (32 * MiB)) * 32 * MiB
    size_a, size_y = 300 * PAGE, 7 * GiB
    oom = entry("oom", 0, 10 * GiB, 6, device_free=8 * GiB - 500 * MiB - PAGE)
    del oom["addr"]
    trace = [entry("segment_map", base, size_a, 0), entry("alloc", base, size_a, 1),
             entry("segment_map", base + size_a, PAGE, 2), entry("alloc", base + size_a, PAGE, 3),
             entry("free_requested", base, size_a, 4), entry("free_completed", base, size_a, 4),
             entry("segment_unmap", base, size_a, 5), oom,
             entry("segment_map", r1, 359 * PAGE, 7), entry("alloc", r1, size_y, 7)]
    final = [segment(base + size_a, [(PAGE, "active_allocated", PAGE)], is_expandable=True),
             segment(r1, [(size_y, "active_allocated", size_y), (359 * PAGE - size_y, "inactive", 0)],
                     is_expandable=True)]
    settings = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "expandable_segments": True}
    return load_snapshot(snap(final, trace, allocator_settings=settings))


def test_a_recording_that_grew_a_range_reserved_by_an_oom_verifies() -> None:
    """The card's size is not in the recording: the OOM's free memory plus what the process held
    then (8 GiB - 500 MiB) is the least it had, and sizes the replay's ranges, so the 10 GiB
    request reserves new ranges there too and the 7 GiB one lands at R1's recorded address."""
    v = replay(_real_8gib_recording(), verify=True).verification
    assert v is not None
    for k in ("segment_maps", "segment_unmaps", "alloc_addresses", "recorded_ooms", "final_segments", "final_blocks"):
        assert v[k]["matched"] == v[k]["total"] > 0, (k, v[k], v["divergences"][:1])
