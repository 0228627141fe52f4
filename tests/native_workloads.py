"""Workloads whose every output must be the same under the pure-Python and the compiled allocator
(`vram.allocator.native`). Run as a script (``tests/test_native.py`` runs it twice, with and
without ``VRAM_NATIVE``); prints whether the compiled modules are active, then one line per
workload: its name and the SHA-256 of everything it produced.

Random workloads: seeded malloc / free / record_stream / empty_cache / peak resets on two
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
    traces = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(os.environ.get("VRAM_TRACES", "/work/shared/traces"))
    print(f"native active: {native.ACTIVE}", flush=True)
    for k, (conf, fraction) in enumerate(CONFIGS):
        for seed in range(3):
            print(f"random conf={conf!r} seed={seed} {digest(random_workload(conf, fraction, 10 * k + seed))}",
                  flush=True)
    for path in sorted(traces.glob("*.pickle")) if traces.is_dir() else []:
        for conf in (None, "expandable_segments:True"):
            print(f"recording {path.name} conf={conf!r} {digest(recording(path, conf))}", flush=True)


if __name__ == "__main__":
    main()
