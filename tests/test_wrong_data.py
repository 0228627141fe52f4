"""Nothing wrong accepted: data PyTorch cannot have written is refused with one line, or replayed
with a note and divergences, never verified 100 % without a word. Expected outcomes come from
PyTorch's sources (cited per test), not from vram's output."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from pickle import dumps as pickle_dumps
from typing import Any

import pytest

from vram.replay.engine import replay
from vram.replay.loader import load_snapshot, to_pytorch_snapshot

sys.path.insert(0, os.path.dirname(__file__))
from hostile_files import BASE, TRACES, MiB, reject, segment, snap  # noqa: E402

RECORDING = str(TRACES / "cs336-s-mem.pickle")


def _mutated(how: str) -> dict[str, Any]:
    s = to_pytorch_snapshot(load_snapshot(RECORDING))
    trace = s["device_traces"][0]
    if how == "free twice":  # a free_requested repeated before its completion
        k = next(i for i, e in enumerate(trace) if e["action"] == "free_requested")
        trace.insert(k + 1, dict(trace[k]))
    elif how == "free a free block":  # a free_requested after the block's free completed
        k = next(i for i, e in enumerate(trace) if e["action"] == "free_completed")
        trace.insert(k + 1, dict(trace[k], action="free_requested"))
    elif how == "free what was never allocated":
        k = next(i for i, e in enumerate(trace) if e["action"] == "alloc")
        trace.insert(k + 1, dict(trace[k], action="free_requested", addr=0x1234_0000_0000))
    return load_snapshot(json.dumps(s).encode())


@pytest.mark.parametrize("how", ["free twice", "free a free block", "free what was never allocated"])
@pytest.mark.parametrize("engine", ["C", "Python"])
def test_a_free_of_no_live_block_is_not_verified(how: str, engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """PyTorch records free_requested only in ``free()`` of a live block (CUDACachingAllocator.cpp:
    ``record_trace(TraceEntry::FREE_REQUESTED, ...)`` for the block being freed); a trace with
    another is not one PyTorch wrote, whatever else matches."""
    if engine == "Python":
        monkeypatch.setenv("VRAM_CCORE", "0")
    s = _mutated(how)
    assert replay(load_snapshot(RECORDING), verify=True).verification["divergences"] == []
    v = replay(s, verify=True).verification
    assert [d["kind"] for d in v["divergences"]] == ["free"]
    assert any("free an address with no live block" in n for n in v["notes"])


def test_rmm_frees_of_pointers_never_allocated_are_noted(tmp_path: Path) -> None:
    """RMM logs every allocate and free (logging_resource_adaptor); a free of a pointer the log
    never allocated is not verified silently."""
    p = tmp_path / "log.csv"
    p.write_text("Thread,Time,Action,Pointer,Size,Stream\n"
                 "1,10:00:00.000001,allocate,0x7f0000000000,1048576,0x0\n"
                 "1,10:00:00.000002,free,0x7f0000200000,1048576,0x0\n"
                 "1,10:00:00.000003,free,0x7f0000000000,1048576,0x0\n")
    v = replay(load_snapshot(str(p)), verify=True).verification
    assert any(d["kind"] == "free" and d["event_index"] == 1 for d in v["divergences"])
    assert any("free an address with no live block" in n for n in v["notes"])


def test_a_repeated_json_key_is_refused() -> None:
    """json.loads keeps the last of repeated keys: ``"device_traces": [[]]`` after the real one
    would drop every event. json.dump never writes a key twice, so the file is refused."""
    text = json.dumps(to_pytorch_snapshot(load_snapshot(RECORDING)))
    assert text.endswith("}")
    reject((text[:-1] + ', "device_traces": [[]]}').encode(), "unreadable JSON", "'device_traces' appears twice")
    entry = '{"action": "alloc", "addr": 512, "size": 512, "addr": 1024}'
    reject(('{"segments": [], "device_traces": [[' + entry + ']]}').encode(), "'addr' appears twice")


@pytest.mark.parametrize("offset", [1, 8, 128])
def test_a_segment_at_an_unaligned_address_is_refused(offset: int) -> None:
    """cudaMalloc and cuMemAddressReserve return addresses aligned to at least 256 bytes (CUDA C++
    Programming Guide, Device Memory Accesses)."""
    seg = segment(BASE + offset, [(2 * MiB, "active_allocated", 2 * MiB)])
    reject(snap([seg]), "segments[0].address", "not a multiple of 256")
    load_snapshot(snap([segment(BASE + 256, [(2 * MiB, "active_allocated", 2 * MiB)])]))


# --------------------------------------------------------------------------- amplification


def test_devices_that_record_nothing_are_not_replayed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A small file of 65,536 empty device traces: only the devices that record events or
    segments are replayed (the others' replays are all zeros), in one run and in a fleet."""
    from vram.cli.commands import main

    traces: list[list[dict[str, Any]]] = [[] for _ in range(65_536)]
    traces[3] = [{"action": "alloc", "addr": BASE, "size": 512, "stream": 0, "time_us": 0, "frames": []}]
    p = tmp_path / "many.pickle"
    p.write_bytes(pickle_dumps({"segments": [], "device_traces": traces}))
    assert main(["replay", str(p), "--json"]) == 0
    out, err = capsys.readouterr()
    assert len(out) < 2000 and json.loads(out)["device"] == 3
    assert "65,535 device(s) record no events and no segments" in err
    assert main(["replay", str(p), str(p), "--json", "--jobs", "1"]) == 0
    assert [r["job"]["device"] for r in json.loads(capsys.readouterr().out)["runs"]] == [3, 3]


