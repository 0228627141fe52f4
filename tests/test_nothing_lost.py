"""Nothing lost: a fleet keeps every finished result when a job fails or its worker dies, one
unreadable file is one row (named once), one failing candidate does not stop a search, and a
writer never leaves a half-written file where a good one was."""
from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import signal
from pathlib import Path
from typing import Any

import pytest

from paths import RECORDINGS
from vram.analysis import fleet, tune
from vram.analysis.fleet import WORKER_DIED, ReplayJob, run_jobs
from vram.cli.commands import main

SMALL = str(RECORDINGS / "cs336-s-mem.pickle")
OTHER = str(RECORDINGS / "llm-inference-oom-state.pickle")
real_run_job = fleet.run_job
forked = pytest.mark.skipif(multiprocessing.get_start_method() != "fork",
                            reason="the patched worker function reaches the workers by fork")


def killing_run_job(job: ReplayJob) -> dict[str, Any]:
    """`run_job`, but a job whose conf names a marker file kills its worker process: the first
    time only when the marker exists (an outside kill), every time when its name ends in '!'."""
    marker = job.conf or ""
    if marker.startswith("/"):
        if marker.endswith("!") or not os.path.exists(marker):
            Path(marker.rstrip("!")).touch()
            os.kill(os.getpid(), signal.SIGKILL)
        job = ReplayJob(job.path, job.device, None, job.gpu, job.context, job.verify)
    return real_run_job(job)


def _jobs(marker: str) -> list[ReplayJob]:
    return [ReplayJob(SMALL, verify=True), ReplayJob(OTHER, verify=True), ReplayJob(SMALL, conf=marker),
            ReplayJob(OTHER, conf="expandable_segments:True"), ReplayJob(SMALL, gpu="3GiB")]


@forked
def test_a_killed_worker_loses_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker killed once (by the OOM killer, a user): its jobs run again, every row is whole."""
    monkeypatch.setattr(fleet, "run_job", killing_run_job)
    marker = str(tmp_path / "killed")
    rows = run_jobs(_jobs(marker), workers=2)
    assert os.path.exists(marker)
    expected = run_jobs(_jobs(marker), workers=1)  # the marker exists now: nobody dies
    assert [{k: v for k, v in r.items() if k != "job"} for r in rows] == \
        [{k: v for k, v in r.items() if k != "job"} for r in expected]
    assert not any("error" in r for r in rows)


@forked
def test_a_job_that_always_kills_its_worker_is_reported_and_the_rest_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet, "run_job", killing_run_job)
    rows = run_jobs(_jobs(str(tmp_path / "always!")), workers=2)
    assert [r.get("error") for r in rows] == [None, None, WORKER_DIED, None, None]
    serial = run_jobs([j for k, j in enumerate(_jobs("")) if k != 2], workers=1)
    assert [r for k, r in enumerate(rows) if k != 2] == serial


@forked
@pytest.mark.parametrize("exc", [MemoryError, RecursionError, KeyError])
def test_an_error_a_worker_does_not_expect_is_that_jobs_row(exc: type[BaseException],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import vram.replay.engine as engine

    real = engine.replay

    def replay(snap: Any, **kw: Any) -> Any:
        if kw.get("gpu") == "3GiB" or kw.get("conf") == "expandable_segments:True":
            raise exc("raised inside the replay")
        return real(snap, **kw)

    monkeypatch.setattr(engine, "replay", replay)
    for workers in (1, 2):
        rows = run_jobs(_jobs(""), workers=workers)
        assert ["error" in r for r in rows] == [False, False, False, True, True]
        assert all(r["error"].startswith(r["job"]["path"] + ": ") for r in rows[3:])
        assert all(r["peak_reserved"] > 0 for r in rows[:3])


def test_one_unreadable_file_does_not_stop_a_fleet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without --device the devices are counted per file; an unreadable one is its own row."""
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(b"\x80\x04not a pickle")
    missing = str(tmp_path / "missing.pickle")
    rc = main(["replay", SMALL, str(bad), missing, OTHER, "--jobs", "2", "--json", "--verify"])
    rows = json.loads(capsys.readouterr().out)["runs"]
    assert rc == 2
    assert [Path(r["job"]["path"]).name for r in rows] == [
        "cs336-s-mem.pickle", "bad.pickle", "missing.pickle", "llm-inference-oom-state.pickle"]
    assert rows[1]["error"].count(str(bad)) == 1 and rows[2]["error"].count(missing) == 1
    assert "cannot read" in rows[2]["error"]
    assert rows[0]["alloc_addresses"]["matched"] == rows[0]["alloc_addresses"]["total"]


