"""The C replay core (`vram.replay.ccore`) against the pure-Python engine, byte for byte.

Every replay here runs twice, with ``VRAM_CCORE=0`` (Python) and with the C core, and must give
the same result (less its wall-clock time), ``memory_stats()``, segments and blocks, pools and
``active`` in the same dict order, device calls, timeline and verification. Traces: random
programs recorded by vram itself (seeded malloc / free on three streams, ``empty_cache``,
``record_stream`` now and then — a free that completes later, which the C core hands back to
Python — recorded from the start or from mid-run), replayed under configs that reach every path
the C core models and some it refuses; and every real recording in the traces folder.

Where the C core is not built, it is built in place (``python3 -m vram.replay.ccore build``);
skipped only where it cannot be: no C compiler or no Python headers.
"""
from __future__ import annotations

import json
import random
import shutil
import sysconfig
from pathlib import Path
from typing import Any

import pytest

from paths import RECORDINGS as TRACES
from vram.allocator import CachingAllocator
from vram.allocator.errors import OutOfMemoryError
from vram.allocator.history import ALL, STATE
from vram.devices.simulated import SimulatedDevice
from vram.replay import ccore
from vram.replay.engine import replay
from vram.replay.loader import load_snapshot
from vram.views.snapshot import segments, snapshot

pytestmark = pytest.mark.xdist_group("test_ccore")  # the C core, built in place once when missing

MiB = 1 << 20
CONFS = [None, "", "max_split_size_mb:64", "roundup_power2_divisions:4",
         "roundup_power2_divisions:[256:1,512:2,>:8],max_non_split_rounding_mb:300",
         "large_segment_size_mb:40", "expandable_segments:True"]


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if ccore.available() is None:
        return
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}) to build the C core")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        pytest.skip("no Python headers (Python.h) to build the C core")
    ccore.build()
    ccore._loaded = False  # load the new build
    assert ccore.available() is None, ccore.available()


#: (cumulative probability, lowest size, highest size + 1): zero bytes, small, large and oversize requests
SIZES = ((0.5, 0, MiB), (0.85, MiB, 12 * MiB), (1.0, 12 * MiB, 300 * MiB))


def _size(rng: random.Random) -> int:
    r = rng.random()
    return next(rng.randrange(lo, hi) for p, lo, hi in SIZES if r < p)


def program(seed: int, steps: int = 1500, record_streams: bool = False) -> dict[str, Any]:
    """A snapshot of a random program, recorded from the start (even seeds) or from mid-run."""
    rng = random.Random(seed)
    a = CachingAllocator(SimulatedDevice("8GiB"), "")
    live: list[int] = []
    start = 0 if seed % 2 == 0 else steps // 3
    for step in range(steps):
        if step == start:
            a.history.configure(True, (STATE, ALL)[seed % 2], 1_000_000, True)
        r = rng.random()
        if r < 0.5 or not live:
            try:
                live.append(a.malloc(_size(rng), rng.choice((0, 0, 0, 7, 9))))
            except OutOfMemoryError:
                pass
        elif r < 0.97:
            a.free(live.pop(rng.randrange(len(live))))
        elif r < 0.985 and record_streams:
            a.record_stream(rng.choice(live), 11)
        else:
            a.empty_cache()
    return snapshot([a])


def outcome(snap: dict[str, Any], **kw: Any) -> tuple[str, Any]:
    r = replay(snap, skip_cycles=False, **kw)
    a = r.allocator
    assert a is not None
    result = {k: v for k, v in r.to_json().items() if k != "seconds_replay"}
    blocks = [[(k, b.ptr, b.size, b.requested_size, b.stream, b.allocated, b.frames, b.segment_frames,
                b.prev.ptr if b.prev else None, b.next.ptr if b.next else None) for k, b in d.items()]
              for d in (a.large_blocks.blocks, a.small_blocks.blocks, a.active)]
    state = [result, a.memory_stats(), segments(a), a.total_allocated_memory, blocks,
             list(a.large_blocks.keys), list(a.small_blocks.keys),
             a.device.mallocs, a.device.frees, a.device.used,
             [list(t) for t in r.timeline] if r.timeline else None]
    return r.engine, json.dumps(state, default=repr)


def both(monkeypatch: pytest.MonkeyPatch, snap: dict[str, Any], **kw: Any) -> str:
    """Replay under both engines; returns the engine the C side used (asserting they agree)."""
    monkeypatch.setenv(ccore.ENV, "0")
    py_engine, py = outcome(snap, **kw)
    monkeypatch.delenv(ccore.ENV)
    c_engine, c = outcome(snap, **kw)
    assert py_engine.startswith("Python")
    assert c == py, f"the C core ({c_engine}) and Python disagree"
    return c_engine


