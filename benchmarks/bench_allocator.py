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
4. ``--loops``: loop against loop on the same scaling stream, paired rounds: vram's C loop alone
   (``_ccore.run`` over the recorded events, the set-up alone subtracted), a plain std::set
   best-fit loop (``bfc_harness.cpp``: PyTorch's large-pool logic and nothing else) and, with
   ALLOCATORSIM_SRC set (see bench_replay.py), allocatorSim's core, both fed the program as an op
   array and timed from its first pair; ns per pair, and each loop's growth over its own cost at
   11 cached blocks. Needs g++.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from bench_replay import _time_ccore, build_allocatorsim  # noqa: E402  (benchmarks/, the script's folder)
from vram import CachingAllocator, SimulatedDevice  # noqa: E402
from vram.allocator import native  # noqa: E402
from vram.allocator.history import STATE  # noqa: E402
from vram.replay import ccore  # noqa: E402
from vram.replay.engine import replay  # noqa: E402
from vram.replay.loader import load_snapshot  # noqa: E402
from vram.replay.safe_pickle import gc_paused  # noqa: E402
from vram.views.snapshot import snapshot  # noqa: E402

MiB = 1 << 20
HERE = Path(__file__).resolve().parent


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


def _scaling_program(n_free: int, pairs: int) -> list[tuple[int, int, int]]:
    """`bench_scaling`'s program as ops: (0, id, size) a malloc, (1, id, 0) the free of malloc `id`'s
    block; the set-up (2 `n_free` mallocs, every second one freed), then `pairs` malloc+free pairs."""
    ops = [(0, k, 2 * MiB + (k % 4096) * 512) for k in range(2 * n_free)]
    ops += [(1, k, 0) for k in range(1, 2 * n_free, 2)]
    rng = random.Random(1)
    for k in range(2 * n_free, 2 * n_free + pairs):
        ops += [(0, k, 2 * MiB + rng.randrange(4096) * 512), (1, k, 0)]
    return ops


def _scaling_trace(n_free: int, pairs: int) -> dict[str, object]:
    """`bench_scaling`'s program (with `pairs` timed pairs), recorded from an empty allocator."""
    a = CachingAllocator(SimulatedDevice("1TiB"), "")
    a.history.configure(True, STATE, 10**8, True)
    ptr: dict[int, int] = {}
    for op, k, size in _scaling_program(n_free, pairs):
        if op == 0:
            ptr[k] = a.malloc(size)
        else:
            a.free(ptr.pop(k))
    return snapshot([a])


def bench_scaling_ccore(n_free: int, pairs: int, repeat: int = 3) -> tuple[float, int, dict[str, float]]:
    """µs per malloc+free pair replayed by the C core with `n_free` free blocks cached, how many
    free blocks were cached, and the µs per pair of each C entry point (reading the events `scan`,
    `rewind`, the loop `run`; each the best of `repeat`)."""
    base, full = (load_snapshot(pickle.dumps(_scaling_trace(n_free, k))) for k in (0, pairs))
    parts: dict[str, float] = {}
    times: list[float] = []
    split: list[dict[str, float]] = []
    module = ccore._module
    _time_ccore(parts)  # installs a timing proxy: taken off again below, so sizes do not stack them
    try:
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
    finally:
        ccore._module = module
    cached = sum(b["state"] == "inactive" for seg in base["segments"] for b in seg["blocks"])  # type: ignore[attr-defined]
    per = {k: (split[1][k] - split[0][k]) / pairs * 1e6 for k in split[1]}
    return (times[1] - times[0]) / pairs * 1e6, cached, per


def _c_loop_args(snap: dict[str, object]) -> tuple[object, ...]:
    """The arguments `replay` hands the C loop (`_ccore.run`) for `snap`, captured from one replay."""
    module = ccore.loaded()
    got: list[tuple[object, ...]] = []
    proxy = type("Capture", (), {k: getattr(module, k) for k in dir(module) if not k.startswith("__")})
    proxy.run = staticmethod(lambda *a: got.append(a) or module.run(*a))  # type: ignore[attr-defined]
    ccore._module = proxy  # type: ignore[assignment]
    try:
        replay(snap, skip_cycles=False)
    finally:
        ccore._module = module
    return got[0]


def _c_loop_seconds(args: tuple[object, ...], n: int) -> float:
    """Seconds of one `_ccore.run` over the first `n` events (a bump-pointer device: no recording)."""
    top = [1 << 40]

    def malloc(size: int) -> int:
        top[0] += size
        return top[0] - size

    run = ccore.loaded().run  # type: ignore[union-attr]
    call = (args[0], n, *args[2:6], malloc, lambda p: None, *args[8:])
    t0 = time.perf_counter()
    out = run(*call)
    dt = time.perf_counter() - t0
    assert not isinstance(out, str), out
    del out  # (freeing the result is not the loop's time)
    return dt


def _peer_seconds(exe: Path, ops: Path, start: int) -> float:
    got = subprocess.run([str(exe), str(ops), str(start)], check=True, capture_output=True, text=True)
    return float(json.loads(got.stdout)["seconds_after"])


def loops_per_pair(sizes: Sequence[int], pairs: int, rounds: int) -> None:
    """ns per malloc+free pair of the scaling stream, loop against loop: vram's C loop (`_ccore.run`
    over the recorded program's events, the set-up alone subtracted; best of 3) and, on the same op
    stream (allocatorsim_harness.cpp's format, timed from the first pair on), a plain std::set
    best-fit loop (bfc_harness.cpp) and allocatorSim's core (ALLOCATORSIM_SRC). `rounds` rounds,
    each vram then the peers; the median of each, and its ratio to the same loop at the first size."""
    with tempfile.TemporaryDirectory(prefix="bench_allocator_") as tmp:
        work = Path(tmp)
        peers = {"std::set BFC": work / "bfc"}
        subprocess.run(["g++", "-O2", "-std=c++17", str(HERE / "bfc_harness.cpp"), "-o", str(peers["std::set BFC"])],
                       check=True, capture_output=True)
        if os.environ.get("ALLOCATORSIM_SRC"):
            (work / "asim").mkdir()
            peers["allocatorSim"] = build_allocatorsim(Path(os.environ["ALLOCATORSIM_SRC"]), work / "asim")
        names = ["vram C loop", *peers]
        print(f"loop against loop, ns per malloc+free pair (median of {rounds} rounds; x: over the first row)")
        print(f"{'free blocks':>12} " + " ".join(f"{name:>20}" for name in names))
        first: dict[str, float] = {}
        for n in sizes:
            program = _scaling_program(n, pairs)
            start = 3 * n  # (the set-up's ops)
            stream = work / "ops.bin"
            stream.write_bytes(b"".join(struct.pack("<4q", op, k, size, 0) for op, k, size in program))
            setup_events = len(_scaling_trace(n, 0)["device_traces"][0])  # type: ignore[index]
            snap = load_snapshot(pickle.dumps(_scaling_trace(n, pairs)))
            cached = sum(b["state"] == "inactive" for seg in snap["segments"] for b in seg["blocks"])
            args = _c_loop_args(snap)
            got: dict[str, list[float]] = {name: [] for name in names}
            for _ in range(rounds):
                with gc_paused():
                    setup = min(_c_loop_seconds(args, setup_events) for _ in range(3))
                    whole = min(_c_loop_seconds(args, len(snap["device_traces"][0])) for _ in range(3))
                got["vram C loop"].append((whole - setup) / pairs * 1e9)
                for name, exe in peers.items():
                    got[name].append(_peer_seconds(exe, stream, start) / pairs * 1e9)
            cols = []
            for name in names:
                med = sorted(got[name])[rounds // 2]
                first.setdefault(name, med)
                cols.append(f"{med:>12,.0f} ({med / first[name]:.2f}x)")
            print(f"{cached:>12,} " + " ".join(f"{c:>20}" for c in cols), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--loops", action="store_true",
                    help="only the loop-against-loop table (vram's C loop, a std::set BFC, allocatorSim)")
    ap.add_argument("--rounds", type=int, default=3, help="paired rounds of the loop-against-loop table")
    args = ap.parse_args()
    sizes = (10, 100, 1_000, 10_000, 100_000)
    if args.loops:
        if ccore.available() is not None:
            raise SystemExit(f"the C replay core is not used here: {ccore.available()}")
        loops_per_pair(sizes, 20_000 if args.quick else 200_000, args.rounds)
        return
    pairs = 20_000 if args.quick else 200_000
    print(f"Python {sys.version.split()[0]}, allocator: "
          f"{'compiled (mypyc, VRAM_NATIVE)' if native.ACTIVE else 'pure Python'}")
    rate = bench_mixed(pairs)
    print(f"mixed workload: {rate:,.0f} malloc+free pairs/s ({1e6 / rate:.2f} µs per pair)")
    print(f"{'free blocks':>12} {'µs per pair':>12}")
    for n in sizes:
        us, nfree = bench_scaling(n, 5_000 if args.quick else 50_000)
        print(f"{nfree:>12,} {us:>12.2f}")
    if ccore.available() is not None:
        print(f"C replay core not measured: {ccore.available()}")
        return
    print("replayed by the C replay core (vram.replay.ccore); the whole replay() per pair, then the part")
    print("of it in each C entry point: reading the events' dicts, the rewind, the C loop (best of 3 each):")
    print(f"{'free blocks':>12} {'ns per pair':>12} {'scan':>6} {'rewind':>6} {'loop':>6}")
    for n in sizes:
        us, nfree, per = bench_scaling_ccore(n, 20_000 if args.quick else 200_000)
        cols = " ".join(f"{per.get(k, 0) * 1e3:>6.0f}" for k in ("scan", "rewind", "run"))
        print(f"{nfree:>12,} {us * 1e3:>12.0f} {cols}")


if __name__ == "__main__":
    main()
