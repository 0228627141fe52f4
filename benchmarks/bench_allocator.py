"""Allocator speed: malloc+free pairs per second, and cost per operation vs cached free blocks.

Run: ``python3 benchmarks/bench_allocator.py`` (``--quick`` for a shorter run). Prints a table;
the figures in the README were measured with it. ``VRAM_NATIVE=1`` measures the compiled
allocator (``python3 -m vram.allocator.native_build`` first); the first line says which ran.

1. Mixed workload: a training-step-like stream of requests — 60 % small (< 1 MiB), 30 % medium
   (1–10 MiB, shared 20 MiB segments), 10 % large (10–200 MiB) — against a live set of ~500
   tensors, freed in random order, on one stream, default config; every statistic kept.
2. Scaling: N free blocks are left cached in the large pool (a segment of alternating
   allocated/free 2 MiB blocks per 1000 N), then malloc+free pairs that must search among them
   are timed.
3. The same scaling workload replayed by the C replay core (`vram.replay.ccore`, when built): the
   program above is recorded (vram's own history) with and without the timed pairs, each
   snapshot pickled and loaded back with ``load_snapshot`` (as ``vram replay`` gets it: the
   entries laid out in memory by the unpickler, not among the recording allocator's objects),
   both replayed event by event (``skip_cycles=False``), and the difference in ``seconds_replay``
   (the whole replay: reading the events, rewind, the loop) is divided by the pairs (each pair
   is three events: alloc, free_requested, free_completed); so is the time spent in each of the
   C core's entry points (``scan``, ``rewind``, ``run``), to show which part grows.
"""
from __future__ import annotations

import argparse
import pickle
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from bench_replay import _time_ccore  # noqa: E402  (benchmarks/, the script's folder)
from vram import CachingAllocator, SimulatedDevice  # noqa: E402
from vram.allocator import native  # noqa: E402
from vram.allocator.history import STATE  # noqa: E402
from vram.replay import ccore  # noqa: E402
from vram.replay.engine import replay  # noqa: E402
from vram.replay.loader import load_snapshot  # noqa: E402
from vram.views.snapshot import snapshot  # noqa: E402

MiB = 1 << 20


def mixed_sizes(rng: random.Random, n: int) -> list[int]:
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.6:
            out.append(rng.randrange(1, MiB))
        elif r < 0.9:
            out.append(rng.randrange(MiB, 10 * MiB))
        else:
            out.append(rng.randrange(10 * MiB, 200 * MiB))
    return out


def bench_mixed(pairs: int, live: int = 500) -> float:
    rng = random.Random(0)
    a = CachingAllocator(SimulatedDevice("1TiB"), "")
    sizes = mixed_sizes(rng, pairs + live)
    held = [a.malloc(s) for s in sizes[:live]]
    victims = [rng.randrange(live) for _ in range(pairs)]
    malloc, free = a.malloc, a.free
    t0 = time.perf_counter()
    for i in range(pairs):
        j = victims[i]
        free(held[j])
        held[j] = malloc(sizes[live + i])
    dt = time.perf_counter() - t0
    return pairs / dt


def bench_scaling(n_free: int, pairs: int) -> float:
    """µs per malloc+free pair with `n_free` free blocks cached in the large pool."""
    a = CachingAllocator(SimulatedDevice("1TiB"), "")
    keep = []
    # Blocks of distinct sizes 2 MiB + k*512, alternately kept and freed, in 40 MiB segments.
    ptrs = []
    for k in range(2 * n_free):
        ptrs.append(a.malloc(2 * MiB + (k % 4096) * 512))
    for k, p in enumerate(ptrs):
        if k % 2:
            a.free(p)
        else:
            keep.append(p)
    nfree = len(a.large_blocks)
    rng = random.Random(1)
    sizes = [2 * MiB + rng.randrange(4096) * 512 for _ in range(pairs)]
    malloc, free = a.malloc, a.free
    t0 = time.perf_counter()
    for s in sizes:
        free(malloc(s))
    dt = time.perf_counter() - t0
    assert len(a.large_blocks) >= nfree - 1
    return dt / pairs * 1e6, nfree


def _scaling_trace(n_free: int, pairs: int) -> dict[str, object]:
    """`bench_scaling`'s program (with `pairs` timed pairs), recorded from an empty allocator."""
    a = CachingAllocator(SimulatedDevice("1TiB"), "")
    a.history.configure(True, STATE, 10**8, True)
    ptrs = [a.malloc(2 * MiB + (k % 4096) * 512) for k in range(2 * n_free)]
    for k, p in enumerate(ptrs):
        if k % 2:
            a.free(p)
    rng = random.Random(1)
    for _ in range(pairs):
        a.free(a.malloc(2 * MiB + rng.randrange(4096) * 512))
    return snapshot([a])


def bench_scaling_ccore(n_free: int, pairs: int, repeat: int = 3) -> tuple[float, int, dict[str, float]]:
    """µs per malloc+free pair replayed by the C core with `n_free` free blocks cached, how many
    free blocks were cached, and the µs per pair of each C entry point (reading the events `scan`,
    `rewind`, the loop `run`; each the best of `repeat`)."""
    base, full = (load_snapshot(pickle.dumps(_scaling_trace(n_free, k))) for k in (0, pairs))
    parts: dict[str, float] = {}
    _time_ccore(parts)
    times, split = [], []
    for snap in (base, full):
        best, best_parts = float("inf"), {}
        for _ in range(repeat):
            parts.clear()
            r = replay(snap, skip_cycles=False)
            assert r.engine == "C", r.engine
            best = min(best, r.seconds_replay)
            best_parts = {k: min(best_parts.get(k, float("inf")), v) for k, v in parts.items()}
        times.append(best)
        split.append(best_parts)
    cached = sum(b["state"] == "inactive" for seg in base["segments"] for b in seg["blocks"])  # type: ignore[attr-defined]
    per = {k: (split[1][k] - split[0][k]) / pairs * 1e6 for k in split[1]}
    return (times[1] - times[0]) / pairs * 1e6, cached, per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    args = ap.parse_args()
    pairs = 20_000 if args.quick else 200_000
    print(f"Python {sys.version.split()[0]}, allocator: "
          f"{'compiled (mypyc, VRAM_NATIVE)' if native.ACTIVE else 'pure Python'}")
    rate = bench_mixed(pairs)
    print(f"mixed workload: {rate:,.0f} malloc+free pairs/s ({1e6 / rate:.2f} µs per pair)")
    print(f"{'free blocks':>12} {'µs per pair':>12}")
    for n in (10, 100, 1_000, 10_000, 100_000):
        us, nfree = bench_scaling(n, 5_000 if args.quick else 50_000)
        print(f"{nfree:>12,} {us:>12.2f}")
    if ccore.available() is not None:
        print(f"C replay core not measured: {ccore.available()}")
        return
    print("replayed by the C replay core (vram.replay.ccore); the whole replay() per pair, then the part")
    print("of it in each C entry point: reading the events' dicts, the rewind, the C loop (best of 3 each):")
    print(f"{'free blocks':>12} {'ns per pair':>12} {'scan':>6} {'rewind':>6} {'loop':>6}")
    for n in (10, 100, 1_000, 10_000, 100_000):
        us, nfree, per = bench_scaling_ccore(n, 20_000 if args.quick else 200_000)
        cols = " ".join(f"{per.get(k, 0) * 1e3:>6.0f}" for k in ("scan", "rewind", "run"))
        print(f"{nfree:>12,} {us * 1e3:>12.0f} {cols}")


if __name__ == "__main__":
    main()
