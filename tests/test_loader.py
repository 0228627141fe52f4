"""vram.replay.loader: safe loading of untrusted snapshot files (spec §18.2, §18.3, §18.4, §23).

Real recordings come from the repository's recordings/ folder (see its README; ``VRAM_TRACES``
points elsewhere); a test fails when one is missing.
"""
from __future__ import annotations

import copyreg
import io
import json
import os
import pickle
import pickletools
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hostile_files import reject
from vram.replay.loader import SnapshotError, load_snapshot

MiB = 1 << 20
from paths import RECORDINGS as TRACES  # noqa: E402

# file: (trace events, segment_alloc events, final segments, legacy, reserved bytes)
RECORDINGS = {
    "cs336-s-mem.pickle": (97, 9, 9, False, 3_781_165_056),
    "cs336-k-forward-ctx128.pickle": (4657, 289, 516, False, 19_667_091_456),
    "ftcourse-memory-snapshot.pickle": (10307, 152, 215, False, 6_471_811_072),
    "cs336-s-forward-bf16-128.pickle": (2811, 0, 43, False, 861_929_472),
    "llm-inference-oom-state.pickle": (1, 0, 176, True, 11_844_714_496),
    "llm-inference-1.3b-state.pickle": (1, 0, 257, True, 7_608_467_456),
}
ENTRY_KEYS = {"action", "addr", "size", "stream", "time_us", "frames"}
SEGMENT_KEYS = {"device", "address", "total_size", "allocated_size", "active_size",
                "requested_size", "stream", "segment_type", "is_expandable", "frames", "blocks"}
BLOCK_KEYS = {"address", "size", "requested_size", "state", "frames"}


def recording(name: str) -> Path:
    return TRACES / name


