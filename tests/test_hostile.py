"""Hostile and corrupt snapshots: nothing crashes, nothing hangs, nothing wrong is
accepted, and every refusal is one line naming the file and the problem.

Files are built here, opcode by opcode where the pickler would not write them. Expected outcomes
come from the spec (pytorch-allocator.md) and PyTorch's sources, cited per test; anything that
could kill the interpreter runs in a subprocess, so a crash fails the test instead of pytest.
Adversarial sizes (work that must stay near-linear) are in test_adversarial_size.py.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from vram.cli.commands import main
from vram.replay import safe_pickle
from vram.replay.engine import replay
from vram.replay.loader import SnapshotError, load_snapshot

sys.path.insert(0, os.path.dirname(__file__))
from hostile_files import (  # noqa: E402
    BASE,
    TRACES,
    MiB,
    deep_tuple,
    entry,
    reject,
    run_python,
    segment,
    short_str,
    snap,
    snapshot_opcodes,
)

# --------------------------------------------------------------------------- crashes

LOAD_ALL = """
import sys
from vram.replay import safe_pickle
from vram.replay.loader import SnapshotError, load_snapshot
if sys.argv[1] == "pure":
    safe_pickle.C_UNPICKLER = False  # no C unpickler: the pure-Python one must be safe on its own
for path in sys.argv[2:]:
    try:
        load_snapshot(path)
        print("accepted", path)
    except SnapshotError as e:
        print("refused", e)
