"""Workloads whose every output must be the same under the pure-Python and the compiled allocator
(`vram.allocator.native`). Run as a script (``tests/test_native.py`` runs it twice, with and
without ``VRAM_NATIVE``); prints whether the compiled modules are active, then one line per
workload: its name and the SHA-256 of everything it produced.

Bad input: arguments the allocator checks itself, and per-instance attributes. Random
workloads: seeded malloc / free / record_stream / empty_cache / peak resets on two
streams, under configs that reach every allocator path (splitting, oversize blocks, power-of-two
rounding, expandable segments, the GC, a memory fraction, OOMs on a small GPU), with the history
recording stacks. Outputs: every ``memory_stats()`` key, the segments with their blocks and
stacks, ``memory_summary()``, the trace (less its wall-clock times), the OOM messages and the
pointers returned. Recordings: every file in the traces folder replayed under its own config
(verified) and with expandable segments: the result, the stats and the final segments.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

from vram.allocator import CachingAllocator, OutOfMemoryError, native
from vram.allocator.history import ALL, ALLOC, STATE
from vram.devices.simulated import SimulatedDevice
from vram.replay.engine import replay
from vram.replay.loader import load_snapshot
from vram.views.snapshot import segments
from vram.views.summary import memory_summary_from_stats

MiB = 1 << 20
CONFIGS = [
    ("", None), ("max_split_size_mb:64", None), ("roundup_power2_divisions:4", None),
    ("expandable_segments:True", None), ("max_split_size_mb:40,expandable_segments:True", None),
    ("garbage_collection_threshold:0.6,max_split_size_mb:100", 0.7),
    ("roundup_power2_divisions:[256:1,512:2,>:8],max_non_split_rounding_mb:300", None),
]


def _size(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.5:
        return rng.randrange(1, MiB)
    if r < 0.85:
        return rng.randrange(MiB, 12 * MiB)
    return rng.randrange(12 * MiB, 600 * MiB)


def random_workload(conf: str, fraction: float | None, seed: int, steps: int = 1500) -> Any:
    rng = random.Random(seed)
    a = CachingAllocator(SimulatedDevice("6GiB", context="300MiB"), conf)
    if fraction is not None:
        a.set_memory_fraction(fraction)
    a.history.configure(True, (STATE, ALLOC, ALL)[seed % 3], 100_000, True)
    live: list[int] = []
    out: list[Any] = []
    for step in range(steps):
        r = rng.random()
        if r < 0.55 or not live:
            try:
                p = a.malloc(_size(rng), rng.choice((0, 0, 0, 7)))
                live.append(p)
                out.append(p)
            except OutOfMemoryError as exc:
                out.append(str(exc))
        elif r < 0.93:
            a.free(live.pop(rng.randrange(len(live))))
        elif r < 0.96:
            a.record_stream(rng.choice(live), rng.choice((7, 9)))
        elif r < 0.98:
            a.empty_cache()
        elif r < 0.99:
            a.reset_peak_memory_stats()
        else:
            out.append(("stats", step, a.memory_stats()))
    trace = [{k: v for k, v in e.as_dict().items() if k != "time_us"} for e in a.history.entries]
    stats = a.memory_stats()
    return out, stats, segments(a), memory_summary_from_stats(stats), trace


class _Index:
    """An integer type that is not int (as numpy's): accepted through ``__index__``."""

    def __index__(self) -> int:
        return 4096

    def __repr__(self) -> str:
        return "_Index()"


class _StreamLike:
    cuda_stream = 5

    def __repr__(self) -> str:
        return "_StreamLike()"


def bad_input() -> Any:
    """Arguments the allocator must check itself, with its own messages, and the instance
    attributes a front end may set (`vram.estimate` shadows malloc/free on one allocator)."""
    dev = SimulatedDevice("1GiB")
    out: list[Any] = []

    def attempt(label: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            got = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - every outcome is compared
            out.append((label, type(exc).__name__, str(exc)))
            return None
        out.append((label, "ok", got if isinstance(got, (int, str, float, type(None))) else type(got).__name__))
        return got

    for conf in (5, 1.5, b"expandable_segments:True", ["x"]):
        attempt(f"conf {conf!r}", CachingAllocator, dev, conf)
    attempt("oom_format", CachingAllocator, dev, "", oom_format="x")
    a = CachingAllocator(dev, "")
    p = a.malloc(MiB)
    for size in (1.5, -1, True, "8", _Index(), 2**70, None):
        attempt(f"malloc {size!r}", a.malloc, size)
    for stream in ("x", -1, 2**63, True, _StreamLike(), None):
        attempt(f"malloc stream {stream!r}", a.malloc, 512, stream)
    for ptr in ("x", 12345, True, None, 2**80):
        attempt(f"free {ptr!r}", a.free, ptr)
    for ptr, stream in ((p, _StreamLike()), ("x", 3), (p, -1), (p, "s"), (12345, 3)):
        attempt(f"record_stream {ptr!r} {stream!r}", a.record_stream, ptr, stream)
    for fraction in (1, True, 1.5, -0.1, "0.5", 0.5):
        attempt(f"fraction {fraction!r}", a.set_memory_fraction, fraction)
    for text in (5, "bogus:1", "max_split_size_mb:64"):
        attempt(f"settings {text!r}", a.set_allocator_settings, text)
    calls: list[int] = []
    real = a.malloc

    def counted(size: int, stream: int = 0) -> int:
        calls.append(size)
        return real(size, stream)

    a.malloc = counted  # type: ignore[method-assign]
    attempt("shadowed malloc", a.malloc, 3 * MiB)
    del a.malloc
    attempt("unshadowed malloc", a.malloc, 3 * MiB)
    return out, calls, a.memory_stats(), segments(a)


def recording(path: Path, conf: str | None) -> Any:
    snap = load_snapshot(path)
    r = replay(snap, conf=conf, verify=conf is None, timeline=True)
    result = r.to_json()
    result.pop("seconds_replay")
    assert r.allocator is not None and r.timeline is not None
    return result, r.allocator.memory_stats(), segments(r.allocator), list(r.timeline[0]), list(r.timeline[1])


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=repr).encode()).hexdigest()


def main() -> None:
    default = os.environ.get("VRAM_TRACES", Path(__file__).resolve().parents[1] / "recordings")
    traces = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(default)
    print(f"native active: {native.ACTIVE}", flush=True)
    for k, (conf, fraction) in enumerate(CONFIGS):
        for seed in range(3):
            print(f"random conf={conf!r} seed={seed} {digest(random_workload(conf, fraction, 10 * k + seed))}",
                  flush=True)
    print(f"bad input {digest(bad_input())}", flush=True)
    for path in sorted(traces.glob("*.pickle")) if traces.is_dir() else []:
        for conf in (None, "expandable_segments:True"):
            print(f"recording {path.name} conf={conf!r} {digest(recording(path, conf))}", flush=True)


if __name__ == "__main__":
    main()
