"""Replay of real recordings (shared/traces): verification, what-if, state-only, CLI.

Expected figures come from the recordings themselves: their event counts, their final
segments, and shared/traces/README.md.
"""
from __future__ import annotations

import json
import pickle

import pytest

from paths import RECORDINGS as TRACES  # noqa: E402
from vram.cli.commands import main
from vram.replay import ccore
from vram.replay.engine import replay
from vram.replay.loader import load_snapshot

GiB = 1 << 30
MiB = 1 << 20

# name: (events, segment_alloc, alloc, final segments, final blocks) — README.md and spec §23
EVENT_TRACES = {
    "cs336-s-mem": (97, 9, 36, 9, 20),
    "cs336-k-forward-ctx128": (4657, 289, 2058, 516, 1276),
    "ftcourse-memory-snapshot": (10307, 152, 3505, 215, 1079),
    "cs336-s-forward-bf16-128": (2811, 0, 937, 43, 178),
}


def load(name: str) -> dict:
    return load_snapshot(TRACES / f"{name}.pickle")


@pytest.mark.parametrize("name", sorted(EVENT_TRACES))
def test_verification_reproduces_the_recording_exactly(name):
    events, seg_allocs, allocs, segs, blocks = EVENT_TRACES[name]
    r = replay(load(name), verify=True)
    v = r.verification
    assert r.events == events
    assert v["segment_allocs"] == {"matched": seg_allocs, "total": seg_allocs}
    assert v["alloc_addresses"] == {"matched": allocs, "total": allocs}
    assert v["final_segments"] == {"matched": segs, "total": segs}
    assert v["final_blocks"] == {"matched": blocks, "total": blocks}
    assert v["divergences"] == []


@pytest.mark.parametrize("name", sorted(EVENT_TRACES))
def test_peak_reserved_is_the_recorded_final_reserved(name):
    # No segment is ever freed in these recordings, so reserved only grows: its peak is the sum
    # of the final segments' sizes.
    snap = load(name)
    r = replay(snap)
    assert r.peak_reserved == sum(s["total_size"] for s in snap["segments"])
    assert r.final_reserved == r.peak_reserved
    assert r.final_allocated == sum(s["allocated_size"] for s in snap["segments"])
    assert r.peak_device_used == r.peak_reserved


def test_what_if_smaller_gpu_ooms_with_pytorchs_message():
    snap = load("cs336-s-mem")  # starts from an empty allocator: 3.52 GiB reserved at the end
    r = replay(snap, gpu="3GiB", context="200MiB")
    assert r.oom is not None
    msg = r.oom["message"]
    assert msg.startswith("CUDA out of memory. Tried to allocate ")
    assert "GPU 0 has a total capacity of 3.00 GiB" in msg
    assert snap["device_traces"][0][r.oom["event_index"]]["action"] == "alloc"
    assert r.oom["frames"], "the recording's stack for the failing allocation"
    assert r.peak_reserved + 200 * MiB <= 3 * GiB


def test_what_if_expandable_segments_reduces_fragmentation():
    snap = load("ftcourse-memory-snapshot")
    base = replay(snap)
    exp = replay(snap, conf="expandable_segments:True")
    # Expandable memory splits whenever >= 512 B remain (spec §8), so it never keeps the <= 1 MiB
    # tails ordinary large blocks absorb: the same requests never hold more allocated bytes.
    assert exp.peak_allocated <= base.peak_allocated
    assert exp.fragmentation_at_reserved_peak < base.fragmentation_at_reserved_peak


def test_legacy_state_only_snapshots_load_and_answer_an_allocation():
    for name in ("llm-inference-oom-state", "llm-inference-1.3b-state"):
        snap = load(name)
        assert snap["legacy"]
        r = replay(snap, gpu="80GiB")
        reserved = sum(s["total_size"] for s in snap["segments"])
        assert r.final_reserved == reserved
        assert r.allocator.memory_stats()["segment.all.current"] == len(snap["segments"])


def test_replay_stops_at_an_event():
    snap = load("cs336-s-mem")
    r = replay(snap, stop_at=1)  # after the first event, a segment_alloc: no allocation yet
    assert r.final_allocated == 0 and r.events == 1
    with pytest.raises(ValueError):
        replay(snap, stop_at=10**6)


