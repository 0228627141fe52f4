"""The loader's walk of trace entries in C (`vram.replay._ccore.entries`) against the
Python walk (`vram.replay.loader._Walker.entries` with ``VRAM_CCORE=0``), byte for byte.

Each file is loaded both ways; the results must pickle to the same bytes (so equal values, and
the same objects shared: an entry kept as its own normalised form, a frames list kept or copied)
with the same warnings, or both loads must fail with the same `SnapshotError`. Files: every real
recording, and random programs recorded by vram with entries made unusual or wrong field by field
(each goes back to the Python walk, which names the problem), frames lists shared, copied, with
frames not in normalised form, and one dict referenced twice.
"""
from __future__ import annotations

import pickle
import random
from pathlib import Path
from typing import Any

import pytest

from paths import RECORDINGS as TRACES
from test_ccore import built, program  # noqa: F401  (the fixture builds the C core)
from vram.replay import ccore, loader
from vram.replay.loader import SnapshotError, load_snapshot

#: (field, value) pairs an entry may be given; None as the value: the key is removed
EDITS: list[tuple[str, Any]] = [
    ("action", None), ("action", 3), ("action", ""), ("action", "x" * 65), ("action", "x" * 64),
    ("action", "snapshot"), ("action", "no_such_action"), ("action", "oom"), ("action", b"alloc"),
    ("addr", None), ("addr", -1), ("addr", 2**64), ("addr", 2**64 - 1), ("addr", True), ("addr", 1.0),
    ("size", None), ("size", -512), ("size", 2**64), ("size", 0), ("size", False),
    ("stream", None), ("stream", -1), ("stream", 2**62), ("stream", 2**62 - 1), ("stream", True),
    ("time_us", None), ("time_us", -1), ("time_us", 2**64), ("time_us", 1.5), ("time_us", True),
    ("frames", None), ("frames", ()), ("frames", []), ("frames", [{"filename": "a.py", "line": 1, "name": "f"}]),
    ("frames", [{"filename": "a.py", "line": 1, "name": "f", "extra": 0}]), ("frames", [{"filename": "a.py"}]),
    ("frames", "abc"), ("pool_id", None), ("pool_id", (0, 0)), ("pool_id", (1, 2)), ("pool_id", [3]),
    ("device_free", 123), ("extra", 1),
]


def _load(data: bytes, monkeypatch: pytest.MonkeyPatch, c: bool) -> bytes | str:
    if c:
        monkeypatch.delenv(ccore.ENV, raising=False)
    else:
        monkeypatch.setenv(ccore.ENV, "0")
    try:
        return pickle.dumps(load_snapshot(data))
    except SnapshotError as exc:
        return f"SnapshotError: {exc}"


def both(monkeypatch: pytest.MonkeyPatch, snap: Any) -> bool:
    """Load `snap` (pickled) both ways; True when the C walk ran."""
    data = pickle.dumps(snap)
    py = _load(data, monkeypatch, False)
    ran: list[bool] = []
    real = ccore.loaded

    def spy() -> Any:
        got = real()
        ran.append(got is not None)
        return got

    monkeypatch.setattr(loader.ccore, "loaded", spy)
    c = _load(data, monkeypatch, True)
    monkeypatch.setattr(loader.ccore, "loaded", real)
    assert c == py
    return any(ran)


def _edited(snap: dict[str, Any], rng: random.Random, edits: int) -> dict[str, Any]:
    trace: list[Any] = [dict(e) for e in snap["device_traces"][0]]

    def frames(x: Any) -> Any:
        return x.get("frames") if type(x) is dict else None

    for _ in range(edits):
        i = rng.randrange(len(trace))
        kind = rng.randrange(10)
        if type(trace[i]) is not dict:
            continue
        if kind < 7:
            key, value = rng.choice(EDITS)
            if value is None and rng.random() < 0.5:
                trace[i].pop(key, None)
            else:
                trace[i][key] = value
        elif kind == 7:  # a frames list shared with another entry (the recordings share them)
            trace[i]["frames"] = frames(trace[rng.randrange(len(trace))])
        elif kind == 8:  # a copy of another entry's frames (same frame dicts, another list)
            trace[i]["frames"] = list(frames(trace[rng.randrange(len(trace))]) or [])
        else:
            trace[i] = 7 if rng.random() < 0.3 else {**trace[i], "frames": list(frames(trace[i]) or [])}
    return {**snap, "device_traces": [trace]}


@pytest.mark.parametrize("seed", range(16))
def test_random_edits(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    rng = random.Random(seed)
    snap = program(seed, steps=400)
    assert both(monkeypatch, snap)
    for edits in (1, 1, 3, 12):
        both(monkeypatch, _edited(snap, rng, edits))


def test_every_edit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each edit alone, on the first alloc entry of a recorded program: same result or same error."""
    snap = program(2, steps=60)
    trace = snap["device_traces"][0]
    for key, value in EDITS:
        for drop in (False, True) if value is None else (False,):
            e = dict(trace[0])
            if drop:
                e.pop(key, None)
            else:
                e[key] = value
            both(monkeypatch, {**snap, "device_traces": [[e, *trace[1:]]]})


def test_shared_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    snap = program(3, steps=60)
    trace = list(snap["device_traces"][0])
    trace.insert(5, trace[2])
    data = pickle.dumps({**snap, "device_traces": [trace]})
    got = _load(data, monkeypatch, True)
    assert got == _load(data, monkeypatch, False)
    assert "device_traces[0][2] is the same object as device_traces[0][5]" in str(got)


@pytest.mark.parametrize("path", sorted(TRACES.glob("*.pickle")), ids=lambda p: p.name)
def test_recordings(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    data = path.read_bytes()
    assert _load(data, monkeypatch, True) == _load(data, monkeypatch, False)
