"""``vram explain`` and ``vram tune`` at an OOM that a per-process cap caused, at one the device
caused, and where no config fits.

PyTorch's rules (CUDACachingAllocator.cpp): ``set_per_process_memory_fraction(f)`` sets
``allowed_memory_maximum = floor(f × total)``; ``alloc_block`` refuses a new segment when
``total_allocated_memory + alloc_size`` exceeds it, and otherwise calls ``cudaMalloc``, which
fails only with less than ``alloc_size`` free on the device; ``alloc_size`` is
``get_allocation_size`` of the rounded request (2 MiB multiples above 10 MiB). The recordings are
made by vram's allocator in PyTorch's format; the expected bounds come from the recording's own
events and these rules.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from vram.allocator.caching import CachingAllocator
from vram.allocator.errors import OutOfMemoryError
from vram.allocator.history import ALL
from vram.analysis.explain import explain
from vram.analysis.tune import tune
from vram.cli.commands import main
from vram.devices.simulated import SimulatedDevice
from vram.replay.engine import replay
from vram.replay.loader import load_snapshot
from vram.views.snapshot import dump_snapshot, snapshot

MiB = 1 << 20
CAP = 1000 * MiB


def record(path: Path, *, cap: int | None = CAP, gpu: str = "80GiB", goes_on: bool = False) -> Path:
    """Tensors of 30, 37, 44 ... MiB, every third freeing the oldest, until one fails (on the
    cap, or on the device); with `goes_on`, the program catches it and allocates again."""
    dev = SimulatedDevice(gpu)
    a = CachingAllocator(dev, "")
    a.history.configure(True, ALL, 100000, True)
    if cap is not None:
        a.set_memory_fraction(cap / dev.total_memory)
        assert a.allowed_memory_maximum == CAP
    live: list[int] = []
    with pytest.raises(OutOfMemoryError):
        for k in range(1000):
            live.append(a.malloc((30 + 7 * k) * MiB))
            if k % 3 == 2:
                a.free(live.pop(0))
    if goes_on:
        for p in live[:3]:
            a.free(p)
        a.malloc(5 * MiB)
    dump_snapshot(snapshot([a]), str(path))
    return path


def recorded_bracket(path: Path) -> tuple[int, int, int]:
    """From the recording's events: the most reserved before the OOM, reserved at it, the size."""
    trace = load_snapshot(str(path))["device_traces"][0]
    reserved = most = 0
    for e in trace:
        if e["action"] == "oom":
            return most, reserved, e["size"]
        reserved += {"segment_alloc": e["size"], "segment_free": -e["size"]}.get(e["action"], 0)
        most = max(most, reserved)
    raise AssertionError("no oom entry")


@pytest.mark.parametrize("goes_on", [False, True])
def test_an_oom_under_a_cap_is_bracketed_and_fixes_are_verified_against_its_upper_end(tmp_path: Path,
                                                                                       goes_on: bool) -> None:
    path = record(tmp_path / "cap.pickle", goes_on=goes_on)
    most, reserved, size = recorded_bracket(path)
    ex = explain(str(path), workers=1)
    assert ex.at["kind"] == "oom" and ex.at["device_free"] > 70 * (1 << 30)
    need = (size + 2 * MiB - 1) // (2 * MiB) * (2 * MiB)  # get_allocation_size above 10 MiB
    assert ex.limit == {"low": most, "high": reserved + need, "cause": "per-process cap"}
    assert ex.limit["low"] <= CAP < ex.limit["high"]
    assert ex.gpu == ex.limit["high"] - 1  # not reserved + the device's free memory (80 GiB)
    assert any("per-process cap" in w for w in ex.why)
    assert ex.ends_at_oom is not goes_on
    assert any(("recording stops at this failure" in w) for w in ex.why) is not goes_on
    snap = load_snapshot(str(path))
    assert replay(snap, cap=ex.gpu).ooms > 0  # the upper end reproduces the failure
    more = [f for f in ex.fixes if f["kind"] in ("cap", "gpu")]
    assert [f["kind"] for f in more] == ["cap"]
    assert more[0]["cap"] > ex.gpu and replay(snap, cap=more[0]["cap"]).ooms == 0
    assert more[0]["lower_bound"] is not goes_on and ("at least" in more[0]["change"]) is not goes_on
    for fix in ex.fixes:
        if fix["kind"] == "config" and fix["verified"]:
            conf = fix["change"].split("=", 1)[1]
            assert replay(snap, conf=conf, cap=ex.gpu).ooms == 0