class _RawUnpickler(pickle.Unpickler):
    """The test's own plain-data reader, to cross-check the loader against the raw recording."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"global {module}.{name}")


def raw(path: Path) -> Any:
    return _RawUnpickler(io.BytesIO(path.read_bytes())).load()


def assert_plain(obj: Any, path: str = "snapshot") -> None:
    """Only dict (str keys), list, str, int, float, bool, None — nothing else, anywhere — and pool
    ids (``segment_pool_id``, ``pool_id``), which PyTorch writes as a pair of ints."""
    stack, seen = [(obj, path)], set()
    while stack:
        o, p = stack.pop()
        if type(o) is tuple and p.endswith("pool_id"):
            assert len(o) == 2 and all(type(i) is int for i in o), f"{p}: {o!r}"
            continue
        assert type(o) in (dict, list, str, int, float, bool, type(None)), f"{p}: {type(o)}"
        if id(o) in seen:  # shared (memoised) frames: already checked
            continue
        seen.add(id(o))
        if type(o) is dict:
            for k, v in o.items():
                assert type(k) is str, f"{p} key {k!r}"
                stack.append((v, f"{p}.{k}"))
        elif type(o) is list:
            stack.extend((v, f"{p}[{i}]") for i, v in enumerate(o))


def small_snapshot() -> dict[str, Any]:
    """A tiny new-format snapshot (spec §18.3): one 2 MiB small segment, three blocks: allocated,
    pending free (its free waits for another stream), free. Two free blocks are never adjacent
    (spec §10.2: they merge)."""
    base = 0x7F00_0000_0000
    frame = {"filename": "t.py", "line": 3, "name": "f"}
    blocks = [
        {"address": base, "size": 512, "requested_size": 4, "state": "active_allocated",
         "frames": [frame]},
        {"address": base + 512, "size": 1024, "requested_size": 1000,
         "state": "active_pending_free", "frames": []},
        {"address": base + 1536, "size": 2 * MiB - 1536, "requested_size": 0,
         "state": "inactive", "frames": []},
    ]
    seg = {"device": 0, "address": base, "total_size": 2 * MiB, "allocated_size": 512,
           "active_size": 1536, "requested_size": 1004, "stream": 0, "segment_type": "small",
           "segment_pool_id": (0, 0), "is_expandable": False, "frames": [frame], "blocks": blocks}
    trace = [
        {"action": "segment_alloc", "addr": base, "size": 2 * MiB, "stream": 0,
         "time_us": 10, "frames": [frame]},
        {"action": "alloc", "addr": base, "size": 4, "stream": 0, "time_us": 11,
         "frames": [frame]},
        {"action": "oom", "device_free": 123, "size": 1 << 40, "stream": 0, "time_us": 12},
    ]
    return {"segments": [seg], "device_traces": [trace],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1,
                                   "garbage_collection_threshold": 0.0,
                                   "roundup_power2_divisions": {"1": 0, "2": 0}}}


# --------------------------------------------------------------------------- real recordings

@pytest.mark.parametrize("name", sorted(RECORDINGS))
def test_recordings_load_with_readme_counts(name: str) -> None:
    events, seg_allocs, nsegs, legacy, reserved = RECORDINGS[name]
    snap = load_snapshot(recording(name))
    assert snap["format"] == "pickle" and snap["legacy"] is legacy
    assert len(snap["device_traces"]) == 1
    trace = snap["device_traces"][0]
    assert len(trace) == events
    assert sum(e["action"] == "segment_alloc" for e in trace) == seg_allocs
    assert len(snap["segments"]) == nsegs
    assert sum(s["total_size"] for s in snap["segments"]) == reserved
    assert_plain(snap)
    for s in snap["segments"]:
        assert set(s) == SEGMENT_KEYS
        assert s["segment_type"] == ("small" if s["total_size"] == 2 * MiB else "large")
        for b in s["blocks"]:
            assert set(b) == BLOCK_KEYS
    for e in trace:
        assert set(e) == ENTRY_KEYS | ({"device_free"} if e["action"] == "oom" else set())


def test_recording_details_match_the_readme() -> None:
    k = load_snapshot(recording("cs336-k-forward-ctx128.pickle"))
    assert k["allocator_settings"]["max_split_size"] == -1  # default config (spec §23)
    assert k["allocator_settings"]["roundup_power2_divisions"]["32768"] == 0
    cran = load_snapshot(recording("ftcourse-memory-snapshot.pickle"))
    assert cran["allocator_settings"] is None
    assert all(e["time_us"] is None for e in cran["device_traces"][0])  # "no time_us"
    assert all(e["frames"] for e in cran["device_traces"][0])
    s_mem = load_snapshot(recording("cs336-s-mem.pickle"))
    assert all(isinstance(e["time_us"], int) for e in s_mem["device_traces"][0])
    # one device, one stream (spec §23)
    for snap in (k, cran, s_mem):
        assert {s["device"] for s in snap["segments"]} == {0}
        assert {e["stream"] for e in snap["device_traces"][0]} == {0}


@pytest.mark.parametrize("name", sorted(RECORDINGS))
def test_both_unpicklers_agree_on_the_recordings(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C unpickler (fast path) and the pure-Python one (canonical, with its key checks)
    decode every recording to the same snapshot, and neither sees a shared trace entry."""
    from vram.replay import safe_pickle

    fast = load_snapshot(recording(name))
    monkeypatch.setattr(safe_pickle, "_c_load", lambda data: None)  # as if the C one failed
    assert load_snapshot(recording(name)) == fast


@pytest.mark.parametrize("name", sorted(n for n, v in RECORDINGS.items() if v[3]))
def test_legacy_block_addresses_are_rebuilt(name: str) -> None:
    path = recording(name)
    data = raw(path)
    assert all("address" not in b for s in data["segments"] for b in s["blocks"])
    snap = load_snapshot(path)
    checked = 0
    for rs, s in zip(data["segments"], snap["segments"]):
        addr = s["address"]
        assert addr == rs["address"]
        for rb, b in zip(rs["blocks"], s["blocks"], strict=True):
            assert b["address"] == addr  # segment address + preceding sizes (spec §18.3)
            assert (b["size"], b["requested_size"], b["state"]) == \
                (rb["size"], rb["requested_size"], rb["state"])
            history = rb.get("history")
            if b["state"] == "active_allocated" and history:
                # independent evidence: the current allocation's history item sits there
                assert history[-1]["addr"] == b["address"]
                assert history[-1]["real_size"] == b["requested_size"]
                assert b["frames"] == history[0]["frames"]
                checked += 1
            addr += b["size"]
        assert addr == s["address"] + s["total_size"]
    assert checked >= 460