def test_tune_skips_an_unreadable_file_naming_it_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(b"\x80\x04not a pickle")
    assert main(["tune", SMALL, str(bad), "--jobs", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [s["path"] for s in out["snapshots"]] == [SMALL]
    assert sum(n.count(str(bad)) for n in out["notes"]) == 1
    with pytest.raises(ValueError) as info:
        tune.tune([str(bad)], workers=1)
    assert str(info.value).count(str(bad)) == 1


def test_one_failing_candidate_does_not_stop_the_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """A candidate that cannot be replayed is listed as failed, the others ranked."""
    monkeypatch.setattr(tune, "base_grid", lambda: ["", "max_split_size_mb:1", "max_split_size_mb:128"])
    result = tune.tune([SMALL], workers=1)
    assert [r["conf"] for r in result.results] == ["max_split_size_mb:128", ""]
    assert [f["conf"] for f in result.failed] == ["max_split_size_mb:1"]
    assert any("1 config(s) could not be replayed" in n for n in result.notes)


def _streams(path: Path, n: int) -> str:
    """A recording that allocates and frees one 20 MiB block on each of `n` streams."""
    base, size, events, segments = 0x7F00_0000_0000, 20 << 20, [], []
    for s in range(n):
        a = base + s * (32 << 20)
        events += [{"action": act, "addr": a, "size": size, "stream": s + 1, "time_us": 0, "frames": []}
                   for act in ("segment_alloc", "alloc")]
        segments.append({"device": 0, "address": a, "total_size": size, "stream": s + 1, "blocks": [
            {"address": a, "size": size, "requested_size": 0, "state": "inactive", "frames": []}]})
    for s in range(n):
        a = base + s * (32 << 20)
        events += [{"action": act, "addr": a, "size": size, "stream": s + 1, "time_us": 0, "frames": []}
                   for act in ("free_requested", "free_completed")]
    path.write_bytes(pickle.dumps({"segments": segments, "device_traces": [events]}))
    return str(path)


def test_expandable_what_ifs_on_many_streams_with_no_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With no --gpu the card stands in for "unlimited": each stream's expandable segment
    reserves 1 1/8 of it (CUDACachingAllocator.cpp, ExpandableSegment), and that must not run
    out of addresses: one 20 MiB segment mapped per stream, as on any real card."""
    path = _streams(tmp_path / "streams.pickle", 120)
    assert main(["replay", path, "--conf", "expandable_segments:True", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["peak_reserved"], r["segment_allocs"], r["ooms"]) == (120 * (20 << 20), 120, 0)
    result = tune.tune([path], workers=1)
    assert not result.failed
    assert any(r["conf"].startswith("expandable_segments:True") for r in result.results)


# --------------------------------------------------------------------------- writers


def _fail_midway(real: Any) -> Any:
    """`real` (json.dump or pickle.dump) that writes a little, then fails as a full disk does."""
    def dump(obj: Any, f: Any, *args: Any, **kw: Any) -> None:
        f.write("{" if "b" not in getattr(f, "mode", "b") else b"\x80")
        raise OSError(28, "No space left on device")
    return dump


@pytest.mark.parametrize("suffix", [".json", ".pickle"])
def test_a_failing_export_leaves_the_old_file(tmp_path: Path, suffix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Written to a temporary file and renamed: a write that fails halfway leaves the file that
    was there (also when it is the input), and no partial file beside it."""
    import json as json_module

    from vram.replay.loader import load_snapshot

    src = tmp_path / f"in{suffix}"
    assert main(["export", SMALL, "-o", str(src)]) == 0
    before = src.read_bytes()
    os.chmod(src, 0o640)
    target = json_module if suffix == ".json" else pickle
    monkeypatch.setattr(target, "dump", _fail_midway(target.dump))
    assert main(["export", str(src), "-o", str(src)]) != 0
    assert src.read_bytes() == before
    assert os.listdir(tmp_path) == [src.name]
    monkeypatch.undo()
    assert main(["export", str(src), "-o", str(src)]) == 0  # over the input, whole
    assert load_snapshot(str(src))["device_traces"] == load_snapshot(SMALL)["device_traces"]
    assert os.stat(src).st_mode & 0o777 == 0o640 and os.listdir(tmp_path) == [src.name]


def test_a_huge_settings_int_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """No allocator setting is wider than 64 bits (CUDAAllocatorConfig.h: size_t and double);
    a 5,000-digit one is refused when read, so JSON (which refuses > 4,300 digits) never
    starts a file it cannot finish."""
    from vram.replay.loader import SnapshotError, load_snapshot

    bad = tmp_path / "bad.pickle"
    bad.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]],
                                  "allocator_settings": {"max_split_size": 7 * 10**4999}}))
    out = tmp_path / "out.json"
    out.write_text("old")
    with pytest.raises(SnapshotError, match=r"allocator_settings.max_split_size is absurdly large"):
        load_snapshot(str(bad))
    assert main(["export", str(bad), "-o", str(out)]) != 0
    assert out.read_text() == "old"
