"""The rewind's walk in C (`vram.replay._ccore.rewind`) against `vram.replay.rewind._walk`.

`rewind` walks the trace in C where it can (``VRAM_CCORE`` unset) and in Python with
``VRAM_CCORE=0``; both must give the same start state, equal value for value and in the same
order (compared as pickles, which also keep which objects are shared), or raise the same
`TraceError`. Traces: random programs recorded from mid-run (blocks allocated before the trace
and freed in it: sizes inferred; ``empty_cache`` and segment_free), the same with events dropped
or altered (contradictions: the C walk hands those to Python), and every real recording.
"""
from __future__ import annotations

import pickle
import random
from pathlib import Path
from typing import Any

import pytest

from paths import RECORDINGS as TRACES
from test_ccore import built, program  # noqa: F401  (the fixture builds the C core)
from vram.replay import ccore
from vram.replay import rewind as rewind_mod
from vram.replay.engine import _recorded_conf, _recorded_rules
from vram.replay.loader import load_snapshot
from vram.replay.rewind import TraceError, rewind


def _rewind(snap: dict[str, Any], trace: list[dict[str, Any]], device: int = 0) -> bytes | str:
    final = [s for s in snap.get("segments", []) if s.get("device", 0) == device]
    divisions, expandable = _recorded_rules(_recorded_conf(snap), False)
    try:
        return pickle.dumps(rewind(final, trace, divisions, device, expandable))
    except TraceError as exc:
        return f"TraceError: {exc}"


def both(monkeypatch: pytest.MonkeyPatch, snap: dict[str, Any], trace: list[dict[str, Any]],
         device: int = 0) -> bool:
    """Rewind with both walks; True when the C walk ran (not handed back to Python)."""
    monkeypatch.setenv(ccore.ENV, "0")
    py = _rewind(snap, trace, device)
    monkeypatch.delenv(ccore.ENV)
    ran: list[bool] = []
    walk = rewind_mod._walk_in_c

    def spy(*args: Any) -> Any:
        got = walk(*args)
        ran.append(got is not None)
        return got

    monkeypatch.setattr(rewind_mod, "_walk_in_c", spy)
    c = _rewind(snap, trace, device)
    monkeypatch.setattr(rewind_mod, "_walk_in_c", walk)
    assert c == py
    return bool(ran and ran[0])


@pytest.mark.parametrize("seed", range(10))
def test_random_programs(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    snap = program(seed, steps=2500)
    assert both(monkeypatch, snap, snap["device_traces"][0]) or not snap["device_traces"][0]


@pytest.mark.parametrize("seed", range(12))
def test_contradictions(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """Traces with events dropped, duplicated or moved: same state or same TraceError."""
    snap = program(seed | 1, steps=800)
    rng = random.Random(seed)
    trace = list(snap["device_traces"][0])
    for _ in range(1 + seed % 3):
        i = rng.randrange(len(trace))
        kind = rng.randrange(4)
        if kind == 0:
            del trace[i]
        elif kind == 1:
            trace.insert(rng.randrange(len(trace)), trace[i])
        elif kind == 2:
            trace[i] = {**trace[i], "addr": trace[i]["addr"] + 512}
        else:
            trace[i] = {**trace[i], "action": rng.choice(["alloc", "free_completed", "segment_alloc",
                                                            "segment_free", "free_requested", "snapshot"])}
    both(monkeypatch, snap, trace)


@pytest.mark.parametrize("path", sorted(TRACES.glob("*.pickle")), ids=lambda p: p.name)
def test_recordings(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    snap = load_snapshot(path)
    for device, trace in enumerate(snap.get("device_traces") or [[]]):
        both(monkeypatch, snap, trace, device)
