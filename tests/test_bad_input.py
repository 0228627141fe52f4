"""Bad input to the API: a clear error naming the problem, PyTorch's where it has
one, and the allocator's state exactly as it was."""
from __future__ import annotations

import os
import sys

import pytest

import vram
from vram import CachingAllocator, SimulatedDevice
from vram.allocator.config import ConfigError, parse_alloc_conf
from vram.devices import DriverError
from vram.devices.simulated import VA_BOTTOM, VA_TOP

sys.path.insert(0, os.path.dirname(__file__))
from invariants import check_invariants  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture(autouse=True)
def _fresh():
    vram.simulate("16GiB")
    yield
    vram.simulate()


@pytest.mark.parametrize("conf", [5, 1.5, b"expandable_segments:True", ["max_split_size_mb:128"]])
def test_config_that_is_not_a_string_names_the_argument(conf):
    with pytest.raises(TypeError, match=r"^allocator settings must be a string .* got "):
        parse_alloc_conf(conf)
    with pytest.raises(TypeError, match="allocator settings must be a string"):
        CachingAllocator(SimulatedDevice("1GiB"), conf)
    x = vram.empty(MiB)
    with pytest.raises(TypeError, match="allocator settings must be a string"):
        vram.simulate("8GiB", alloc_conf=conf)
    assert vram.memory_allocated() == 4 * MiB  # the running simulation was not replaced
    del x


@pytest.mark.parametrize("text", [
    "x" * 1_000_000 + ":1",                       # an unknown key
    "expandable_segments:" + "T" * 1_000_000,     # a bad boolean
    "max_split_size_mb:" + "9" * 1_000_000,       # a number out of range
    "roundup_power2_divisions:[" + "a" * 1_000_000 + ":4]",  # a bad list item
])
def test_config_error_does_not_echo_a_huge_token(text):
    with pytest.raises(ConfigError) as info:
        parse_alloc_conf(text)
    message = str(info.value)
    assert len(message) < 300
    assert "1,000,0" in message  # says how long the token was


def test_short_tokens_are_still_quoted_whole_as_pytorch_does():
    with pytest.raises(ConfigError, match=r"^Unrecognized key 'foo' in CUDA allocator config\.$"):
        parse_alloc_conf("foo:1")
    token = "y" * 64
    with pytest.raises(ConfigError, match=f"'{token}'"):
        parse_alloc_conf(f"{token}:1")


@pytest.mark.parametrize("stream", [2**63, 2**64, 2**200, -1])
def test_stream_handles_outside_int64_are_refused(stream):
    a = vram.get_allocator(0)
    x = vram.empty(MiB)
    before = a.memory_stats()
    with pytest.raises(ValueError, match=r"stream must be a stream handle in \[0, 2\*\*63\)"):
        a.malloc(1024, stream)
    with pytest.raises(ValueError, match="stream handle"):
        a.record_stream(x.data_ptr(), stream)
    with pytest.raises(ValueError, match="stream handle"):
        vram.caching_allocator_alloc(1024, stream=stream)
    assert a.memory_stats() == before
    check_invariants(a)
    del x


def test_largest_int64_stream_handle_is_accepted():
    a = vram.get_allocator(0)
    p = a.malloc(1024, 2**63 - 1)
    assert a.active[p].stream == 2**63 - 1
    a.free(p)


def test_huge_stream_value_is_not_formatted_in_full():
    with pytest.raises(ValueError, match=r"got an int of 56148 bits$"):
        vram.get_allocator(0).malloc(1024, 7**20000)


def _reservation_bytes(total: int, page: int) -> int:
    """One expandable segment's reservation: ceil((total + total/8) / page) pages (PyTorch's
    ``ExpandableSegment`` constructor: ``numSegments(totalGlobalMem + totalGlobalMem / 8)``)."""
    return -(-(total + total // 8) // page) * page


def test_expandable_segments_on_hundreds_of_streams():
    """Every stream has its own expandable segment per pool, each reserving 1 1/8 of the card.
    CUDA's address space (the 47-bit user half, 128 TiB, shared with the host) holds about a
    thousand such reservations for an 80 GiB card; vram failed at the 92nd stream."""
    total = 80 * GiB
    vram.simulate(total, alloc_conf="expandable_segments:True")
    a = vram.get_allocator(0)
    keep = []
    for _ in range(300):  # 600 reservations, 54 TiB of address space
        s = vram.Stream()
        keep.append(vram.empty(1024, stream=s))      # small pool
        keep.append(vram.empty(4 * MiB, stream=s))   # large pool
    assert len(a.expandable_segments) == 600
    assert vram.memory_reserved() == 300 * (2 * MiB + 20 * MiB)
    check_invariants(a)


def test_address_space_exhaustion_fails_as_pytorch_does_and_changes_nothing():
    """When cuMemAddressReserve has no range left, PyTorch's C10_CUDA_DRIVER_CHECK raises
    ``RuntimeError: CUDA driver error: out of memory``; the allocator's state is unchanged."""
    total = 3 * 1024 * GiB  # a 3 TiB card: each reservation is 3.375 TiB (large pool)
    vram.simulate(total, alloc_conf="expandable_segments:True")
    a = vram.get_allocator(0)
    window = VA_TOP - VA_BOTTOM
    per_stream = _reservation_bytes(total, 2 * MiB) + _reservation_bytes(total, 20 * MiB)
    fits = window // per_stream  # streams whose two reservations fit (reservations are 2 MiB aligned)
    assert fits >= 10  # the old 8 TiB window failed in the second pool of the first stream
    keep = []
    for _ in range(fits):
        s = vram.Stream()
        keep.append(vram.empty(1024, stream=s))
        keep.append(vram.empty(4 * MiB, stream=s))
    before = None
    with pytest.raises(RuntimeError, match=r"^CUDA driver error: out of memory$") as info:
        for _ in range(4):  # at most one more 3.375 TiB reservation fits in what is left
            before = (a.memory_stats(), list(a.expandable_segments), vram.mem_get_info())
            keep.append(vram.empty(4 * MiB, stream=vram.Stream()))
    assert isinstance(info.value, DriverError)
    assert not isinstance(info.value, vram.OutOfMemoryError)  # not an OOM: no retry, no OOM text
    assert before is not None
    assert (a.memory_stats(), list(a.expandable_segments), vram.mem_get_info()) == before
    check_invariants(a)
    keep.clear()
    vram.empty_cache()
    assert vram.memory_reserved() == 0 and not a.expandable_segments


def test_cuda_malloc_async_backend_is_refused_not_simulated_as_native() -> None:
    """vram is PyTorch's native allocator; the async backend's reservations are CUDA's."""
    with pytest.raises(ConfigError, match=r"^backend:cudaMallocAsync is not simulated"):
        CachingAllocator(SimulatedDevice("1GiB"), "backend:cudaMallocAsync")
    x = vram.empty(MiB)
    with pytest.raises(ConfigError, match="not simulated"):
        vram.simulate("8GiB", alloc_conf="backend:cudaMallocAsync")
    a = CachingAllocator(SimulatedDevice("1GiB"), "backend:native")
    with pytest.raises(ConfigError):  # PyTorch's own rule: the backend cannot change at runtime
        a.set_allocator_settings("backend:cudaMallocAsync")
    assert a.config.backend == "native" and vram.memory_allocated() == 4 * MiB
    del x
