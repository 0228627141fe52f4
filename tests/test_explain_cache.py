"""``vram explain``'s ``empty_cache()`` points: every point where the cache
(reserved - allocated) is at a local maximum is a candidate, each replayed through the recording.

The recordings are made with vram's allocator (history on) and written as
``torch.cuda.memory._snapshot()`` writes them; what works is derived from the allocator's rules
(spec §5 sizes, §7 best fit from the cache, §9 the OOM retry returns only whole free segments).
"""
from __future__ import annotations

import pickle
from pathlib import Path

from vram import CachingAllocator, SimulatedDevice
from vram.allocator.history import ALL
from vram.analysis import explain as explain_mod
from vram.analysis.explain import EMPTY_CACHE_REPLAYS, cache_peaks, explain
from vram.replay.engine import replay
from vram.replay.loader import load_snapshot
from vram.views.snapshot import snapshot

MiB = 1 << 20


def split_cache_recording(path: Path) -> int:
    """On a 1 GiB card (no OOM there): 20 x 1 MiB small tensors, all freed and made again; a 60 MiB
    tensor freed; 10 MiB carved from its cached segment (split, §7); then 70 MiB. Returns the
    index of the event after the 60 MiB tensor's free."""
    a = CachingAllocator(SimulatedDevice("1GiB"), "")
    a.history.configure(True, ALL, 100000, True)
    pad = [a.malloc(MiB) for _ in range(20)]
    for p in pad:
        a.free(p)                       # allocated 0 here: the old rule's favourite point
    pad = [a.malloc(MiB) for _ in range(20)]
    a.free(a.malloc(60 * MiB))          # the cache holds one whole free 60 MiB segment
    a.malloc(10 * MiB)                  # ... now split: the OOM retry cannot return it
    a.malloc(70 * MiB)
    path.write_bytes(pickle.dumps(snapshot([a])))
    trace = [e for e in snapshot([a])["device_traces"][0]]
    return max(i for i, e in enumerate(trace) if e["action"] == "free_completed" and e["size"] == 60 * MiB) + 1


def old_points(allocated: list[int], end: int, windows: int = 6) -> list[int]:
    """The rule explain used before: the lowest allocated in each of 6 windows before the moment."""
    step = max(1, end // windows)
    pts = [min(range(lo, min(end, lo + step)), key=lambda j: (allocated[j], j)) + 1 for lo in range(0, end, step)]
    return sorted({p for p in pts if p < end})


def test_the_one_working_point_is_found_and_was_not_among_the_old_six(tmp_path):
    path = tmp_path / "split.pickle"
    point = split_cache_recording(path)
    # On 110 MiB: 20 MiB small + 60 MiB + 70 MiB = 150 > 110: the 70 MiB request fails (the 60 MiB
    # segment holds 10 MiB live). With empty_cache() after the 60 MiB free: 20 + 10 + 70 = 100 fits.
    ex = explain(str(path), gpu="110MiB", workers=1).to_json()
    assert ex["at"]["kind"] == "oom" and ex["at"]["size"] == 70 * MiB
    cache = [f for f in ex["fixes"] if f["kind"] == "empty_cache"]
    assert [f["event_index"] for f in cache] == [point]
    assert cache[0]["verified"] is True and cache[0]["peak_reserved"] == 100 * MiB
    # ... checked by a replay of our own, and by the rule of old, which missed it
    snap = load_snapshot(path.read_bytes())
    assert replay(snap, gpu="110MiB", empty_cache_at=(point,)).ooms == 0
    assert replay(snap, gpu="110MiB", empty_cache_at=(point - 2,)).ooms == 1   # before the free: too early
    assert replay(snap, gpu="110MiB", empty_cache_at=(point + 1,)).ooms == 1   # after the split: too late
    end = ex["at"]["event_index"]
    allocated = replay(snap, gpu="110MiB", timeline=True, stop_at=end).timeline[0]
    assert point not in old_points(list(allocated), end)


def test_cache_peaks_are_the_ends_of_growing_runs_and_bounded():
    allocated = [10, 5, 5, 8, 3, 3, 9, 9]
    reserved = [10] * 8
    # cache 0 5 5 2 7 7 1 1: peaks end at events 2 (plateau, once) and 5 -> points 3 and 6
    assert cache_peaks(allocated, reserved, 8, 10) == [3, 6]
    assert cache_peaks(allocated, reserved, 8, 1) == [6]          # the largest first
    assert cache_peaks(allocated, reserved, 5, 10) == [3]         # (a point at the moment itself is not one)


def test_the_replay_bound_is_in_the_help(capsys):
    from vram.cli.commands import main
    try:
        main(["explain", "--help"])
    except SystemExit:
        pass
    assert f"the {EMPTY_CACHE_REPLAYS} largest: at most {EMPTY_CACHE_REPLAYS} replays" in capsys.readouterr().out
    assert explain_mod.EMPTY_CACHE_REPLAYS == EMPTY_CACHE_REPLAYS