PIPE = """
import os, threading, tracemalloc
from vram.replay.loader import SnapshotError, load_snapshot
r, w = os.pipe()
def feed():
    block = b"\\x80" + bytes(1 << 20)
    with os.fdopen(w, "wb") as f:
        for _ in range(256):
            f.write(block)
threading.Thread(target=feed, daemon=True).start()
tracemalloc.start()
try:
    load_snapshot(f"/dev/fd/{r}", max_bytes=200 << 20)
except SnapshotError as e:
    print("refused", e)
print("peak", tracemalloc.get_traced_memory()[1] >> 20)
"""


def test_a_pipe_over_the_limit_is_refused_without_holding_it_in_memory() -> None:
    """A pipe's length is unknown until its end: its bytes beyond a small buffer wait in a
    temporary file, so a 256 MiB pipe against a 200 MiB limit is refused holding far less."""
    from hostile_files import run_python

    r = run_python(PIPE)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[0].startswith("refused ") and "larger than the 209,715,200-byte limit" in lines[0], lines
    assert int(lines[1].split()[1]) < 120, lines  # MiB


# --------------------------------------------------------------------------- small ones


def test_a_request_of_an_exabyte_counts_as_an_oom(tmp_path: Path) -> None:
    """CUDACachingAllocator.cpp ``allocate``: ``TORCH_CHECK_WITH(OutOfMemoryError, size <
    one_exa_bytes, "CUDA out of memory. Tried to allocate more than 1EB memory.")`` refuses it
    before the device allocator (so ``num_ooms`` does not count it); the replay's count of
    failed requests does, beside the OOM it reports."""
    p = tmp_path / "eb.pickle"
    p.write_bytes(snap(trace=[{"action": "alloc", "addr": BASE, "size": 1 << 60, "stream": 0, "frames": []}]))
    r = replay(load_snapshot(str(p)))
    assert r.oom is not None and r.oom["message"] == "CUDA out of memory. Tried to allocate more than 1EB memory."
    assert r.ooms == 1
    assert r.allocator is not None and r.allocator.stats.num_ooms == 0


def test_sizes_and_counts_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    """One short line for a 5,000-digit --gpu (beyond a size_t, and beyond what int() prints);
    counts below 1 refused by the parser."""
    from vram.cli.commands import main

    for option in ("--gpu", "--context", "--alloc"):
        assert main(["replay", RECORDING, option, "9" * 5000]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and len(err) < 400 and "5,000 characters" in err, err
    assert main(["replay", RECORDING, "--gpu", "9" * 25]) == 2
    assert "more than a size_t holds" in capsys.readouterr().err
    for argv in (["tune", RECORDING, "--top", "-5"], ["tune", RECORDING, "--jobs", "0"],
                 ["replay", RECORDING, "--device", "-1"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        assert "expected a whole number" in capsys.readouterr().err