"""


@pytest.mark.parametrize("path", ["c", "pure"])
def test_deep_tuples_as_keys_or_members_never_crash(tmp_path: Path, path: str) -> None:
    """Hashing a tuple recurses in C with no depth check (CPython's tuplehash): a 200,000-deep
    tuple as a dict key or set member used to overflow the stack during unpickling (SIGSEGV),
    a 10,000-deep one to raise RecursionError from a repr. Both unpicklers must refuse them."""
    frame_entry = (b"}(" + short_str("action") + short_str("alloc") + short_str("addr") + b"K\x00"
                   + short_str("size") + b"K\x01" + short_str("frames")
                   + b"]}(" + deep_tuple(200_000) + b"K\x01ua" + b"u")  # frames: [{<deep>: 1}]
    files = {
        "settings-key": snapshot_opcodes(settings=deep_tuple(200_000) + b"K\x01"),
        "setitem-key": snapshot_opcodes(settings=short_str("x") + b"}" + deep_tuple(200_000) + b"K\x01s"),
        "frame-key": snapshot_opcodes(entries=frame_entry),
        "frozenset": snapshot_opcodes(settings=short_str("x") + b"(" + deep_tuple(200_000) + b"\x91"),
        "set": snapshot_opcodes(settings=short_str("x") + b"\x8f(" + deep_tuple(200_000) + b"\x90"),
        "key-10k": snapshot_opcodes(settings=deep_tuple(10_000) + b"K\x01"),
    }
    paths = []
    for name, data in files.items():
        p = tmp_path / f"{name}.pickle"
        p.write_bytes(data)
        paths.append(str(p))
    r = run_python(LOAD_ALL, path, *paths)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    lines = r.stdout.splitlines()
    assert len(lines) == len(files), r.stdout
    for line, p in zip(lines, paths):
        assert line.startswith(f"refused {p}: "), line
        assert "recursion" not in line.lower(), line


def _tuple_dag(levels: int) -> bytes:
    """t0 = ("x",), t(k+1) = (t(k), t(k)), each level put in the memo and fetched back."""
    out = short_str("x") + b"\x85q\x00"
    for k in range(levels):
        out += b"h" + bytes([k]) + b"\x86q" + bytes([k + 1])
    return out


@pytest.mark.parametrize("c_unpickler", [True, False])
def test_keys_that_take_long_to_hash_or_compare_are_refused(c_unpickler: bool, monkeypatch: Any) -> None:
    """Keys whose hash or comparison costs more than the file justifies, refused where they would
    be hashed (the byte and opcode named), by both unpicklers: a tuple of 2**22 leaves built from
    memo fetches (at 2**30, 200 bytes took a minute to hash), ints that all hash to 0 (each
    insertion compared with every key before it: 34 s for 880 KB), and an equal but distinct long
    str set again and again (compared byte by byte each time). CPython's hashes: tuplehash walks
    every leaf; an int's hash is its value modulo 2**61 - 1 (sys.hash_info)."""
    monkeypatch.setattr(safe_pickle, "C_UNPICKLER", c_unpickler)
    p = (1 << 61) - 1
    big = b"X" + (5000).to_bytes(4, "little") + b"s" * 5000
    cases = {
        _tuple_dag(22) + b"K\x01s": "(SETITEM): a dict key or set member is a tuple (snapshot keys are strings",
        short_str("x") + b"(" + _tuple_dag(22) + b"\x91s": "(FROZENSET): a dict key or set member is a tuple",
        b"(" + b"".join(pickle.dumps(k * p, protocol=4)[2:-1] + b"N" for k in range(1, 500)) + b"u":
            "(SETITEMS): a dict key or set member is an int of 2**61 - 1 or more in size",
        big + b"q\x00Ns" + big + b"q\x01Ns" + b"h\x01Ns" * 100:
            "(SETITEM): a dict key or set member is a str longer than 256 characters",
    }
    for settings, needle in cases.items():
        data = snapshot_opcodes()[:-2] + short_str("allocator_settings") + b"}" + settings + b"u."
        reject(data, "corrupt pickle at byte ", needle)


def test_deep_json_and_deep_lists_are_refused_cleanly() -> None:
    reject(b"[" * 100_000 + b"]" * 100_000, "unreadable JSON", "nested deeper")
    deep = b"\x80\x04" + b"]" * 100_000 + b"a" * 99_999 + b"."  # lists nest without hashing: fine
    reject(deep, "segments[0]")


# --------------------------------------------------------------------------- unbounded values

def _shared_bomb() -> Any:
    x: Any = "z"
    for _ in range(9):
        x = [x] * 10  # 10**9 leaves in ~1 KB: its repr alone is gigabytes
    return x


def _maxrss_kib() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


@pytest.mark.parametrize("edit, needle", [
    (lambda s: s.update(segment_type=_shared_bomb()), "segments[0].segment_type is not 'small' or 'large' "
                                                      "(got a list of 10 items)"),
    (lambda s: s["blocks"][0].update(state=_shared_bomb()), "segments[0].blocks[0].state is not a known "
                                                            "block state (got a list of 10 items)"),
    (lambda s: s.update(is_expandable=_shared_bomb()), "segments[0].is_expandable is not a bool"),
])
def test_values_are_described_without_building_their_repr(edit: Any, needle: str) -> None:
    seg = segment(BASE, [(20 * MiB, "inactive", 0)])
    edit(seg)
    before = _maxrss_kib()
    reject(snap([seg]), needle)
    assert _maxrss_kib() - before < 100_000  # the full repr was 10**9 characters: gigabytes


def test_settings_and_actions_are_described_briefly() -> None:
    reject(snap(allocator_settings={"x": 1, _shared_bomb().__len__(): 2}), "allocator_settings has a non-str key (10)")
    reject(snap(allocator_settings={"x": 1, (1, 2): 2}),
           "(SETITEMS): a dict key or set member is a tuple (snapshot keys are strings")
    reject(snap(trace=[entry(action="x" * 10_000)]), "device_traces[0][0].action is not a short non-empty str",
           "'xxxxxxxx")


@pytest.mark.parametrize("field", ["address", "total_size", "stream", "device"])
def test_huge_ints_are_named_not_printed(field: str) -> None:
    """7**20000 has 16,900 digits: str() of it raises ValueError (the int-to-str limit)."""
    seg = segment(BASE, [(20 * MiB, "inactive", 0)])
    seg[field] = 7**20000
    msg = reject(snap([seg]), f"segments[0].{field} is absurdly large (an int of 56,148 bits")
    assert len(msg) < 300
    reject(snap(trace=[entry(size=7**20000)]), "device_traces[0][0].size is absurdly large (an int of")
    reject(json.dumps({"segments": [], "device_traces": [[entry(size=7**200)]]}).encode(),
           "device_traces[0][0].size is absurdly large (an int of 562 bits")


# --------------------------------------------------------------------------- reading

def test_size_is_checked_before_reading(tmp_path: Path) -> None:
    import resource

    sparse = tmp_path / "sparse.pickle"
    with open(sparse, "wb") as f:
        f.truncate(3 * 2**30)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(SnapshotError, match=r"sparse\.pickle: larger than the 2,147,483,648-byte limit "
                                            r"\(3,221,225,472 bytes\)"):
        load_snapshot(sparse)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000  # KiB


def test_devices_and_pipes_are_read_in_bounded_chunks() -> None:
    with pytest.raises(SnapshotError, match=r"^/dev/zero: unrecognised format \(byte 0 is 0x00"):
        load_snapshot("/dev/zero")
    r, w = os.pipe()

    def feed() -> None:
        try:
            with os.fdopen(w, "wb") as f:
                for _ in range(64):
                    f.write(b"}" * MiB)  # plausible start, never ending (as from /dev/urandom)
        except BrokenPipeError:
            pass

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        with pytest.raises(SnapshotError, match=r"larger than the 4,194,304-byte limit \(more than 4,194,304"):
            load_snapshot(f"/dev/fd/{r}", max_bytes=4 * MiB)
    finally:
        os.close(r)
    writer.join(5)


def test_a_recording_loads_under_a_2gib_address_space_limit() -> None:
    """Reading used to reserve max_bytes + 1 (2 GiB) up front: under ``ulimit -v 2GiB`` a 72 KB
    file failed with a traceback."""
    code = ("import sys; from vram.replay.loader import load_snapshot; "
            "print(len(load_snapshot(sys.argv[1])['device_traces'][0]))")
    r = run_python(code, str(TRACES / "cs336-s-mem.pickle"), limit_as=2 * 2**30)
    assert r.returncode == 0 and r.stdout.strip() == "97", r.stderr[-2000:]


# --------------------------------------------------------------------------- memory

MEMORY_GUARD = """
import sys
from vram.replay import safe_pickle
from vram.replay.loader import SnapshotError, load_snapshot
safe_pickle.MEMORY_FACTOR, safe_pickle.MEMORY_BASE = 4, 16 << 20
if sys.argv[1] == "pure":
    safe_pickle.C_UNPICKLER = False
if sys.argv[1] == "ram":  # a machine with less memory left than the proportional cap
    safe_pickle.MEMORY_FACTOR = 1000
    safe_pickle.available_memory = lambda: 24 << 20
n = 1_200_000
files = {"pickle": b"\\x80\\x04](" + b"}" * n + b"e.", "json": b"[" + b"{}," * n + b"{}]"}
for kind, data in files.items():
    try:
        load_snapshot(data)
        print(kind, "accepted")
    except SnapshotError as e:
        print(kind, e)
"""


@pytest.mark.parametrize("path", ["c", "pure", "ram"])
def test_decoding_memory_is_bounded_in_proportion_to_the_file(path: str) -> None:
    """1.2 MB of EMPTY_DICT opcodes (or 3.6 MB of ``{},`` in JSON) decode to ~80 MB of dicts. Under a
    guard of 4x the file + 16 MiB both are refused, and the message says why; so they are when
    the machine has less memory left than the guard would allow (not the OOM killer)."""
    r = run_python(MEMORY_GUARD, path)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert len(lines) == 2, r.stdout
    why = "the 24 MiB of memory available" if path == "ram" else "4x the file's size + 16 MiB"
    for line in lines:
        assert f"decoding needs more memory than {why} (" in line, line


def test_shared_trace_entries_are_refused_not_expanded() -> None:
    """One entry dict referenced 6M times in a 30 MB file used to be copied per reference (2 GB);
    PyTorch writes a new dict per event (torch/csrc/cuda/memory_snapshot.cpp)."""
    e = entry(compile_context="N/A")  # 7 keys: the walk would copy it
    before = _maxrss_kib()
    reject(snap(trace=[entry(t=1)] + [e] * 300_000), "device_traces[0][1] is the same object as "
           "device_traces[0][2]", "shared references refused")
    assert _maxrss_kib() - before < 100_000  # 300,000 copies of the entry would be ~200 MB
    a, b = [entry(t=1), e], [e]
    reject(pickle.dumps({"segments": [], "device_traces": [a, b]}),
           "device_traces[0][1] is the same object as another part of the snapshot")
    seg = segment(BASE, [(20 * MiB, "inactive", 0)])
    reject(pickle.dumps({"segments": [seg], "device_traces": [[seg["blocks"][0]]]}),
           "device_traces[0][0] is the same object as another part")
    reject(pickle.dumps({"segments": [], "device_traces": [[entry()], [entry()], [7, 7]]}),
           "device_traces[2][0] is not a dict")


def test_corrupt_pickles_say_what_is_wrong() -> None:
    """The pure-Python unpickler decides every failure and names the byte and the opcode,
    instead of "unreadable pickle: 239" / ": EOFError" / ": pop from empty list"."""
    good = pickle.dumps({"segments": [], "device_traces": [[entry()]]}, protocol=4)
    assert reject(b"\x80\x04\xef.", "corrupt pickle at byte 2: 0xef is not a pickle opcode")
    reject(b"\x80\x04\x1f.", "0x1f is not a pickle opcode")
    reject(good[:-1], "truncated")
    reject(good[:20], "truncated")
    reject(b"\x80\x04e.", "corrupt pickle at byte 2 (APPENDS): it needs a value or a MARK that is not on the stack")
    reject(b"\x80\x04]s.", "corrupt pickle at byte 3 (SETITEM): it needs a value or a MARK")
    reject(b"\x80\x04h\x07.", "Memo value not found at index 7")
    reject(b"\x80\x04}]K\x00s.", "corrupt pickle at byte 6 (SETITEM): unhashable dict key or set member (a list)")
    for data in (b"\x80\x04\xef.", good[:-1], b"\x80\x04e."):
        msg = reject(data)
        assert not re.search(r": (\d+|EOFError|pop from empty list)$", msg), msg


# --------------------------------------------------------------------------- wrong data

@pytest.mark.parametrize("blocks, kw, needle", [
    # spec §4: a request is rounded up, so an allocated block holds at least what was asked
    ([(512, "active_allocated", 513), (2 * MiB - 512, "inactive", 0)], {},
     "segments[0].blocks[0].requested_size is 513, more than the block's size 512"),
    ([(1024, "active_pending_free", 2000), (2 * MiB - 1024, "inactive", 0)], {},
     "blocks[0].requested_size is 2000, more than"),
    # spec §6: every small-pool segment is kSmallBuffer (2 MiB)
    ([(20 * MiB, "inactive", 0)], {"segment_type": "small"},
     "segments[0] is a 20971520-byte segment labelled 'small': small-pool segments are exactly 2 MiB"),
    # spec §6: a large segment is 20 MiB, or a request of >= 10 MiB rounded up to 2 MiB
    ([(4 * MiB, "inactive", 0)], {"segment_type": "large"},
     "labelled 'large': large-pool segments are at least 10 MiB"),
    # spec §2, §4: kMinBlockSize
    ([(1000, "active_allocated", 1000), (2 * MiB - 1000, "inactive", 0)], {},
     "segments[0].blocks[0].size is 1000, not a multiple of 512"),
    # spec §10.2: free neighbours are always merged
    ([(512, "inactive", 0), (2 * MiB - 512, "inactive", 0)], {},
     "segments[0].blocks[0] and blocks[1] are adjacent free blocks"),
    # spec §5, §8: large-pool blocks are > 1 MiB (remainders <= 1 MiB are never split off)
    ([(20 * MiB - MiB, "active_allocated", 1), (MiB, "inactive", 0)], {},
     "segments[0].blocks[1] is 1048576 bytes in a large segment"),
    ([(20 * MiB, "inactive", 0)], {"stream": 2**62}, "segments[0].stream is 0x4000000000000000: stream ids"),
])
def test_segments_that_break_the_allocators_invariants_are_refused(blocks: Any, kw: Any, needle: str) -> None:
    reject(snap([segment(BASE, blocks, **kw)]), needle)


def test_legitimate_states_stay_accepted() -> None:
    """Stale requested sizes of free blocks (spec §8: a remainder keeps the value of the block it
    was carved from), pending frees, expandable runs (spec §14) and oversize blocks."""
    ok = [
        segment(BASE, [(512, "active_allocated", 4), (2 * MiB - 512, "inactive", 536_870_912)]),
        segment(BASE + 2 * MiB, [(1024, "active_pending_free", 1000), (512, "active_allocated", 512),
                                 (2 * MiB - 1536, "inactive", 0)]),
        segment(BASE + 4 * MiB, [(512, "active_allocated", 512), (512, "inactive", 0), (512, "active_allocated", 1),
                                 (4 * MiB - 1536, "inactive", 0)], segment_type="small", is_expandable=True),
        segment(BASE + 8 * MiB, [(20 * MiB, "active_allocated", 19 * MiB + 1)]),
        segment(BASE + 28 * MiB, [(600 * MiB, "active_allocated", 600 * MiB)]),
        segment(BASE + 628 * MiB, [(512, "active_allocated", 512), (512, "inactive", 0)],
                segment_type="large", is_expandable=True),
    ]
    loaded = load_snapshot(snap(ok))
    assert len(loaded["segments"]) == 6 and loaded["warnings"] == []


def test_reserved_stream_ids_are_refused() -> None:
    """vram's replay stands for "whatever the recording waited on" with pseudo streams from
    2**62; a recorded stream is a user-space cudaStream_t pointer (memory_snapshot.cpp:
    ``int64_t(te.stream_)``), never that large. A collision used to complete held-back frees at once."""
    reject(snap(trace=[entry(stream=2**62)]), "device_traces[0][0].stream is 0x4000000000000000: "
           "stream ids >= 2**62 are reserved")
    reject(snap(trace=[entry(), entry(action="oom", device_free=0, stream=2**62 + 3)]),
           "device_traces[0][1].stream is 0x4000000000000003")
    csv = b"Thread,Time,Action,Pointer,Size,Stream\n1,1.0,allocate,0x10,512,0x4000000000000000\n"
    reject(csv, "line 2 Stream is 0x4000000000000000")
    assert load_snapshot(snap(trace=[entry(stream=2**62 - 1)]))["device_traces"][0][0]["stream"] == 2**62 - 1


def test_recorded_alloc_conf_must_be_a_string() -> None:
    """allocator_settings["PYTORCH_CUDA_ALLOC_CONF"] is last_allocator_settings, a std::string."""
    for bad in (1, None, ["expandable_segments:True"], {"a": 1}):
        reject(snap(allocator_settings={"PYTORCH_CUDA_ALLOC_CONF": bad}),
               "allocator_settings.PYTORCH_CUDA_ALLOC_CONF is not a str")
    assert load_snapshot(snap(allocator_settings={"PYTORCH_CUDA_ALLOC_CONF": ""}))["allocator_settings"]


def test_segments_on_a_device_without_a_trace_are_refused() -> None:
    """CUDACachingAllocator::snapshot() writes one trace per device, so a segment on device 1
    needs device_traces[1]; with two devices, --verify says what it did not verify."""
    seg = segment(BASE, [(20 * MiB, "inactive", 0)], device=1)
    reject(snap([seg]), "segments[0].device is 1, but device_traces has 1 trace(s)")
    two = pickle.dumps({"segments": [seg], "device_traces": [[], []]})
    r = replay(load_snapshot(two), verify=True)
    assert r.verification is not None and r.verification["segments_on_other_devices"] == 1


def test_unknown_actions_are_warned_counted_and_reported(tmp_path: Path, capsys: Any) -> None:
    trace = [entry(t=0), entry("free_requested", t=1), entry("free_completed", t=2),
             entry("teleport", t=3), entry("teleport", t=4), entry("user_defined", t=5)]
    loaded = load_snapshot(snap(trace=trace))
    assert loaded["warnings"] == ["2 trace event(s) with unknown actions ('teleport' x2) are not replayed"]
    assert replay(loaded, verify=True).verification["unknown_actions"] == {"teleport": 2}
    path = tmp_path / "t.pickle"
    path.write_bytes(snap(trace=trace))
    assert main(["replay", str(path), "--verify"]) == 0
    out, err = capsys.readouterr()
    assert f"vram: warning: {path}: 2 trace event(s) with unknown actions" in err
    assert "not replayed: 2 events with unknown actions ('teleport' x2)" in out


# --------------------------------------------------------------------------- output

EVIL = "\x1b]0;pwned\x07\x1b[2J\x1b[H\nFAKE: all good\r\u202e\ud800"


def test_terminal_escapes_from_a_file_are_never_printed(tmp_path: Path, capsys: Any) -> None:
    frames = [{"filename": EVIL + ".py", "line": 7, "name": EVIL}]
    trace = [dict(entry(size=1 << 40), frames=frames)]
    path = tmp_path / "evil.pickle"
    path.write_bytes(snap(trace=trace))
    assert main(["replay", str(path), "--gpu", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "recorded stack (innermost first):" in out
    assert r"\x1b]0;pwned\x07\x1b[2J\x1b[H" in out and r"\u202e\ud800" in out
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202e\ud800]", out)
    assert "\nFAKE" not in out
    # in error messages too: the value, and the file's name
    seg = segment(BASE, [(20 * MiB, "inactive", 0)], segment_type=EVIL)
    evil_path = tmp_path / "bad\x1b[2J.pickle"
    evil_path.write_bytes(snap([seg]))
    assert main(["replay", str(evil_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err and r"bad\x1b[2J.pickle" in err
    assert r"(got '\x1b]0;pwned\x07\x1b[2J\x1b[H\x0aFAKE: all good\x0d\u202e\ud800')" in err


def test_cli_errors_name_the_file_and_the_field(tmp_path: Path, capsys: Any) -> None:
    """Problems found while replaying (the trace contradicts the final state, a recorded config
    vram cannot parse) are the file's: one line, its name, the field, exit status 2."""
    path = tmp_path / "r.pickle"
    seg = segment(BASE, [(20 * MiB, "inactive", 0)])
    path.write_bytes(snap([seg], [entry("alloc", BASE, 512, 0)]))
    assert main(["replay", str(path), "--verify"]) == 2
    err = capsys.readouterr().err
    assert err == f"vram: error: {path}: device_traces[0][0] (alloc at 0x7f0000000000): no block is live " \
                  "at that address later\n"
    path.write_bytes(snap(allocator_settings={"PYTORCH_CUDA_ALLOC_CONF": "bogus_key:1"}))
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vram: error: {path}: allocator_settings.PYTORCH_CUDA_ALLOC_CONF 'bogus_key:1' "
                          "cannot be replayed: ") and err.count("\n") == 1
    assert main(["replay", str(path), "--conf", ""]) == 0  # another config: the recording still replays
    capsys.readouterr()
    for args in (["summary", str(path)], ["replay", str(tmp_path / "missing.pickle")]):
        path.write_bytes(b"\x80\x04\xef")
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and ("r.pickle: " in err or "missing.pickle: cannot read" in err), err
