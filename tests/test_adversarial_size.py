"""Adversarial-size snapshots: the cases that were quadratic (seconds to minutes)
replay to the right results, checked against a direct computation. Their speed is measured by
benchmarks/bench_adversarial.py (full sizes, old code vs new), not here: the machines that run
the tests are shared and noisy, so a timed test would measure the neighbours.
"""
from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path
from typing import Any

import pytest

from vram.cli.commands import main
from vram.replay import loop
from vram.replay.engine import replay
from vram.replay.loader import load_snapshot
from vram.replay.rewind import TraceError

sys.path.insert(0, os.path.dirname(__file__))
from hostile_files import BASE, MiB, entry, segment, snap  # noqa: E402


def _largest_free_by_scan(alloc: Any) -> int:
    return max((b.size for pool in (alloc.small_blocks, alloc.large_blocks) for b in pool.blocks.values()),
               default=0)


@pytest.mark.parametrize("streams", [1, 3])
def test_reserved_peaks_with_a_growing_free_list_stay_linear(streams: int) -> None:
    """Each 10 MiB + 1 B request gets a 12 MiB segment and leaves a 2 MiB - 512 B free tail
    (spec §6, §8) that no later request fits: every allocation is a new reserved peak. The
    largest free block at the peak used to be a scan of every free block at every peak."""
    n = 25_000
    trace = [entry(addr=0x10000000000 + k * 16 * MiB, size=10 * MiB + 1, t=k, stream=k % streams)
             for k in range(n)]
    loaded = load_snapshot(snap(trace=trace))
    r = replay(loaded)
    assert r.reserved_peak_event == n - 1 and r.peak_reserved == n * 12 * MiB
    assert r.largest_free_block_at_reserved_peak == 2 * MiB - 512 == _largest_free_by_scan(r.allocator)


def test_largest_free_block_with_very_many_streams_is_exact(monkeypatch: Any) -> None:
    """Past a budget of streams visited, the value is taken from a second replay up to the peak."""
    trace = []
    for k in range(300):
        a = 0x10000000000 + k * 32 * MiB
        trace += [entry(addr=a, size=MiB + 1 + k * 512, t=3 * k, stream=k + 1),
                  entry("free_requested", a, MiB + 1, 3 * k + 1, stream=k + 1),
                  entry("free_completed", a, MiB + 1, 3 * k + 2, stream=k + 1)]
    trace.append(entry(addr=0x20000000000, size=MiB + 1, t=10_000, stream=9))
    loaded = load_snapshot(snap(trace=trace))
    full = replay(loaded, stop_at=len(trace) - 1)
    expected = _largest_free_by_scan(full.allocator)
    assert replay(loaded).largest_free_block_at_reserved_peak == expected == 20 * MiB
    calls: list[int] = []
    real = loop.largest_free

    def small_budget(alloc: Any, budget: int | None = None) -> tuple[int, int]:
        calls.append(1)
        return real(alloc, None if budget is None else min(budget, 10))

    monkeypatch.setattr(loop, "largest_free", small_budget)
    r = replay(loaded)
    assert r.largest_free_block_at_reserved_peak == expected and r.reserved_peak_event == len(trace) - 4


def test_rewinding_many_created_segments_stays_linear() -> None:
    """100k segments with segment_alloc events made rewind's list.remove quadratic (123 s)."""
    n = 20_000
    base = 0x10000000000
    segs = [segment(base + k * 32 * MiB, [(20 * MiB, "inactive", 0)]) for k in range(n)]
    trace = [entry("segment_alloc", base + k * 32 * MiB, 20 * MiB, k) for k in range(n)]
    loaded = load_snapshot(snap(segs, trace))
    r = replay(loaded, verify=True)
    assert r.final_reserved == 0 and r.verification is not None
    assert r.verification["final_segments"] == {"matched": 0, "total": n}  # nothing allocates them


def test_rewind_refuses_overlapping_restored_segments() -> None:
    seg = segment(BASE, [(20 * MiB, "inactive", 0)])
    trace = [entry("segment_free", BASE + 2 * MiB, 20 * MiB, 0)]
    with pytest.raises(TraceError, match=r"device_traces\[0\]\[0\] \(segment_free at 0x7f0000200000\): the "
                                         r"freed segment \(20971520 bytes\) overlaps another one"):
        replay(load_snapshot(snap([seg], trace)))


def test_shared_stacks_are_never_copied_per_block() -> None:
    """PyTorch shares frame lists between blocks; copying one per block (import, rewind,
    snapshot) was quadratic: 10k blocks x a 10k-frame stack took seconds and gigabytes."""
    stack = [{"filename": "model.py", "line": 1, "name": "forward"}] * 5_000
    segs = []
    for k in range(5_000):
        s = segment(BASE + k * 2 * MiB, [(MiB, "active_allocated", MiB), (MiB, "inactive", 0)])
        s["blocks"][0]["frames"] = stack
        segs.append(s)
    loaded = load_snapshot(snap(segs))
    r = replay(loaded, verify=True)
    assert r.verification is not None and r.verification["final_blocks"]["matched"] == 10_000