def test_explain_json_gives_the_limit(tmp_path: Path, capsys: Any) -> None:
    path = record(tmp_path / "cap.pickle")
    most, reserved, size = recorded_bracket(path)
    assert main(["explain", str(path), "--json", "--jobs", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["limit"] == {"low": most, "high": reserved + size, "cause": "per-process cap"}


def test_an_oom_the_device_caused_is_limited_by_the_device(tmp_path: Path) -> None:
    path = record(tmp_path / "dev.pickle", cap=None, gpu="1GiB")
    ex = explain(str(path), workers=1)
    total = ex.reserved + ex.at["device_free"]
    assert ex.at["device_free"] < ex.at["size"]
    assert ex.limit == {"low": total, "high": total, "cause": "device"}
    assert not any("per-process cap" in w for w in ex.why)


def test_tune_when_nothing_fits_has_no_best_and_says_how_much_more_the_least_demanding_needs(
        tmp_path: Path, capsys: Any) -> None:
    path = record(tmp_path / "cap.pickle", goes_on=True)
    result = tune([str(path)], workers=1)
    assert all(r["oom"] for r in result.results) and result.best is None
    least = result.least_demanding
    assert least is not None and least["more"] > 0
    budget = result.budgets[0].cap  # the recorded OOM had the device's room: a cap
    assert result.budgets[0].gpu is None
    assert isinstance(budget, int) and least["gpu"] == budget + least["more"]
    snap = load_snapshot(str(path))
    assert replay(snap, conf=least["conf"], cap=least["gpu"]).ooms == 0
    assert replay(snap, conf=least["conf"], cap=least["gpu"] - 2 * MiB).ooms > 0
    assert main(["tune", str(path), "--json", "--jobs", "1"]) == 1  # exit 1: every config runs out of memory
    assert json.loads(capsys.readouterr().out)["best"] is None
    assert main(["tune", str(path), "--top", "1", "--jobs", "1"]) == 1
    text = capsys.readouterr().out
    assert "best:" not in text and "no config fits" in text and "(default)" in text
    assert least["lower_bound"] is False  # the program went on after the failure: the bisection saw it
    stops = tune([str(record(tmp_path / "stops.pickle"))], workers=1).least_demanding
    assert stops is not None and stops["lower_bound"] is True


def test_a_recording_whose_reserved_memory_is_flat_is_explained_at_its_allocated_peak() -> None:
    from paths import RECORDINGS
    path = RECORDINGS / "cs336-s-forward-bf16-128.pickle"  # steady state: no segment_alloc in the trace
    snap = load_snapshot(str(path))
    trace = snap["device_traces"][0]
    assert not any(e["action"] in ("segment_alloc", "segment_free") for e in trace)
    # requested bytes after each event, walked back from the final segments (trace sizes are the
    # requests; the allocated figure counts whole blocks, at least as large)
    allocated = [sum(s["requested_size"] for s in snap["segments"])]
    for e in reversed(trace):
        allocated.append(allocated[-1] - {"alloc": e["size"], "free_completed": -e["size"]}.get(e["action"], 0))
    after = allocated[::-1][1:]  # after[i]: allocated after event i
    peak = max(after)
    ex = explain(str(path), workers=1)
    assert ex.at["kind"] == "allocated_peak" and ex.at["event_index"] == after.index(peak)
    assert ex.allocated >= peak
    assert any("never rose above" in w for w in ex.why)


def test_a_state_dump_is_explained_as_the_state_it_holds() -> None:
    from paths import RECORDINGS
    path = RECORDINGS / "llm-inference-oom-state.pickle"  # segments at an OOM, one `snapshot` trace entry
    snap = load_snapshot(str(path))
    ex = explain(str(path), workers=1)
    assert ex.at == {"kind": "state", "event_index": -1}
    assert ex.reserved == sum(s["total_size"] for s in snap["segments"])
    assert ex.allocated == sum(s["allocated_size"] for s in snap["segments"])
    assert "no OOM recorded" not in ex.gpu_from and ex.limit is None
    assert any("state dump" in w for w in ex.why)
