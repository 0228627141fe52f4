"""The torch.cuda-shaped front end and buffers: the classic experiments, with numbers derived
from the spec's rules (rounding §4, segment sizes §6, split §8, empty_cache §11.1)."""
from __future__ import annotations

import threading

import pytest

import vram

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture(autouse=True)
def fresh_gpu():
    vram.simulate()
    yield


def test_default_gpu_is_80_gib_without_simulate():
    assert vram.device_count() == 1
    assert vram.get_device().total_memory == 80 * GiB
    assert vram.mem_get_info() == (80 * GiB, 80 * GiB)


def test_rebinding_a_name_keeps_at_most_two_blocks():
    vram.simulate(total_memory="6GiB")
    for _ in range(6):
        x = vram.empty(GiB // 4)  # noqa: F841 - the old x dies only after the new one exists
        assert vram.memory_allocated() <= 2 * GiB
    assert vram.max_memory_allocated() == 2 * GiB
    assert vram.memory_reserved() == 2 * GiB  # two 1 GiB segments, alternately reused


def test_six_distinct_names_oom_on_a_small_gpu():
    vram.simulate(total_memory="6GiB", context="446MiB")
    names = []
    with pytest.raises(vram.OutOfMemoryError) as exc:
        for _ in range(6):
            names.append(vram.empty(GiB // 4))
    # 5 GiB reserved + 446 MiB context leave 578 MiB: the sixth 1 GiB segment cannot fit.
    assert len(names) == 5
    assert str(exc.value).startswith(
        "CUDA out of memory. Tried to allocate 1024.00 MiB. GPU 0 has a total capacity of 6.00 GiB "
        "of which 578.00 MiB is free. Of the allocated memory 5.00 GiB is allocated by PyTorch, and "
        "0 bytes is reserved by PyTorch but unallocated.")
    assert isinstance(exc.value, RuntimeError)
    stats = vram.memory_stats()
    assert stats["num_ooms"] == 1 and stats["num_alloc_retries"] == 1


def test_alias_keeps_memory_alive_and_empty_cache_returns_whole_segments():
    x = vram.empty((256, 1024, 1024))  # 1 GiB
    y = x
    del x
    assert vram.memory_allocated() == GiB
    del y
    assert vram.memory_allocated() == 0
    assert vram.memory_reserved() == GiB
    vram.empty_cache()
    assert vram.memory_reserved() == 0


def test_views_share_storage():
    x = vram.empty((4, 1024), dtype="float16")
    row = x[1]
    assert row.data_ptr() == x.data_ptr() + 1024 * 2
    assert x.view(-1).shape == (4096,)
    assert x[1:3].shape == (2, 1024) and x[1:3].data_ptr() == row.data_ptr()
    del x
    assert vram.memory_allocated() == 8192  # the view keeps the storage alive
    del row
    assert vram.memory_allocated() == 0


def test_empty_cache_cannot_release_a_partly_used_segment():
    a = vram.empty(MiB)  # 4 MiB of float32: a 20 MiB segment, split
    b = vram.empty(MiB)
    del a
    vram.empty_cache()
    assert vram.memory_reserved() == 20 * MiB
    assert vram.memory_stats()["inactive_split_bytes.all.current"] == 16 * MiB  # 4 MiB hole + 12 MiB tail
    del b
    vram.empty_cache()
    assert vram.memory_reserved() == 0


@pytest.mark.parametrize("name,size", [
    ("float32", 4), ("float16", 2), ("bfloat16", 2), ("float64", 8), ("int64", 8), ("int32", 4),
    ("int8", 1), ("uint8", 1), ("bool", 1), ("torch.float16", 2), ("half", 2)])
def test_dtypes(name, size):
    t = vram.empty((3, 5), dtype=name)
    assert t.element_size() == size and t.nbytes == 15 * size
    assert vram.memory_stats()["requested_bytes.all.current"] == 15 * size


def test_size_argument_forms():
    assert vram.empty(2, 3).shape == (2, 3)
    assert vram.empty((2, 3), "float16").dtype is vram.float16
    assert vram.empty([4]).nbytes == 16
    assert vram.empty(0).data_ptr() == 0
    # torch.empty's own errors (torch 2.13: the texts below are what it raises on any device)
    with pytest.raises(RuntimeError, match=r"^Trying to create tensor with negative dimension -1: \[-1\]$"):
        vram.empty(-1)
    with pytest.raises(RuntimeError, match=r"negative dimension -3: \[2, -3\]$"):
        vram.empty((2, -3))
    with pytest.raises(TypeError, match=r"^empty\(\): argument 'size' \(position 1\) must be tuple of ints, not bool$"):
        vram.empty(True)
    with pytest.raises(TypeError, match=r"\(position 1\) must be tuple of ints, not float$"):
        vram.empty(1.5)
    for args in ((2, 1.5), ((2, 1.5),)):
        with pytest.raises(TypeError, match=r"failed to unpack the object at pos 2 with error "
                                            r"\"type must be tuple of ints,but got float\"$"):
            vram.empty(*args)
    with pytest.raises(TypeError, match=r"at pos 1 with error \"Overflow when unpacking long long\"$"):
        vram.empty(2**70)
    assert vram.empty((2, True)).shape == (2, 1)  # torch accepts a bool inside the size tuple
    assert vram.memory_allocated() == 0  # nothing was allocated by the refused calls


def test_size_argument_errors_match_torch():
    """The same calls on torch's meta device raise the same exception types and texts."""
    torch = pytest.importorskip("torch")
    for args in ((-1,), ((2, -3),), (True,), (1.5,), (2, 1.5), ((2, 1.5),), (2**70,)):
        with pytest.raises(Exception) as ours:
            vram.empty(*args)
        with pytest.raises(Exception) as theirs:
            torch.empty(*args, device="meta")
        assert type(ours.value) is type(theirs.value), args
        theirs_text = str(theirs.value)
        if "\n" in theirs_text:  # torch appends the C++ stack after a newline inside the quotes
            assert str(ours.value).startswith(theirs_text.splitlines()[0]), args
        else:
            assert str(ours.value) == theirs_text, args


def test_mem_get_info_counts_context_other_processes_and_reserved():
    vram.simulate(total_memory="24GiB", context="500MiB", other_processes="1GiB")
    x = vram.empty(3 * MiB // 4)  # 3 MiB -> a 20 MiB segment
    free, total = vram.mem_get_info()
    assert total == 24 * GiB
    assert free == 24 * GiB - 500 * MiB - GiB - 20 * MiB
    del x


def test_memory_stats_keys_like_torch_2_13():
    stats = vram.memory_stats()
    assert len(stats) == 123  # 108 array + 8 oversize + max_split_size + 6 counters
    assert list(stats) == sorted(stats)
    assert stats["max_split_size"] == -1
    nested = vram.memory_stats_as_nested_dict()
    assert nested["allocated_bytes"]["all"] == {"current": 0, "peak": 0, "allocated": 0, "freed": 0}


def test_peak_and_accumulated_resets():
    x = vram.empty(MiB)
    del x
    assert vram.max_memory_allocated() == 4 * MiB
    vram.reset_peak_memory_stats()
    assert vram.max_memory_allocated() == 0
    assert vram.max_memory_reserved() == 20 * MiB  # peak = current, the segment is still cached
    vram.reset_accumulated_memory_stats()
    stats = vram.memory_stats()
    assert stats["allocated_bytes.all.allocated"] == 0 and stats["num_device_alloc"] == 0
    assert stats["reserved_bytes.all.current"] == 20 * MiB


def test_fraction_validation_matches_torch():
    with pytest.raises(TypeError, match="Invalid type for fraction argument, must be `float`"):
        vram.set_per_process_memory_fraction(1)
    with pytest.raises(ValueError, match=r"Invalid fraction value: 1.5. Allowed range: 0~1"):
        vram.set_per_process_memory_fraction(1.5)
    vram.set_per_process_memory_fraction(0.5)
    assert vram.get_per_process_memory_fraction() == 0.5


def test_caching_allocator_alloc_and_delete():
    p = vram.caching_allocator_alloc(1000)
    assert vram.memory_allocated() == 1024
    vram.caching_allocator_delete(p)
    assert vram.memory_allocated() == 0
    with pytest.raises(RuntimeError, match=f"invalid device pointer: {p:#x}"):
        vram.caching_allocator_delete(p)  # double free
    with pytest.raises(TypeError, match="Invalid type for stream argument"):
        vram.caching_allocator_alloc(10, stream="s")


def test_bad_input_leaves_state_unchanged():
    keep = vram.empty(1000)
    before = dict(vram.memory_stats())
    for bad in (lambda: vram.caching_allocator_alloc(-5), lambda: vram.caching_allocator_alloc(1.5),
                lambda: vram.caching_allocator_delete(0xDEAD000),
                lambda: vram.memory._set_allocator_settings("max_split_size_mb:1"),
                lambda: vram.set_per_process_memory_fraction(-0.1)):
        with pytest.raises((ValueError, TypeError, RuntimeError)):
            bad()
        assert dict(vram.memory_stats()) == before
    with pytest.raises(vram.OutOfMemoryError, match="Tried to allocate more than 1EB memory"):
        vram.caching_allocator_alloc(1 << 60)
    assert dict(vram.memory_stats()) == before
    del keep


def test_record_stream_delays_reuse_until_events_complete():
    vram.simulate(event_completion="on_sync")
    side = vram.Stream()
    x = vram.empty(MiB)  # 4 MiB on the default stream
    x.record_stream(side)
    del x
    stats = vram.memory_stats()
    assert stats["allocated_bytes.all.current"] == 0 and stats["active_bytes.all.current"] == 4 * MiB
    y = vram.empty(MiB)  # the pending block cannot be reused: carved from the rest of the segment
    assert vram.memory_stats()["active_bytes.all.current"] == 8 * MiB
    side.synchronize()
    z = vram.empty(1)  # next malloc processes the completed event
    assert vram.memory_stats()["active_bytes.all.current"] == 4 * MiB + 512
    del y, z


def test_streams_do_not_share_cached_blocks():
    s = vram.Stream()
    with vram.stream(s):
        x = vram.empty(MiB)
        assert vram.current_stream() == s
    del x
    vram.empty(MiB)  # default stream: cannot take the block cached for s -> a new segment
    assert vram.memory_reserved() == 40 * MiB


def test_multiple_devices_and_device_strings():
    vram.simulate(total_memory="1GiB", device_count=2)
    x = vram.empty(MiB, device="cuda:1")
    assert vram.memory_allocated(1) == 4 * MiB and vram.memory_allocated(0) == 0
    assert x.device == "cuda:1"
    with pytest.raises(ValueError):
        vram.memory_allocated("cuda:2")
    p0 = vram.caching_allocator_alloc(512, device=0)
    assert p0 != x.data_ptr()
    vram.caching_allocator_delete(p0)


def test_threads_share_one_allocator_safely():
    vram.simulate(total_memory="4GiB")
    errors = []

    def work(seed: int) -> None:
        try:
            for i in range(300):
                t = vram.empty(((seed * 7919 + i * 104729) % (3 * MiB)) + 1, dtype="uint8")
                del t
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert vram.memory_allocated() == 0
    vram.empty_cache()
    assert vram.memory_reserved() == 0


def test_tensor_collected_by_gc_inside_malloc_is_freed_after_it(monkeypatch):
    """Python's cyclic GC can run inside malloc (any Python allocation) and finalize a tensor:
    the re-entrant free must wait until malloc is done, not mutate the pools half-way."""
    import gc

    import vram.allocator.caching as allocator_module

    a = vram.empty(MiB)  # 4 MiB at the front of a 20 MiB segment: [a][free 16 MiB]
    cycle: list = [a]
    cycle.append(cycle)
    del a, cycle  # only the cycle keeps it alive now

    class GCBlock(allocator_module.Block):
        __slots__ = ()

        def __init__(self, *args):
            super().__init__(*args)
            gc.collect()  # finalizes `a`: its free would merge with the block being split

    # best fit takes the free 16 MiB block out of the pool, then builds the front piece
    monkeypatch.setattr(allocator_module, "Block", GCBlock)
    b = vram.empty(MiB // 2)  # 2 MiB
    monkeypatch.undo()
    assert vram.memory_allocated() == 2 * MiB  # `a` was freed, once malloc was done
    stats = vram.memory_stats()
    # [free 4 MiB (a)][b 2 MiB][free 14 MiB]: two inactive split blocks
    assert stats["inactive_split.all.current"] == 2
    assert stats["inactive_split_bytes.all.current"] == 18 * MiB
    del b
    assert vram.memory_stats()["inactive_split.all.current"] == 0
