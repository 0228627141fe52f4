"""Snapshots and history (spec §18): structure, trace semantics, and that PyTorch's own
torch.cuda._memory_viz opens what we dump."""
from __future__ import annotations

import pickle

import pytest

import vram

MiB = 1 << 20

PLAIN = (dict, list, tuple, str, int, float, bool, type(None))


def assert_plain(obj, path="snapshot"):
    assert type(obj) in PLAIN, f"{path} is {type(obj).__name__}"
    if isinstance(obj, dict):
        for k, v in obj.items():
            assert type(k) in (str, int), f"{path} key {k!r}"
            assert_plain(v, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            assert_plain(v, f"{path}[{i}]")


@pytest.fixture(autouse=True)
def fresh_gpu():
    vram.simulate()
    yield
    vram.memory._record_memory_history(None)


def example_3_state():
    """Spec §20 Example 3 plus a 1000 B tensor, kept alive (the §17 summary state)."""
    return [vram.caching_allocator_alloc(n) for n in (4 * MiB, 4 * MiB, 15 * MiB, 1000)]


def test_segments_and_blocks_of_example_3():
    keep = example_3_state()
    segs = vram.memory_snapshot()
    assert [s["total_size"] for s in sorted(segs, key=lambda s: s["total_size"])] == \
        [2 * MiB, 16 * MiB, 20 * MiB]
    by_size = {s["total_size"]: s for s in segs}
    twenty = by_size[20 * MiB]
    assert [(b["size"], b["state"]) for b in twenty["blocks"]] == [
        (4 * MiB, "active_allocated"), (4 * MiB, "active_allocated"), (12 * MiB, "inactive")]
    assert twenty["allocated_size"] == twenty["active_size"] == twenty["requested_size"] == 8 * MiB
    assert twenty["segment_type"] == "large" and by_size[2 * MiB]["segment_type"] == "small"
    small = by_size[2 * MiB]["blocks"]
    assert (small[0]["size"], small[0]["requested_size"]) == (1024, 1000)
    assert small[1]["requested_size"] == 0  # remainder of a fresh segment (spec §8)
    for s in segs:
        assert s["address"] % (2 * MiB) == 0
        addr = s["address"]
        for b in s["blocks"]:
            assert b["address"] == addr
            addr += b["size"]
    assert [s["address"] for s in segs] == sorted(s["address"] for s in segs)
    assert_plain(segs)
    for p in keep:
        vram.caching_allocator_delete(p)


def test_trace_order_and_sizes():
    vram.memory._record_memory_history()
    p = vram.caching_allocator_alloc(4)
    vram.caching_allocator_delete(p)
    vram.empty_cache()
    trace = vram.memory._snapshot()["device_traces"][0]
    assert [(e["action"], e["size"]) for e in trace] == [
        ("segment_alloc", 2 * MiB), ("alloc", 4), ("free_requested", 4), ("free_completed", 4),
        ("segment_free", 2 * MiB)]
    assert trace[0]["addr"] == trace[1]["addr"] == trace[4]["addr"] == p
    assert all(e["stream"] == 0 and isinstance(e["time_us"], int) for e in trace)
    assert all(e["frames"][0]["name"] == "test_trace_order_and_sizes" for e in trace)


def test_snapshot_entry_shows_in_the_next_snapshot():
    vram.memory._record_memory_history()
    keep = vram.caching_allocator_alloc(3000)
    first = vram.memory._snapshot()["device_traces"][0]
    assert [e["action"] for e in first] == ["segment_alloc", "alloc"]
    second = vram.memory._snapshot()["device_traces"][0]
    assert second[-1]["action"] == "snapshot"
    assert (second[-1]["addr"], second[-1]["size"]) == (0, 3072)
    vram.caching_allocator_delete(keep)


def test_context_levels():
    vram.memory._record_memory_history(context="state")
    keep = vram.caching_allocator_alloc(1000)
    snap = vram.memory._snapshot()
    assert all("frames" not in e for e in snap["device_traces"][0])
    block = snap["segments"][0]["blocks"][0]
    assert block["frames"][0]["name"] == "test_context_levels"
    assert snap["segments"][0]["frames"][0]["name"] == "test_context_levels"
    vram.memory._record_memory_history(None)
    assert vram.memory._snapshot()["device_traces"] == [[]]
    vram.caching_allocator_delete(keep)


def test_max_entries_ring_buffer_and_state_mode():
    vram.memory._record_memory_history(max_entries=3)
    for _ in range(5):
        vram.caching_allocator_delete(vram.caching_allocator_alloc(600))
    trace = vram.memory._snapshot()["device_traces"][0]
    assert [e["action"] for e in trace] == ["free_completed", "alloc", "free_requested", "free_completed"][-3:]
    vram.memory._record_memory_history(enabled="state")
    vram.caching_allocator_delete(vram.caching_allocator_alloc(600))
    assert len(vram.memory._snapshot()["device_traces"][0]) == 1


def test_bad_history_arguments():
    with pytest.raises(RuntimeError, match="expected state to be 'state', 'all', or None"):
        vram.memory._record_memory_history(enabled="yes")
    with pytest.raises(RuntimeError, match="expected context to be 'state', 'alloc', 'all', or None"):
        vram.memory._record_memory_history(context="x")
    with pytest.raises(RuntimeError, match="expected stacks to be 'python', or 'all'"):
        vram.memory._record_memory_history(stacks="cpp")


def test_oom_trace_entry_has_device_free_and_rounded_size():
    vram.simulate(total_memory="64MiB")
    vram.memory._record_memory_history()
    with pytest.raises(vram.OutOfMemoryError):
        vram.caching_allocator_alloc(100 * MiB + 1)
    oom = vram.memory._snapshot()["device_traces"][0][-1]
    assert oom["action"] == "oom"
    assert oom["device_free"] == 64 * MiB and oom["size"] == 100 * MiB + 512
    assert "addr" not in oom


def test_expandable_segment_is_one_entry_per_mapped_run():
    vram.simulate(alloc_conf="expandable_segments:True")
    a = vram.caching_allocator_alloc(3 * MiB)
    b = vram.caching_allocator_alloc(30 * MiB)
    segs = vram.memory_snapshot()
    assert len(segs) == 1 and segs[0]["is_expandable"] is True
    assert segs[0]["total_size"] == 40 * MiB
    assert [blk["size"] for blk in segs[0]["blocks"]] == [3 * MiB, 30 * MiB, 7 * MiB]
    vram.caching_allocator_delete(a)
    vram.caching_allocator_delete(b)


def test_pending_free_state():
    vram.simulate(event_completion="on_sync")
    s = vram.Stream()
    x = vram.empty(MiB)
    x.record_stream(s)
    del x
    states = [b["state"] for seg in vram.memory_snapshot() for b in seg["blocks"]]
    assert states == ["active_pending_free", "inactive"]


def test_allocator_settings_in_snapshot():
    vram.simulate(alloc_conf="max_split_size_mb:200,roundup_power2_divisions:4")
    settings = vram.memory._snapshot()["allocator_settings"]
    assert settings["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:200,roundup_power2_divisions:4"
    assert settings["max_split_size"] == 200 * MiB
    assert settings["roundup_power2_divisions"]["1"] == 4 and len(settings["roundup_power2_divisions"]) == 16
    assert vram.memory_stats()["max_split_size"] == 200 * MiB


def test_dump_opens_in_pytorch_memory_viz(tmp_path):
    mv = pytest.importorskip("torch.cuda._memory_viz")
    vram.memory._record_memory_history()
    keep = example_3_state()
    tmp = vram.empty(5 * MiB)
    del tmp
    vram.memory._dump_snapshot(str(tmp_path / "snap.pickle"))
    with open(tmp_path / "snap.pickle", "rb") as f:
        data = pickle.load(f)
    assert_plain(data)
    assert set(data) == {"segments", "device_traces", "allocator_settings", "external_annotations"}
    summary = mv.segsum(data)
    # Segments: 20 MiB (4+4 MiB), 16 MiB (15 MiB), 2 MiB (1000 B), 20 MiB (the freed 20 MiB tensor).
    assert "segments: 4" in summary
    assert "total_reserved: 58.0MiB" in summary
    assert "total_allocated: 23.0MiB" in summary
    text = mv.trace(data)
    assert "= cudaMalloc(" in text and "del " in text and "free completed" in text
    assert "<html" in mv.trace_plot(data).lower()
    assert "<html" in mv.segment_plot(data).lower()
    for p in keep:
        vram.caching_allocator_delete(p)