def test_legacy_oom_snapshot_entry() -> None:
    snap = load_snapshot(recording("llm-inference-oom-state.pickle"))
    (entry,) = snap["device_traces"][0]
    assert entry == {"action": "snapshot", "addr": 0, "size": 11_840_159_744, "stream": 0,
                     "time_us": None, "frames": []}
    # a snapshot entry's size is the total active bytes (spec §18.2)
    assert entry["size"] == sum(s["active_size"] for s in snap["segments"])


# ftcourse is left out only for speed: its 10,307 entries share 646 frame dicts ~1M times,
# which JSON would spell out in full (~10 s).
@pytest.mark.parametrize("name", sorted(set(RECORDINGS) - {"ftcourse-memory-snapshot.pickle"}))
def test_json_round_trip(name: str) -> None:
    snap = load_snapshot(recording(name))
    text = json.dumps(snap).encode()
    again = load_snapshot(text)
    assert again["format"] == "json" and again["legacy"] is False
    for key in ("segments", "device_traces", "allocator_settings"):
        assert again[key] == snap[key]


def test_new_recording_survives_a_protocol_0_and_1_repickle() -> None:
    data = raw(recording("cs336-s-mem.pickle"))
    expected = load_snapshot(recording("cs336-s-mem.pickle"))
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        again = load_snapshot(pickle.dumps(data, protocol=proto))
        assert again == expected, proto


# --------------------------------------------------------------------------- hostile pickles

class _Evil:
    def __init__(self, func: Any, arg: str) -> None:
        self.func, self.arg = func, arg

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return self.func, (self.arg,)


def _hostile_payloads(marker: Path) -> list[bytes]:
    cmd = f"touch {marker}"
    code = f"open({str(marker)!r}, 'w').close()"
    out = []
    for func, arg in ((os.system, cmd), (eval, code), (exec, code)):
        evil = _Evil(func, arg)
        for proto in (0, 2, pickle.HIGHEST_PROTOCOL):
            out.append(pickle.dumps(evil, protocol=proto))
            # hidden deep inside an otherwise well-formed snapshot
            snap = small_snapshot()
            snap["device_traces"][0][1]["frames"][0] = evil
            out.append(pickle.dumps(snap, protocol=proto))
    return out


def test_hostile_pickles_are_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    for payload in _hostile_payloads(marker):
        msg = reject(payload, "refused pickled global")
        assert any(g in msg for g in ("system", "eval", "exec")), msg
        assert not marker.exists()
        path = tmp_path / "evil.pickle"
        path.write_bytes(payload)
        with pytest.raises(SnapshotError, match=r"evil\.pickle: "):
            load_snapshot(path)
        assert not marker.exists()