def test_cli_json_and_exit_codes(capsys, tmp_path):
    path = str(TRACES / "cs336-s-mem.pickle")
    assert main(["replay", path, "--verify", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("peak_allocated", "peak_reserved", "peak_device_used", "oom", "events",
                "seconds_replay", "segment_allocs", "alloc_addresses", "final_blocks"):
        assert key in out
    assert out["alloc_addresses"] == {"matched": 36, "total": 36}
    assert out["oom"] is None and out["events"] == 97

    assert main(["replay", path, "--gpu", "3GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["oom"]["message"].startswith("CUDA out of memory.")

    assert main(["replay", path, "--conf", "", "--conf", "expandable_segments:True", "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [r["conf"] for r in runs] == ["", "expandable_segments:True"]

    bad = tmp_path / "bad.pickle"
    bad.write_bytes(b"\x80\x04\x95garbage")
    assert main(["replay", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vram: error: ") and err.count("\n") == 1
    assert main(["replay", path, "--conf", "max_split_size_mb:1"]) == 2
    assert "max_split_size_mb too small" in capsys.readouterr().err
    assert main(["replay", str(tmp_path / "missing.pickle")]) == 2


def test_cli_alloc_trial_on_state(capsys):
    path = str(TRACES / "llm-inference-oom-state.pickle")
    assert main(["replay", path, "--gpu", "24GiB", "--alloc", "2GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["alloc_trial"]["size"] == 2 * GiB and isinstance(out["alloc_trial"]["ok"], bool)


def test_cli_summary_matches_the_recorded_end_state(capsys):
    path = str(TRACES / "cs336-s-mem.pickle")
    assert main(["summary", path]) == 0
    text = capsys.readouterr().out
    reserved_kib = sum(s["total_size"] for s in load("cs336-s-mem")["segments"]) // 1024
    assert "PyTorch CUDA memory summary, device ID 0" in text
    row = next(line for line in text.splitlines() if line.startswith("| GPU reserved memory"))
    assert f"{reserved_kib // 1024} MiB" in row  # 3,606 MiB: unit promotion needs >= 768 GiB


def test_cli_export_opens_in_memory_viz(tmp_path, capsys):
    mv = pytest.importorskip("torch.cuda._memory_viz")
    out = tmp_path / "out.pickle"
    assert main(["export", str(TRACES / "cs336-s-mem.pickle"), "-o", str(out)]) == 0
    data = pickle.loads(out.read_bytes())
    assert "total_reserved: 3.5GiB" in mv.segsum(data)
    assert "<html" in mv.trace_plot(data).lower()


def test_cli_plot_writes_an_image(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "p.png"
    assert main(["plot", str(TRACES / "cs336-s-mem.pickle"), "-o", str(out),
                 "--conf", "expandable_segments:True"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_help_has_examples(capsys):
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    assert "examples:" in capsys.readouterr().out


def _everything(r):
    from vram.views.snapshot import segments

    out = r.to_json()
    out.pop("seconds_replay"), out.pop("skipped_events")
    return (dict(r.allocator.memory_stats()), segments(r.allocator), out,
            list(r.timeline[0]), list(r.timeline[1]))


@pytest.mark.parametrize("kw", [
    {}, {"verify": True}, {"conf": "expandable_segments:True"},
    {"conf": "per_process_memory_fraction:0.9,garbage_collection_threshold:0.5", "gpu": "1GiB"},
    {"conf": "max_split_size_mb:20,roundup_power2_divisions:4"},
    {"conf": "roundup_power2_divisions:2", "gpu": "840MiB"}])  # OOMs from event 2,629 on
def test_cycle_skipping_changes_nothing(kw, monkeypatch):
    """A periodic trace (the steady-state recording repeated) gives identical results — every
    stat, the final segments, the report and the timeline — with and without skipping. Skipping
    is the Python engine's (the C core, where built, replays every event even when asked to
    skip: the replay without skipping runs it where it models the config)."""
    snap = load("cs336-s-forward-bf16-128")
    snap["device_traces"] = [snap["device_traces"][0] * 12]
    slow = replay(snap, timeline=True, skip_cycles=False, **kw)
    monkeypatch.setenv(ccore.ENV, "0")
    fast = replay(snap, timeline=True, skip_cycles=True, **kw)
    assert _everything(fast) == _everything(slow)
    if not kw:
        assert fast.skipped_events > 0.7 * fast.events


def test_cycle_skipping_on_a_non_periodic_trace(monkeypatch):
    snap = load("ftcourse-memory-snapshot")
    slow = replay(snap, timeline=True, skip_cycles=False)
    monkeypatch.setenv(ccore.ENV, "0")
    fast = replay(snap, timeline=True)
    assert _everything(fast) == _everything(slow)


def test_the_c_core_replays_every_event_when_skipping_is_asked_for():
    """Where the C core is used, the default replay (skipping on) runs it, every event."""
    snap = load("cs336-s-forward-bf16-128")
    snap["device_traces"] = [snap["device_traces"][0] * 3]
    r = replay(snap)
    if ccore.available() is not None:
        pytest.skip(f"the C core is not used here: {ccore.available()}")
    assert (r.engine, r.skipped_events) == ("C", 0)


def test_rmm_log_replays_from_an_empty_allocator(tmp_path):
    log = tmp_path / "rmm.csv"
    log.write_text(
        "Thread,Time,Action,Pointer,Size,Stream\n"
        "140,10:00:00.000001,allocate,0x7f0000000000,4000000,0x0\n"
        "140,10:00:00.000002,allocate,0x7f0000400000,1000,0x0\n"
        "140,10:00:00.000003,free,0x7f0000000000,4000000,0x0\n"
        "140,10:00:00.000004,free,0x7f9999999999,64,0x0\n"  # never allocated in the log: ignored
        "140,10:00:00.000005,allocate,0x7f0000800000,300000000,0x0\n")
    r = replay(load_snapshot(log), gpu="24GiB")
    # 4,000,000 -> 4,000,256 B in a 20 MiB segment; 1000 -> 1024 B in a 2 MiB segment;
    # 300,000,000 -> 300,000,256 B in a 144 x 2 MiB segment (spec §4, §6).
    assert r.peak_reserved == (20 + 2 + 288) * MiB
    assert r.peak_allocated == 300_000_256 + 1024
    assert r.final_allocated == 300_000_256 + 1024