@pytest.mark.parametrize("seed", range(8))
def test_random_programs(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    snap = program(seed)
    engines = [both(monkeypatch, snap, conf=conf, verify=conf is None, timeline=seed % 2 == 0)
               for conf in CONFS]
    assert engines[0] == "C"  # the recording's own config is modelled
    assert engines[-1].startswith("Python (expandable segments")


def test_refusals_replay_in_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the C loop stops on the way the replay starts again in Python, with the same result."""
    snap = program(4, record_streams=True)
    assert "later" in both(monkeypatch, snap)  # a free held back with an event
    assert "cudaMalloc failed" in both(monkeypatch, program(6), gpu="1GiB")  # retry and OOM paths
    assert "later" in replay(snap).engine  # (cycle skipping on: the same fallback)
    assert "pending" in both(monkeypatch, load_snapshot(TRACES / "llm-inference-1.3b-state.pickle"))


def test_progress_and_peak_tracking(monkeypatch: pytest.MonkeyPatch) -> None:
    """Progress callbacks and the largest free block at the reserved peak, over many streams."""
    rng = random.Random(5)
    a = CachingAllocator(SimulatedDevice("1TiB"), "")
    a.history.configure(True, STATE, 1_000_000, True)
    live = []
    for _ in range(3000):  # many streams, each leaving free blocks: _largest_free runs out of budget
        p = a.malloc(rng.randrange(1, 4 * MiB), rng.randrange(1, 400))
        if rng.random() < 0.5:
            a.free(p)
        else:
            live.append(p)
    snap = snapshot([a])
    calls: dict[str, list[tuple[int, int]]] = {}
    for setting in ("0", "1"):
        monkeypatch.setenv(ccore.ENV, setting)
        seen = calls[setting] = []
        r = replay(snap, skip_cycles=False, progress=lambda i, n, seen=seen: seen.append((i, n)))
        assert r.engine == ("C" if setting == "1" else "Python (VRAM_CCORE=0)")
    assert calls["0"] == calls["1"]
    assert both(monkeypatch, snap) == "C"


@pytest.mark.parametrize("path", sorted(TRACES.glob("*.pickle")), ids=lambda p: p.name)
def test_recordings(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    snap = load_snapshot(path)
    for kw in ({"verify": True, "timeline": True}, {"conf": "max_split_size_mb:64"},
               {"conf": "roundup_power2_divisions:4", "gpu": "80GB"}, {"conf": "expandable_segments:True"}):
        both(monkeypatch, snap, **kw)


def test_scan_reads_what_python_reads() -> None:
    """`ccore.scan`'s segment lists and first pool id are the Python reads of the same trace, and
    `plan_pools` makes the same plan from its hint (private-pool recordings: ids on some entries,
    on every entry, on none)."""
    from test_pool_replay import CASES, recording
    from vram.replay.pool_replay import plan_pools
    snaps = [recording(case, style) for case in CASES for style in ("private", "every_entry", "no_ids")]
    for snap in [*snaps, program(1), load_snapshot(TRACES / "ftcourse-memory-snapshot.pickle")]:
        trace = snap["device_traces"][0]
        got = ccore.scan(trace)
        assert got is not None
        assert got.segment_allocs == [(e["addr"], e["size"]) for e in trace if e["action"] == "segment_alloc"]
        assert got.segment_maps == [(e["addr"], e["size"]) for e in trace if e["action"] == "segment_map"]
        assert got.first_pool_id == next((i for i, e in enumerate(trace) if "pool_id" in e), None)
        common = ("alloc", "free_requested", "free_completed", "segment_alloc")
        assert got.rare == [i for i, e in enumerate(trace) if e["action"] not in common]
        assert _plan(plan_pools, snap["segments"], trace) == _plan(plan_pools, snap["segments"], trace, 0,
                                                                   got.first_pool_id)
    assert ccore.scan([{"action": "alloc"}, 3]) is None  # not a dict: the Python paths read it
    assert ccore.scan([{"action": "segment_alloc", "addr": 0}]) is None  # (Python raises KeyError)


class _Key(str):
    """A str subclass: a key the scan must look up, as a dict lookup would find it."""


def _fresh(text: str) -> str:
    return "".join([text[:1], text[1:]])  # an equal str that is another object, not interned


def test_scan_reads_any_key_objects() -> None:
    """`ccore.scan` reads each dict by pointer where its keys and actions are exact strs (one value
    comparison per distinct object): the ops are the same whether every dict has its own key and
    action objects (more of them than it remembers), some keys are str subclasses (read by lookups)
    or the actions are other hashables."""
    trace = program(1)["device_traces"][0]
    want = ccore.scan(trace)
    assert want is not None
    own = [{_fresh(k): (_fresh(v) if k == "action" else v) for k, v in e.items()} for e in trace]
    sub = [{(_Key(k) if k == "addr" and i % 3 == 0 else k): v for k, v in e.items()} for i, e in enumerate(trace)]
    for variant in (own, sub):
        got = ccore.scan(variant)
        assert got is not None and got.ops == want.ops
    other = [{**e, "action": 7 if i % 2 else ("free", 1)} for i, e in enumerate(trace[:50])]
    got, ref = ccore.scan(other), ccore.scan([{**e, "action": "other"} for e in trace[:50]])
    assert got is not None and ref is not None and got.ops == ref.ops
    assert ccore.scan([{"action": ["unhashable"]}]) is None


def _plan(plan_pools: Any, *args: Any) -> Any:
    """A pool plan as plain values, or the error that refused it."""
    try:
        plan = plan_pools(*args)
    except Exception as exc:  # noqa: BLE001 - (a recording without ids whose pools cannot be told)
        return repr(exc)
    return None if plan is None else (plan.mallocs, plan.runs)