def test_persistent_ids_and_extension_codes_are_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class P(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return "x" if obj == "frames-go-here" else None

    buf = io.BytesIO()
    P(buf, protocol=2).dump({"segments": [], "device_traces": [["frames-go-here"]]})
    reject(buf.getvalue(), "refused opcode BINPERSID")

    code = 0x7E57
    copyreg.add_extension("posix", "system", code)
    try:
        payload = pickle.dumps(_Evil(os.system, f"touch {marker}"), protocol=2)
        assert any(op.name == "EXT2" for op, _, _ in pickletools.genops(payload))
        reject(payload, "refused opcode EXT2")
        # warm copyreg's extension cache (a bare EXT2 reference: nothing is called); the C
        # unpickler would now hand os.system over without asking find_class
        assert pickle.loads(b"\x80\x02\x83" + code.to_bytes(2, "little") + b".") is os.system
        reject(payload, "refused opcode EXT2")
    finally:
        copyreg.remove_extension("posix", "system", code)
        copyreg.clear_extension_cache()
    assert not marker.exists()


def test_memo_index_bomb_is_harmless() -> None:
    """PUT with a huge memo index: the C unpickler would grow an array to ~2**33 slots."""
    resource = pytest.importorskip("resource")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for data in (b"\x80\x02]r" + (0xFFFF_FFF0).to_bytes(4, "little") + b".",
                 b"(lp99999999999\n."):
        snap = load_snapshot(data)
        assert snap["segments"] == [] and snap["format"] == "pickle"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB


# --------------------------------------------------------------------------- corrupt input

def test_truncated_files_fail_cleanly_at_every_cut() -> None:
    data = recording("cs336-s-mem.pickle").read_bytes()
    cuts = set(range(0, 200)) | set(range(0, len(data), max(1, len(data) // 400)))
    cuts |= {len(data) - k for k in range(1, 64)}
    for cut in sorted(cuts):
        reject(data[:cut])
    assert load_snapshot(data)["format"] == "pickle"


def test_truncated_json_fails_cleanly() -> None:
    text = json.dumps(small_snapshot()).encode()
    for cut in range(1, len(text)):
        reject(text[:cut])


def test_not_a_snapshot() -> None:
    reject(b"", "file is empty")
    reject(pickle.dumps(42), "not a snapshot", "int")
    reject(pickle.dumps("segments"), "not a snapshot")
    reject(pickle.dumps(None), "not a snapshot")
    reject(pickle.dumps({"foo": 1}), "without 'segments' or 'device_traces'")
    reject(json.dumps({"a": []}).encode(), "without 'segments'")
    reject(b"hello world", "unrecognised format")
    reject(b"\x80\x04garbage", "truncated")
    reject(b"{not json", "unreadable JSON")
    reject(b'{"segments": [], "allocator_settings": {"x": NaN}}', "allocator_settings.x")
    reject(b'[{"address": Infinity}]', "segments[0].address is not a non-negative int")
    reject(pickle.dumps(small_snapshot()) + b"junk", "4 trailing bytes")
    reject(b"\xff\xfe\x00", "unrecognised format")


def test_missing_file_and_size_cap(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match="nope.pickle: cannot read"):
        load_snapshot(tmp_path / "nope.pickle")
    data = pickle.dumps(small_snapshot())
    reject(data, "limit", max_bytes=len(data) - 1)
    assert load_snapshot(data, max_bytes=len(data))["segments"]
    path = tmp_path / "s.pickle"
    path.write_bytes(data)
    with pytest.raises(SnapshotError, match="s.pickle: larger than"):
        load_snapshot(str(path), max_bytes=100)
    with pytest.raises(ValueError, match="fmt"):
        load_snapshot(data, fmt="yaml")


def _mutated(edit: Any) -> bytes:
    snap = small_snapshot()
    edit(snap)
    return pickle.dumps(snap)


def _seg(s: dict[str, Any]) -> dict[str, Any]:
    seg: dict[str, Any] = s["segments"][0]
    return seg


def _blk(s: dict[str, Any], i: int) -> dict[str, Any]:
    block: dict[str, Any] = _seg(s)["blocks"][i]
    return block


@pytest.mark.parametrize("edit, needle", [
    (lambda s: _blk(s, 2).update(size="big"), "segments[0].blocks[2].size is not a non-negative"),
    (lambda s: _blk(s, 1).update(size=-512), "segments[0].blocks[1].size is negative"),
    (lambda s: _blk(s, 1).update(size=True), "blocks[1].size is not a non-negative int (got bool)"),
    (lambda s: _blk(s, 2).update(size=MiB), "blocks sum to 1050112 bytes but total_size is 2097"),
    (lambda s: _seg(s).update(address=2**64), "segments[0].address is absurdly large"),
    (lambda s: _seg(s).update(address=2**64 - MiB), "extends past 2**64"),
    (lambda s: _seg(s).update(total_size=2**70), "segments[0].total_size is absurdly large"),
    (lambda s: _blk(s, 1).update(state="zombie"), "segments[0].blocks[1].state"),
    (lambda s: _blk(s, 1).update(address=0), "segments[0].blocks[1].address"),
    (lambda s: _seg(s).update(allocated_size=0), "segments[0].allocated_size is 0"),
    (lambda s: _seg(s).update(blocks=[]), "segments[0].blocks is empty"),
    (lambda s: _seg(s).update(blocks=None), "segments[0].blocks is not a list"),
    (lambda s: _seg(s).pop("address"), "segments[0] has no 'address'"),
    (lambda s: _seg(s).update(segment_type="medium"), "segments[0].segment_type"),
    (lambda s: _seg(s).update(is_expandable=1), "segments[0].is_expandable"),
    (lambda s: _seg(s).update(device=-1), "segments[0].device is negative"),
    (lambda s: _seg(s)["frames"].append({"name": 1}), "segments[0].frames[1]"),
    (lambda s: s.update(segments={}), "segments is not a list"),
    (lambda s: s["segments"].append(dict(_seg(s), blocks=[dict(b) for b in _seg(s)["blocks"]])),
     "segments[0] and segments[1] overlap"),
    (lambda s: s["segments"].append(_seg(s)), "segments[1] is the same object as segments[0]"),
    (lambda s: s.update(device_traces=[{}]), "device_traces[0] is not a list"),
    (lambda s: s["device_traces"][0][0].update(addr=-1), "device_traces[0][0].addr is negative"),
    (lambda s: s["device_traces"][0][0].pop("action"), "device_traces[0][0] has no 'action'"),
    (lambda s: s["device_traces"][0][1].update(time_us=1.5), "device_traces[0][1].time_us"),
    (lambda s: s["device_traces"][0][2].pop("device_free"), "has no 'device_free'"),
    (lambda s: s["device_traces"][0].append(7), "device_traces[0][3] is not a dict"),
    (lambda s: s.update(allocator_settings={1: 2}), "allocator_settings has a non-str key"),
    (lambda s: s.update(allocator_settings={"x": {1, 2}}), "allocator_settings.x has a value"),
    (lambda s: s.update(allocator_settings=[]), "allocator_settings is not a dict"),
])
def test_schema_errors_name_the_path(edit: Any, needle: str) -> None:
    reject(_mutated(edit), needle)


def test_exploding_shared_references_are_cheap_or_refused() -> None:
    """A few KB that would expand to ~10**12 nodes if walked naively. Frames shared by reference
    are normal (PyTorch interns them) and normalised once; trace entries and traces are refused,
    because PyTorch writes a new dict per event and a new list per device (memory_snapshot.cpp),
    and one entry referenced a million times would be a million events to replay."""
    settings_bomb: Any = "x"
    for _ in range(40):
        settings_bomb = [settings_bomb, settings_bomb]
    reject(_mutated(lambda s: s.update(allocator_settings={"a": settings_bomb})),
           "too large or too deeply nested")
    frames = [{"filename": "f.py", "line": 1, "name": "g"}] * 200
    trace = [{"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "time_us": t,
              "frames": frames} for t in range(2_000)]
    data = pickle.dumps({"segments": [], "device_traces": [trace]})
    assert len(data) < 100_000
    snap = load_snapshot(data)
    assert snap["device_traces"][0][5]["frames"][7] is snap["device_traces"][0][9]["frames"][3]
    entries = small_snapshot()["device_traces"][0] * 10_000
    reject(pickle.dumps({"segments": [], "device_traces": [entries]}),
           "device_traces[0][0] is the same object as device_traces[0][3]", "shared references refused")
    one = small_snapshot()["device_traces"][0]
    reject(pickle.dumps({"segments": [], "device_traces": [one] * 10_000}),
           "device_traces[1] is the same object as device_traces[0]")


SMALL_PICKLE = pickle.dumps(small_snapshot(), protocol=4)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(SMALL_PICKLE) - 1), st.integers(0, 255)),
                min_size=1, max_size=6))