def _pending_trace(order: list[int], n: int) -> list[dict[str, Any]]:
    """n allocations, n frees held back (requested now, completed in `order`), n more allocations."""
    trace = [entry(addr=BASE + k * 1024, size=1000, t=k) for k in range(n)]
    trace += [entry("free_requested", BASE + k * 1024, 1000, n + k) for k in range(n)]
    trace += [entry(addr=BASE + (n + k) * 1024, size=1000, t=2 * n + k) for k in range(n)]
    trace += [entry("free_completed", BASE + k * 1024, 1000, 3 * n + j) for j, k in enumerate(order)]
    return trace


def test_held_back_frees_complete_when_recorded(monkeypatch: Any) -> None:
    """A free whose free_completed comes later is held back with an event (spec §10.1) and
    completes exactly at its recorded free_completed, whatever the order; ids of pseudo streams
    are reused only once free (they used to be len(pending): a live one could be reused)."""
    n = 40
    order = [3, 1, 0, 2] + list(range(4, n))[::-1]
    loaded = load_snapshot(snap(trace=_pending_trace(order, n)))
    for stop in range(3 * n, 4 * n + 1):
        r = replay(loaded, stop_at=stop)
        freed = order[:stop - 3 * n]
        stats = r.allocator.memory_stats()
        assert stats["active.all.current"] == 2 * n - len(freed), stop
        assert stats["allocation.all.current"] == n
        assert all(not r.allocator.active.get(BASE + k * 1024) for k in freed)
    # A, B held back; A completes; C held back; B completes: C must still wait for its own.
    trace = [entry(addr=BASE + k * 512, size=512, t=k) for k in range(3)]
    trace += [entry("free_requested", BASE, 512, 3), entry("free_requested", BASE + 512, 512, 4),
              entry("free_completed", BASE, 512, 5), entry("free_requested", BASE + 1024, 512, 6),
              entry("free_completed", BASE + 512, 512, 7), entry("free_completed", BASE + 1024, 512, 8)]
    loaded = load_snapshot(snap(trace=trace))
    assert replay(loaded, stop_at=8).allocator.memory_stats()["active.all.current"] == 1
    assert replay(loaded).allocator.memory_stats()["active.all.current"] == 0


def test_many_held_back_frees_stay_linear() -> None:
    n = 6_000
    loaded = load_snapshot(snap(trace=_pending_trace(list(range(n))[::-1], n)))
    r = replay(loaded, verify=True)
    assert r.allocator is not None and r.allocator.memory_stats()["active.all.current"] == n
    assert r.verification is not None
    assert r.verification["notes"] == [f"event {n + 64}: more than 64 frees held back at once share "
                                       "pseudo streams: some may complete late"]


def test_cycle_fingerprints_stay_within_budget(monkeypatch: Any) -> None:
    """Addresses can be chosen so that every allocation is an anchor; fingerprints (each the
    size of the state) must then stop, or a replay becomes quadratic."""
    from vram.replay.cycles import CycleSkipper

    monkeypatch.setattr(CycleSkipper, "is_anchor", lambda self, ev: True)
    monkeypatch.setattr(CycleSkipper, "WORK_BASE", 1000)
    n = 6_000
    loaded = load_snapshot(snap(trace=[entry(addr=BASE + k * 512, size=512, t=k) for k in range(n)]))
    r = replay(loaded)
    assert r.final_allocated == n * 512


def test_export_never_expands_shared_structure(tmp_path: Path, capsys: Any) -> None:
    one = [entry(t=t, addr=BASE + t * 512) for t in range(1000)]
    path = tmp_path / "shared.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [one] * 1000}))
    assert main(["export", str(path), "-o", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err
    assert err == f"vram: error: {path}: device_traces[1] is the same object as device_traces[0] " \
                  "(shared references refused: PyTorch writes a new one each time)\n"
    stack = [{"filename": "f.py", "line": 1, "name": "g"}] * 20_000
    trace = [dict(entry(t=t, addr=BASE + t * 512), frames=stack) for t in range(600)]
    path.write_bytes(snap(trace=trace))
    assert main(["export", str(path), "-o", str(tmp_path / "o.json")]) == 2
    assert "its JSON form would spell out 12,000,000 stack frames" in capsys.readouterr().err
    assert main(["export", str(path), "-o", str(tmp_path / "o.pickle")]) == 0
    assert (tmp_path / "o.pickle").stat().st_size < 2 * path.stat().st_size



@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "max_split_size_mb:40,roundup_power2_divisions:4",
                                  "garbage_collection_threshold:0.6,per_process_memory_fraction:0.5"])
