"""Recorded OOMs and several devices in replay; vram explain / tune; export --from/--to.

Synthetic recordings are made with vram's own torch.cuda-shaped API; the expected figures are
worked by hand from the allocator's rules (spec §7 best fit, §8 split, §9 the retry chain that
returns unsplit cached segments before an OOM, §15 the message), not read off our output.
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

import vram
import vram.memory as m
from vram.analysis.explain import explain
from vram.analysis.tune import tune
from vram.cli.commands import main
from vram.replay.engine import replay
from vram.replay.loader import load_snapshot

MiB = 1 << 20
from paths import RECORDINGS as TRACES  # noqa: E402


def _fragmented_oom(path: Path) -> str:
    """100 MiB GPU: a 60 MiB tensor freed, 30 MiB reuses (splits) its segment, 50 MiB fails.
    Returns the live OOM message."""
    vram.simulate(total_memory=100 * MiB)
    m._record_memory_history()
    a = vram.empty(60 * MiB, dtype="uint8")
    del a
    b = vram.empty(30 * MiB, dtype="uint8")  # noqa: F841  (kept alive)
    with pytest.raises(vram.OutOfMemoryError) as info:
        vram.empty(50 * MiB, dtype="uint8")
    m._dump_snapshot(str(path))
    return str(info.value)


def _too_big(path: Path) -> str:
    """1 GiB GPU, 100 MiB context: 4 x 100 MiB live, then 600 MiB fails; the program frees one
    and goes on. Returns the live OOM message."""
    vram.simulate(total_memory="1GiB", context="100MiB")
    m._record_memory_history()
    keep = [vram.empty(100 * MiB, dtype="uint8") for _ in range(4)]
    with pytest.raises(vram.OutOfMemoryError) as info:
        vram.empty(600 * MiB, dtype="uint8")
    del keep[0]
    after = vram.empty(60 * MiB, dtype="uint8")  # noqa: F841
    m._dump_snapshot(str(path))
    return str(info.value)


def test_recorded_oom_replays_at_the_same_event_with_the_same_message(tmp_path):
    live = _too_big(tmp_path / "oom.pickle")
    snap = load_snapshot(tmp_path / "oom.pickle")
    trace = snap["device_traces"][0]
    k = next(i for i, e in enumerate(trace) if e["action"] == "oom")
    # on the recorded card (total given), every figure of the message is the recording's
    r = replay(snap, gpu="1GiB", context="100MiB", verify=True)
    assert r.oom["event_index"] == k and r.oom["message"] == live
    assert r.verification["recorded_ooms"] == {"matched": 1, "total": 1}
    assert r.verification["divergences"] == []
    # ... and it went on: 4 allocations before it, and the 60 MiB one after it (in the freed block)
    assert r.verification["alloc_addresses"]["matched"] == r.verification["alloc_addresses"]["total"] == 5
    # without the card: the capacity is the smallest consistent one, 400 MiB reserved + 524 MiB free
    r = replay(snap)
    assert r.ooms == 1 and r.oom["event_index"] == k
    assert "total capacity of 924.00 MiB of which 524.00 MiB is free" in r.oom["message"]
    assert r.oom["device_free"] == 524 * MiB and r.oom["reserved"] == 400 * MiB
    # a what-if on a larger card: the request succeeds
    assert replay(snap, gpu="2GiB").ooms == 0


def test_every_device_is_replayed_and_verified(tmp_path, capsys):
    vram.simulate(total_memory="1GiB", device_count=2)
    m._record_memory_history()
    x = vram.empty(10 * MiB, dtype="uint8", device="cuda:0")  # noqa: F841
    y = vram.empty(30 * MiB, dtype="uint8", device="cuda:1")
    z = vram.empty(3 * MiB, dtype="uint8", device="cuda:1")  # noqa: F841
    del y
    m._dump_snapshot(str(tmp_path / "two.pickle"))
    assert main(["replay", str(tmp_path / "two.pickle"), "--verify", "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [r["device"] for r in runs] == [0, 1]
    # device 1: a 30 MiB segment, and 3 MiB in a new 20 MiB one (1-10 MiB requests: §5)
    assert runs[0]["peak_reserved"] == 10 * MiB and runs[1]["peak_reserved"] == 50 * MiB
    for r in runs:
        for key in ("segment_allocs", "alloc_addresses", "final_segments", "final_blocks"):
            assert r[key]["matched"] == r[key]["total"] > 0
    assert main(["replay", str(tmp_path / "two.pickle"), "--device", "2"]) == 2
    assert "device 2 is not in the snapshot" in capsys.readouterr().err


def test_explain_fragmentation(tmp_path):
    _fragmented_oom(tmp_path / "frag.pickle")
    ex = explain(str(tmp_path / "frag.pickle"), workers=1).to_json()
    assert ex["at"]["kind"] == "oom" and ex["at"]["size"] == 50 * MiB
    # 60 MiB segment holding b (30 MiB): 30 MiB reserved but free, and that is the largest block
    assert ex["reserved"] == 60 * MiB and ex["reserved_unallocated"] == 30 * MiB
    assert ex["largest_free_block"] == 30 * MiB
    assert ex["gpu"] == 100 * MiB  # reserved 60 + 40 free at the OOM
    assert [(c["bytes"], c["blocks"]) for c in ex["top_consumers"]] == [(30 * MiB, 1)]  # b alone
    assert "test_analysis.py" in ex["top_consumers"][0]["frame"]
    fixes = {f["change"]: f for f in ex["fixes"]}
    # expandable segments: b's 30 MiB stay mapped, 20 MiB more pages after them fit (80 <= 100)
    assert fixes["PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"]["verified"] is True
    # empty_cache() after `del a` returns the 60 MiB segment: 30 + 50 MiB in two segments fit
    cache = [f for f in ex["fixes"] if f["kind"] == "empty_cache"]
    assert cache and cache[0]["verified"] and cache[0]["peak_reserved"] == 80 * MiB
    # on the recorded config the 50 MiB segment needs 60 + 50 = 110 MiB: 10 MiB more
    gpu = [f for f in ex["fixes"] if f["kind"] == "gpu"]
    assert gpu and gpu[0]["more"] == 10 * MiB and gpu[0]["verified"]
    assert not [f for f in ex["fixes"] if f["kind"] == "does_not_fit"]  # 30 + 50 live < 100


def test_explain_does_not_fit(tmp_path, capsys):
    _too_big(tmp_path / "oom.pickle")
    assert main(["explain", str(tmp_path / "oom.pickle"), "--json", "--jobs", "1"]) == 0
    ex = json.loads(capsys.readouterr().out)
    for key in ("top_consumers", "reserved_unallocated", "largest_free_block", "fixes"):
        assert key in ex
    assert ex["top_consumers"][0]["bytes"] == 400 * MiB and ex["reserved_unallocated"] == 0
    # 400 MiB live + 600 MiB asked = 1000 MiB, against 400 reserved + 524 free = 924 MiB
    nofit = [f for f in ex["fixes"] if f["kind"] == "does_not_fit"]
    assert nofit and nofit[0]["more"] == 76 * MiB
    assert not [f for f in ex["fixes"] if f["kind"] == "config" and f["verified"]]
    assert [f["more"] for f in ex["fixes"] if f["kind"] == "gpu"] == [76 * MiB]


def test_tune_best_replays_to_its_peak(tmp_path, capsys):
    _fragmented_oom(tmp_path / "frag.pickle")
    assert main(["tune", str(tmp_path / "frag.pickle"), "--json", "--jobs", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    best = out["best"]
    # 30 + 50 MiB are live at once: no config reserves less than 80 MiB; expandable reaches it
    assert best["oom"] is False and best["peak_reserved"] == 80 * MiB
    default = next(r for r in out["results"] if r["conf"] == "")
    assert default["oom"] is True
    snap = load_snapshot(tmp_path / "frag.pickle")
    assert replay(snap, conf=best["conf"], gpu=100 * MiB).peak_reserved == best["peak_reserved"]
    ranks = [(r["oom"], r["peak_reserved"]) for r in out["results"]]
    assert ranks == sorted(ranks)


def test_tune_fleet_parallel_equals_serial(tmp_path):
    _fragmented_oom(tmp_path / "a.pickle")
    _too_big(tmp_path / "b.pickle")
    paths = [str(tmp_path / "a.pickle"), str(tmp_path / "b.pickle")]
    serial = tune(paths, gpu="1GiB", workers=1).to_json()
    parallel = tune(paths, gpu="1GiB", workers=2).to_json()
    assert serial == parallel
    assert not serial["best"]["oom"]  # both fit in 1 GiB with no context


def test_export_piece_verifies_and_opens_in_memory_viz(tmp_path, capsys):
    src = TRACES / "ftcourse-memory-snapshot.pickle"
    out = tmp_path / "piece.pickle"
    assert main(["export", str(src), "-o", str(out), "--from", "2000", "--to", "6000"]) == 0
    piece = load_snapshot(out)
    assert len(piece["device_traces"][0]) == 4000
    assert piece["device_traces"][0] == load_snapshot(src)["device_traces"][0][2000:6000]
    v = replay(piece, verify=True).verification
    for key in ("segment_allocs", "alloc_addresses", "final_segments", "final_blocks"):
        assert v[key]["matched"] == v[key]["total"] > 0
    mv = pytest.importorskip("torch.cuda._memory_viz")
    assert "<html" in mv.trace_plot(pickle.loads(out.read_bytes())).lower()
    assert main(["export", str(src), "-o", str(out), "--from", "10", "--to", "5"]) == 2
    assert "--from must not come after --to" in capsys.readouterr().err
    assert main(["export", str(src), "-o", str(out), "--from", "2s"]) == 2  # no time_us in this file
    assert "no event times" in capsys.readouterr().err


def test_export_by_time(tmp_path):
    _too_big(tmp_path / "oom.pickle")
    snap = load_snapshot(tmp_path / "oom.pickle")
    trace = snap["device_traces"][0]
    from vram.replay.cut import event_index

    t0 = trace[0]["time_us"]
    k = next(i for i, e in enumerate(trace) if e["time_us"] > t0)
    us = trace[k]["time_us"] - t0
    assert event_index(trace, f"{us}us", "--from") == k
    assert event_index(trace, "0s", "--from") == 0


def test_explain_says_expandable_segments_was_already_on(tmp_path):
    """PyTorch's OOM message advises ``expandable_segments:True`` whatever the config
    (CUDACachingAllocator.cpp); explain says when the recording already had it on."""
    vram.simulate(total_memory="1GiB", context="100MiB", alloc_conf="expandable_segments:True")
    m._record_memory_history()
    keep = [vram.empty(100 * MiB, dtype="uint8") for _ in range(4)]  # noqa: F841
    with pytest.raises(vram.OutOfMemoryError) as info:
        vram.empty(600 * MiB, dtype="uint8")
    assert "expandable_segments:True to avoid fragmentation" in str(info.value)
    m._dump_snapshot(str(tmp_path / "oom.pickle"))
    ex = explain(str(tmp_path / "oom.pickle"), workers=1).to_json()
    assert any("expandable_segments was already on" in w for w in ex["why"])
    _too_big(tmp_path / "default.pickle")
    ex = explain(str(tmp_path / "default.pickle"), workers=1).to_json()
    assert not any("already on" in w for w in ex["why"])