def test_random_byte_flips_never_escape(flips: list[tuple[int, int]]) -> None:
    data = bytearray(SMALL_PICKLE)
    for pos, value in flips:
        data[pos] = value
    try:
        snap = load_snapshot(bytes(data))
    except SnapshotError as exc:
        assert "\n" not in str(exc)
    else:
        assert_plain(snap)


REAL = TRACES / "cs336-s-mem.pickle"


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_random_byte_flips_in_a_recording(data: st.DataObject) -> None:
    blob = bytearray(REAL.read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    try:
        assert_plain(load_snapshot(bytes(blob)))
    except SnapshotError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_escape(blob: bytes) -> None:
    for fmt in (None, "pickle", "json", "rmm-csv"):
        try:
            assert_plain(load_snapshot(blob, fmt=fmt))
        except SnapshotError:
            pass


# --------------------------------------------------------------------------- other shapes

def test_small_snapshot_is_normalised() -> None:
    snap = load_snapshot(pickle.dumps(small_snapshot()))
    assert_plain(snap)
    seg = snap["segments"][0]
    assert "segment_pool_id" not in seg and set(seg) == SEGMENT_KEYS
    oom = snap["device_traces"][0][2]
    assert oom == {"action": "oom", "addr": 123, "device_free": 123, "size": 1 << 40,
                   "stream": 0, "time_us": 12, "frames": []}


def test_top_level_list_is_segments_only() -> None:
    segs = small_snapshot()["segments"]
    for data in (pickle.dumps(segs), json.dumps(segs).encode()):
        snap = load_snapshot(data)
        assert snap["device_traces"] == [] and snap["allocator_settings"] is None
        assert len(snap["segments"]) == 1 and snap["legacy"] is False


def test_legacy_layout_derivations() -> None:
    """Legacy (≤2.0) blocks: no address, `history`; missing sums/type/requested are derived."""
    base = 0x7F00_0000_0000
    hist = [{"addr": base, "real_size": 3000, "frames": [{"filename": "a.py", "line": 1,
                                                           "name": "g"}]}]
    seg = {"address": base, "total_size": 2 * MiB, "stream": 0, "blocks": [
        {"size": 3072, "state": "active_allocated", "history": hist},
        {"size": 2 * MiB - 3072, "state": "inactive"}]}
    snap = load_snapshot(pickle.dumps({"segments": [seg], "device_traces": []}))
    s = snap["segments"][0]
    assert snap["legacy"] is True
    assert (s["device"], s["segment_type"], s["is_expandable"], s["frames"]) == \
        (0, "small", False, [])
    assert (s["allocated_size"], s["active_size"], s["requested_size"]) == (3072, 3072, 3000)
    b0, b1 = s["blocks"]
    assert (b0["address"], b0["requested_size"], b0["frames"]) == (base, 3000, hist[0]["frames"])
    assert (b1["address"], b1["requested_size"], b1["frames"]) == (base + 3072, 0, [])
    big = dict(seg, total_size=20 * MiB, blocks=[{"size": 20 * MiB, "state": "inactive"}])
    assert load_snapshot(pickle.dumps([big]))["segments"][0]["segment_type"] == "large"


def test_vram_own_snapshot_loads() -> None:
    import vram

    vram.simulate()
    vram.memory._record_memory_history()
    try:
        p = vram.caching_allocator_alloc(4)
        vram.caching_allocator_delete(p)
        snap = load_snapshot(pickle.dumps(vram.memory._snapshot()))
    finally:
        vram.memory._record_memory_history(None)
    assert_plain(snap)
    assert [e["action"] for e in snap["device_traces"][0]][:2] == ["segment_alloc", "alloc"]


# --------------------------------------------------------------------------- RMM CSV

RMM_LOG = """Thread,Time,Action,Pointer,Size,Stream
140573312345856,23:59:59.999000,allocate,0x7f8a40000000,1024,0x0
140573312345856,23:59:59.999500,allocate,0x7f8a40000400,2048,0x7f8a38001020
140573312345857,00:00:00.000100,free,0x7f8a40000000,1024,0x0
140573312345856,00:00:01.500000,allocate failure,0x0,1099511627776,0x0
"""


def test_rmm_csv_log() -> None:
    snap = load_snapshot(RMM_LOG.encode())
    assert snap["format"] == "rmm-csv" and snap["segments"] == [] and snap["legacy"] is False
    assert snap["allocator_settings"] is None
    (trace,) = snap["device_traces"]
    assert [(e["action"], e["addr"], e["size"]) for e in trace] == [
        ("alloc", 0x7F8A40000000, 1024), ("alloc", 0x7F8A40000400, 2048),
        ("free_requested", 0x7F8A40000000, 1024), ("free_completed", 0x7F8A40000000, 1024),
        ("oom", 0, 1 << 40)]
    assert trace[1]["stream"] == 0x7F8A38001020 and trace[0]["stream"] == 0
    day = 86400 * 10**6
    assert [e["time_us"] for e in trace] == [
        day - 1000, day - 500, day + 100, day + 100, day + 1_500_000]  # rolls over midnight
    assert trace[4]["device_free"] == 0
    assert all(set(e) == ENTRY_KEYS | ({"device_free"} if e["action"] == "oom" else set())
               for e in trace)
    assert_plain(snap)
    # other spellings seen in RMM's docs/parser: ':' before µs, epoch seconds, "deallocate"
    alt = ("\ufeffThread,Time,Action,Pointer,Size,Stream\r\n"
           "1,10:00:00:000001,allocate,0x10,512,0\r\n"
           "1,1634567890.123456,deallocate,0x10,512,0\r\n\r\n")
    trace = load_snapshot(alt.encode(), fmt="rmm-csv")["device_traces"][0]
    assert [e["time_us"] for e in trace] == [36000 * 10**6 + 1] + [1634567890123456] * 2


@pytest.mark.parametrize("row, needle", [
    ("1,00:00:00.0,allocate,0x10,512", "line 2 has 5 fields"),
    ("1,00:00:00.0,reallocate,0x10,512,0x0", "line 2 Action"),
    ("1,noon,allocate,0x10,512,0x0", "line 2 Time"),
    ("1,00:00:00.0,allocate,0x10,-512,0x0", "line 2 Size"),
    ("1,00:00:00.0,allocate,0x10000000000000000,512,0x0", "line 2 Pointer"),
    ("1,00:00:00.0,allocate,0x10,١٢,0x0", "line 2 Size"),
])
def test_rmm_csv_errors(row: str, needle: str) -> None:
    reject(f"Thread,Time,Action,Pointer,Size,Stream\n{row}\n".encode(), needle)
    reject(b"Thread,Time\n1,2\n", "not an RMM log", fmt="rmm-csv")


def test_collector_paused_while_loading_and_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cyclic GC is off while a file decodes and walks (README "Speed"), and afterwards
    exactly as it was, also after a refused file."""
    import gc

    import vram.replay.loader as loader_mod

    seen: list[bool] = []
    real = loader_mod.decode_pickle

    def spy(data: bytes) -> Any:
        seen.append(gc.isenabled())
        return real(data)

    monkeypatch.setattr(loader_mod, "decode_pickle", spy)
    good = pickle.dumps({"segments": [], "device_traces": [[]]})
    was = gc.isenabled()
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            load_snapshot(good)
            assert gc.isenabled() is enabled
            with pytest.raises(SnapshotError):
                load_snapshot(pickle.dumps({"segments": 7}))
            assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [False] * 4