def test_every_state_vrams_allocator_reaches_passes_the_checks(conf: str) -> None:
    """The invariants are the allocator's own: whatever a long random workload leaves behind
    (splits, merges, oversize blocks, pending frees on other streams, expandable runs, OOM
    retries) loads without a complaint, and replays to the same final state."""
    import random

    from vram.allocator.caching import CachingAllocator
    from vram.allocator.errors import OutOfMemoryError
    from vram.devices.simulated import SimulatedDevice
    from vram.views.snapshot import snapshot

    rng = random.Random(11)
    dev = SimulatedDevice("4GiB", event_completion="on_sync")
    alloc = CachingAllocator(dev, conf)
    live: list[int] = []
    for step in range(3000):
        if live and rng.random() < 0.45:
            p = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.1:
                alloc.record_stream(p, 7)
            alloc.free(p)
        else:
            n = rng.choice([rng.randint(1, 4096), rng.randint(1, 3 * MiB), rng.randint(MiB, 90 * MiB)])
            try:
                live.append(alloc.malloc(n, rng.choice([0, 0, 0, 5])))
            except OutOfMemoryError:
                pass
        if step % 500 == 250:
            dev.synchronize()
            alloc.process_events()
        if step == 2000:
            alloc.empty_cache()
    assert alloc.stats.num_alloc_retries > 0
    dev.synchronize()
    alloc.process_events()
    settled = load_snapshot(pickle.dumps(snapshot([alloc])))
    for p in live[:20]:  # frees still waiting for another stream (spec §10.1)
        alloc.record_stream(p, 7)
        alloc.free(p)
    loaded = load_snapshot(pickle.dumps(snapshot([alloc])))
    assert loaded["warnings"] == [] and len(loaded["segments"]) > 10
    states = {b["state"] for s in loaded["segments"] for b in s["blocks"]}
    assert states == {"active_allocated", "active_pending_free", "inactive"}
    assert any(s["is_expandable"] for s in loaded["segments"]) == ("expandable" in conf)
    if "expandable" not in conf:  # rewinding expandable segments is not supported yet
        v = replay(settled, verify=True, gpu="4GiB").verification
        assert v is not None and v["final_blocks"]["matched"] == v["final_blocks"]["total"] > 10


def _lines_run(fn: Any) -> int:
    """How many lines of vram's own code `fn()` executes: a measure of work that no load on the
    machine changes (loops inside C builtins such as ``bisect`` count as one line)."""
    count = 0
    src = str(Path(__file__).resolve().parents[1] / "src")

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        if not frame.f_code.co_filename.startswith(src):
            return None
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def _oom_trace(n: int) -> dict[str, Any]:
    """A 1 GiB tensor, then `n` recorded OOMs of 8 GiB requests (a script retrying in a loop)."""
    big = 8 << 30
    trace = [entry(addr=BASE, size=1 << 30, t=0)]
    trace += [entry("oom", 0, big, k + 1, device_free=512 * MiB) for k in range(n)]
    for e in trace[1:]:
        del e["addr"]
    return load_snapshot(snap(trace=trace))


def test_recorded_ooms_with_expandable_segments_stay_linear() -> None:
    """With expandable segments, each request larger than any reserved range reserves a new one
    (``find_expandable_block``; it is never given back while unmapped), so every OOM of a run of
    them left one more range behind: searching those ranges for room and finding the range
    holding an address walked all of them, each time (a 720 KB trace of 20,000 OOMs took
    ``vram explain`` past 300 s). Same results; the work per OOM no longer grows with their number."""
    small, large = _oom_trace(100), _oom_trace(400)
    results = []

    def run(loaded: dict[str, Any]) -> None:
        results.append(replay(loaded, gpu="4GiB", conf="expandable_segments:True"))

    work = [_lines_run(lambda: run(small)), _lines_run(lambda: run(large))]
    r = results[-1]
    assert r.ooms == 400 and r.peak_reserved == 52 * 20 * MiB  # 1 GiB in whole 20 MiB pages (spec §14)
    # PyTorch's: each OOM reserves two ranges, for the first try and for the one after emptying the cache
    assert len(r.allocator.expandable_segments) == 1 + 2 * 400
    assert work[1] < 5 * work[0], work  # 4x the OOMs; quadratic work was ~14x


def test_reserved_ranges_answer_as_a_walk_over_all_of_them() -> None:
    """`ReservedRanges.holding` / `first_inside` (binary searches) against the walks they replace."""
    import random

    from vram.devices.simulated import ReservedRanges

    rng = random.Random(5)
    ranges = ReservedRanges()
    for _ in range(300):
        base = rng.randrange(0, 1 << 20) * 4096
        if rng.random() < 0.3 and ranges:
            del ranges[rng.choice(list(ranges))]
        elif not any(b <= base < b + s for b, s in ranges.items()):
            above = min((b for b in ranges if b > base), default=base + (1 << 32))
            ranges[base] = rng.randrange(1, min(above - base, 1 << 24) + 1)
        for _ in range(5):
            ptr, size = rng.randrange(0, 1 << 33), rng.randrange(1, 1 << 22)
            want = max((b for b, s in ranges.items() if b <= ptr and ptr + size <= b + s), default=None)
            assert ranges.holding(ptr, size) == want
            lo, hi = ptr, ptr + rng.randrange(1, 1 << 30)
            assert ranges.first_inside(lo, hi) == min((b for b in ranges if lo < b < hi), default=None)
