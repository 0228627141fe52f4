"""Replay speed on a large real trace: load time, events/s and peak RSS, vs two peer simulators.

Run: ``python3 benchmarks/bench_replay.py`` (``--quick`` for ~100k events, ``--passes N``).

The trace is cs336-s-forward-bf16-128.pickle (steady state: 937 alloc / 937 free_requested /
937 free_completed per pass, end state = start state) repeated N times: every entry a distinct
dict with ``time_us`` shifted by one pass length per pass, frame lists shared within a pass as in
the recording, frame dicts shared across passes (as torch interns them). Each measurement runs in
a fresh subprocess, so peak RSS (``ru_maxrss`` of that process: load + replay) is honest.

Comparison peer: awslabs/optimizing-multitask-training-through-dynamic-pipelines,
``dynapipe/memory_opt/allocation_simulator.py`` (needs ``sortedcontainers``). Set DYNAPIPE_SRC to
a directory holding that repository's ``dynapipe/`` (only that one module is loaded, by path) to
replay the same alloc/free sequence through it: same sizes, same order, frees matched by recorded
address; events counted as alloc + free_requested + free_completed.

Second peer: allocatorSim's C++ core (github.com/Lin-Mao/allocatorSim, ``src/allocator_simulator.cpp``).
Set ALLOCATORSIM_SRC to a checkout: its sources are copied to a temporary folder, the debug copies
removed (every ``auto *_info = std::make_tuple(...)`` and ``DumpDebugging::dumpDebuggingInfo(...)``
statement: they copy both block pools and the segment map on every malloc/free), and
``allocatorsim_harness.cpp`` is compiled against them (``g++ -O2``). It gets the same op stream as
dynapipe's simulator, as a file of int64 quadruples; its time is its replay loop only (not reading
that file, nor making the stream out of the recording), and the events counted the same way. So
that both sides do the same work, the ratios compare it three ways: vram's whole ``replay()``
against that loop alone; against that loop plus reading the same events out of the recording's
dicts with vram's reader (``ccore.scan``, timed in the allocatorSim child on the same loaded
trace: allocatorSim has no reader of PyTorch snapshots, and this is the fastest we have); and
vram's C loop alone (``_ccore.run``: state in, every event over the op array, state out) against
allocatorSim's loop alone, both over an op array built beforehand.

vram's rows: ``seconds`` is what ``replay()`` reports: everything the caller waits for after the
load (rewind to the first event, state import, every event, verification). Replays run the C
replay core (`vram.replay.ccore`) where it is built and models them (the notes say which engine
ran); the every-event rows are measured again without it (``[no C core]``: ``VRAM_CCORE=0``). When
the compiled allocator is built (``python3 -m vram.allocator.native_build``), every replay row is
measured again with ``VRAM_NATIVE=1``. Where the C core ran, the notes split its time: reading the
events (``scan``), the rewind, the C loop (``run``); the rest is Python around them. Ratios at
the end compare events/s of the every-event replay with the peers', from this one run.
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import pickle
import platform
import re
import resource
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from vram.allocator.native import DEFAULT_DIR, _unusable  # noqa: E402
from vram.replay import ccore  # noqa: E402
from vram.replay.engine import UNLIMITED, replay  # noqa: E402
from vram.replay.loader import load_snapshot  # noqa: E402
from vram.replay.safe_pickle import gc_paused  # noqa: E402

TRACES = Path(os.environ.get("VRAM_TRACES", Path(__file__).resolve().parents[2] / "shared" / "traces"))
PERIODIC = TRACES / "cs336-s-forward-bf16-128.pickle"
SMALL = TRACES / "ftcourse-memory-snapshot.pickle"
DYNAPIPE_MODULE = Path("dynapipe") / "memory_opt" / "allocation_simulator.py"
ALLOCATORSIM_FILES = ("src/allocator_simulator.cpp", "src/allocator_config.cpp", "src/allocator_profiler.cpp",
                      "src/allocator_utils.cpp")
HARNESS = Path(__file__).resolve().with_name("allocatorsim_harness.cpp")
ALLOC_FREE = ("alloc", "free_requested", "free_completed")


class _PlainUnpickler(pickle.Unpickler):
    """Recordings are plain data: refuse every global, so nothing callable can be built."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


def build_big_trace(passes: int, target: int, out: Path) -> dict[str, Any]:
    """Write the periodic recording repeated `passes` times (0: enough for `target` events)."""
    t0 = time.perf_counter()
    with open(PERIODIC, "rb") as f:
        snap: dict[str, Any] = _PlainUnpickler(f).load()
    trace: list[dict[str, Any]] = snap["device_traces"][0]
    passes = passes or -(-target // len(trace))
    times = [e["time_us"] for e in trace]
    period = max(times) - min(times) + 1
    big: list[dict[str, Any]] = []
    for k in range(passes):
        lists: dict[int, list[Any]] = {}  # one new frame list per distinct list in the pass
        for e in trace:
            fr = e["frames"]
            copy = lists.get(id(fr))
            if copy is None:
                copy = lists[id(fr)] = list(fr)
            big.append({**e, "time_us": e["time_us"] + k * period, "frames": copy})
    snap["device_traces"] = [big]
    with open(out, "wb") as f:
        pickle.dump(snap, f)
    return {"passes": passes, "events": len(big), "bytes": out.stat().st_size,
            "seconds": time.perf_counter() - t0}


def _native_unusable() -> str | None:
    return _unusable(DEFAULT_DIR)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _load_dynapipe() -> Any:
    src = os.environ["DYNAPIPE_SRC"]
    spec = importlib.util.spec_from_file_location("dynapipe_allocation_simulator",
                                                  Path(src) / DYNAPIPE_MODULE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def build_allocatorsim(src: Path, out: Path) -> Path:
    """allocatorSim's core without its debug copies, with our harness, compiled into `out`."""
    shutil.copytree(src / "include", out / "include")
    sources = []
    for name in ALLOCATORSIM_FILES:
        text = (src / name).read_text()
        if name.endswith("allocator_simulator.cpp"):
            text = re.sub(r"\n\s*auto \w+_info = std::make_tuple\([^;]*\);", "\n", text)
            text = re.sub(r"\n\s*DumpDebugging::dumpDebuggingInfo\([^;]*?\);", "\n", text)
            assert "DumpDebugging" not in text, "allocatorSim changed: its debug calls were not all removed"
        (out / Path(name).name).write_text(text)
        sources.append(str(out / Path(name).name))
    exe = out / "allocatorsim"
    subprocess.run(["g++", "-O2", "-std=c++17", "-I", str(out / "include"), str(HARNESS), *sources, "-o", str(exe)],
                   check=True, capture_output=True)
    return exe


def peer_ops(trace: list[dict[str, Any]]) -> tuple[list[tuple[str, int, Any]], int]:
    """The op stream the peers replay: a malloc per alloc, a free per free_completed of a block
    allocated in the trace (the peers start empty); and how many frees were left out."""
    ops: list[tuple[str, int, Any]] = []
    live: dict[int, int] = {}  # recorded address -> malloc number
    unmatched = 0
    for e in trace:
        action = e["action"]
        if action == "alloc":
            live[e["addr"]] = len(ops)
            ops.append(("malloc", e["size"], e["stream"]))
        elif action == "free_completed":  # the memory returns to the cache here
            k = live.pop(e["addr"], None)
            if k is None:
                unmatched += 1  # allocated before the recording began
            else:
                ops.append(("free", k, None))
    return ops, unmatched


def _time_ccore(parts: dict[str, float]) -> None:
    """Time the C core's entry points (summed into `parts` by name) for this process's replays."""
    module = ccore.loaded()
    if module is None:
        return
    def timer(name: str) -> Any:
        f = getattr(module, name)

        def wrapped(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return f(*args)
            finally:
                parts[name] = parts.get(name, 0.0) + time.perf_counter() - t0
        return wrapped

    timed = {name: timer(name) for name in ("scan", "rewind", "run")}
    proxy = type("TimedCCore", (), {k: getattr(module, k) for k in dir(module) if not k.startswith("__")})
    for name, f in timed.items():
        setattr(proxy, name, staticmethod(f))
    ccore._module = proxy  # type: ignore[assignment]  # (`ccore.loaded()` hands this out)


def child(kind: str, path: str) -> dict[str, Any]:
    """One measurement, in this (fresh) process. A kind starting ``python:`` replays without the
    C replay core (``VRAM_CCORE=0``)."""
    if kind.startswith("python:"):
        os.environ[ccore.ENV] = "0"
        kind = kind.removeprefix("python:")
    if kind == "pickle":  # the yardstick for load_snapshot: a plain pickle.load, collector on
        t0 = time.perf_counter()
        with open(path, "rb") as f:
            data = pickle.load(f)
        return {"events": len(data["device_traces"][0]), "seconds": time.perf_counter() - t0,
                "rss_load": _rss_mib(), "rss_peak": _rss_mib()}
    t0 = time.perf_counter()
    snap = load_snapshot(path)
    load_s = time.perf_counter() - t0
    out: dict[str, Any] = {"load_s": load_s, "rss_load": _rss_mib()}
    if kind == "load":
        out.update(events=len(snap["device_traces"][0]), seconds=load_s)
    elif kind.startswith("dynapipe"):
        mod = _load_dynapipe()
        cfg = mod.TorchCachingAllocatorConfig()
        if kind == "dynapipe-small":
            cfg.kSmallSize = 1 << 20  # PyTorch's small pool; its default (0) puts all in large
        sim = mod.TorchCachingAllocatorSimulator(UNLIMITED / 1e6, cfg)  # takes 10^6-byte MB
        trace = snap["device_traces"][0]
        ops, unmatched = peer_ops(trace)
        malloc, free = sim.malloc, sim.free
        blocks: list[Any] = [None] * len(ops)
        t0 = time.perf_counter()
        with gc_paused():  # as vram's replay runs (see `vram.replay.safe_pickle.gc_paused`)
            for k, (op, a, b) in enumerate(ops):
                if op == "malloc":
                    blocks[k] = malloc(a, b)
                else:
                    free(blocks[a])
        out["seconds"] = time.perf_counter() - t0
        out["events"] = sum(1 for e in trace if e["action"] in ALLOC_FREE)
        out["peak_reserved"] = sim.peak_backend_allocated_bytes
        out["note"] = f"{len(ops):,} malloc+free calls; {unmatched} frees of pre-trace blocks skipped; starts empty"
    elif kind == "allocatorsim":
        trace = snap["device_traces"][0]
        ops, unmatched = peer_ops(trace)
        with tempfile.TemporaryDirectory(prefix="allocatorsim_") as tmp:
            exe = build_allocatorsim(Path(os.environ["ALLOCATORSIM_SRC"]), Path(tmp))
            stream = Path(tmp) / "ops.bin"
            stream.write_bytes(b"".join(struct.pack("<4q", 0, k, a, b) if op == "malloc" else
                                        struct.pack("<4q", 1, a, 0, 0) for k, (op, a, b) in enumerate(ops)))
            got = json.loads(subprocess.run([str(exe), str(stream)], check=True, capture_output=True,
                                            text=True).stdout)
        out["seconds"] = got["seconds"]
        out["events"] = sum(1 for e in trace if e["action"] in ALLOC_FREE)
        out["peak_reserved"] = got["peak_reserved"]
        out["note"] = f"{got['ops']:,} malloc+free calls (C++, -O2, debug copies removed); starts empty"
        if ccore.loaded() is not None:  # reading the same events out of the dicts, as vram does
            read = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                ccore.scan(trace)
                read = min(read, time.perf_counter() - t0)
            out["read_s"] = read
            out["note"] += f"; reading the events with ccore.scan: {read:.3f} s (best of 3)"
    else:
        base, noskip = kind.removesuffix("-noskip"), kind.endswith("-noskip")
        conf = "expandable_segments:True" if base == "expandable" else None
        kw: dict[str, Any] = {"skip_cycles": False} if noskip else {}
        parts: dict[str, float] = {}
        _time_ccore(parts)
        r = replay(snap, gpu=None, conf=conf, verify=base == "verify", **kw)
        out.update(events=r.events, seconds=r.seconds_replay, peak_reserved=r.peak_reserved)
        notes = [f"engine: {r.engine}"]
        if r.engine == "C":
            out["parts"] = parts
            notes.append(", ".join(f"{k} {v:.3f} s" for k, v in parts.items()))
        if getattr(r, "skipped_events", 0):
            notes.append(f"{r.skipped_events:,} events skipped as repeated cycles")
        if r.verification is not None:
            v = r.verification
            notes.append(f"alloc addresses {v['alloc_addresses']['matched']:,}/"
                         f"{v['alloc_addresses']['total']:,} matched, final blocks "
                         f"{v['final_blocks']['matched']}/{v['final_blocks']['total']}")
        out["note"] = "; ".join(notes)
    out["rss_peak"] = _rss_mib()
    return out


def measure(kind: str, path: Path, *extra: str, native: bool = False) -> dict[str, Any]:
    """Run `child` in a fresh process. The parent stays small: on Linux a child's ru_maxrss
    includes its parent's RSS at the fork, so even the big trace is built in a child. `native`:
    with the compiled allocator (VRAM_NATIVE=1), which the child must then be running."""
    env = {k: v for k, v in os.environ.items() if k not in ("VRAM_NATIVE", ccore.ENV)}
    if native:
        env["VRAM_NATIVE"] = "1"
    proc = subprocess.run([sys.executable, __file__, *extra, "--child", kind, str(path)],
                          capture_output=True, text=True, env=env)
    if native and "pure-Python allocator" in proc.stderr:
        raise SystemExit(f"VRAM_NATIVE=1 did not take effect:\n{proc.stderr}")
    if proc.returncode != 0:
        raise SystemExit(f"child {kind} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def row(name: str, m: dict[str, Any], rate: bool = True) -> str:
    peak = f"{m['peak_reserved'] / 2**30:.2f}" if "peak_reserved" in m else "—"
    eps = f"{m['events'] / m['seconds']:,.0f}" if rate else "—"
    return (f"| {name} | {m['events']:,} | {m['seconds']:.2f} | {eps} | {m['rss_load']:,.0f} | "
            f"{m['rss_peak']:,.0f} | {peak} | {m.get('note', '')} |")


def _same_work(trace_name: str, ours: dict[str, Any], asim: dict[str, Any]) -> None:
    """The allocatorSim ratios with the same work on both sides (see the module's doc)."""
    if "read_s" in asim:
        both = asim["seconds"] + asim["read_s"]
        print(f"{trace_name}: whole `replay()` / (allocatorSim's loop + reading the events with ccore.scan): "
              f"{both / ours['seconds']:.3f}x events/s ({ours['seconds']:.3f} s against "
              f"{asim['seconds']:.3f} + {asim['read_s']:.3f} s)")
    if "run" in ours.get("parts", {}):
        loop = ours["parts"]["run"]
        print(f"{trace_name}: vram's C loop (`_ccore.run`) / allocatorSim's loop, both over a prebuilt op array: "
              f"{asim['seconds'] / loop:.3f}x events/s ({loop:.3f} s against {asim['seconds']:.3f} s)")


def _paired_rounds(big: Path, rounds: int, dyn: bool, asim: bool) -> None:
    """The headline ratios again, from `rounds` rounds each measuring the every-event C replay and
    then each peer on the big trace (fresh processes, back to back), so that a load spike on this
    shared machine moves one round, not the figure: each round's ratios, then their median."""
    print("\nPaired rounds (big trace; each round: vram's every-event replay, then each peer):")
    per: dict[str, list[float]] = {}
    for k in range(rounds):
        ours = measure("default-noskip", big)
        line = [f"round {k + 1}: replay() {ours['seconds']:.3f} s"]
        if dyn:
            d = measure("dynapipe-small", big)
            per.setdefault("dynapipe (kSmallSize 1 MiB)", []).append(d["seconds"] / ours["seconds"])
            line.append(f"dynapipe {d['seconds']:.3f} s")
        if asim:
            a = measure("allocatorsim", big)
            per.setdefault("allocatorSim, its loop alone", []).append(a["seconds"] / ours["seconds"])
            line.append(f"allocatorSim {a['seconds']:.3f} s")
            if "read_s" in a:
                per.setdefault("allocatorSim, its loop + reading the events (ccore.scan)", []).append(
                    (a["seconds"] + a["read_s"]) / ours["seconds"])
                line.append(f"+ reading {a['read_s']:.3f} s")
            if "run" in ours.get("parts", {}):
                per.setdefault("allocatorSim's loop, against vram's C loop alone", []).append(
                    a["seconds"] / ours["parts"]["run"])
                line.append(f"(vram's C loop {ours['parts']['run']:.3f} s)")
        print("; ".join(line), flush=True)
    for name, ratios in per.items():
        ratios.sort()
        print(f"vram / {name}: median {ratios[len(ratios) // 2]:.3f}x events/s "
              f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--passes", type=int, help="repetitions of the trace (default: ≥ 1M events)")
    ap.add_argument("--quick", action="store_true", help="about 100k events")
    ap.add_argument("--rounds", type=int, default=3,
                    help="paired rounds (C replay, then each peer, alternating) for the median ratios")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    target = 100_000 if args.quick else 1_000_000
    if args.child:
        kind, path = args.child
        if kind == "build":
            print(json.dumps(build_big_trace(args.passes or 0, target, Path(path))))
        else:
            print(json.dumps(child(kind, path)))
        return
    dyn = os.environ.get("DYNAPIPE_SRC")
    asim = os.environ.get("ALLOCATORSIM_SRC")
    can_skip = "skip_cycles" in inspect.signature(replay).parameters
    if dyn and not (Path(dyn) / DYNAPIPE_MODULE).is_file():
        raise SystemExit(f"DYNAPIPE_SRC={dyn} has no {DYNAPIPE_MODULE}")
    if asim and not all((Path(asim) / name).is_file() for name in ALLOCATORSIM_FILES):
        raise SystemExit(f"ALLOCATORSIM_SRC={asim} lacks {', '.join(ALLOCATORSIM_FILES)}")
    compiled = _native_unusable() is None
    has_c = ccore.available() is None
    cmd = shlex.join([Path(sys.executable).name, *sys.argv])
    envs = "".join(f"{k}={v} " for k, v in (("DYNAPIPE_SRC", dyn), ("ALLOCATORSIM_SRC", asim)) if v)
    print(f"Command: `{envs}{cmd}`")
    print(f"Python {platform.python_version()} on {platform.machine()} "
          f"({os.cpu_count()} CPUs), {platform.platform(terse=True)}\n")
    with tempfile.TemporaryDirectory(prefix="bench_replay_") as tmp:
        big = Path(tmp) / "big.pickle"
        b = measure("build", big, *sys.argv[1:])
        print(f"Big trace: {PERIODIC.name} x {b['passes']} passes = {b['events']:,} events, "
              f"pickle {b['bytes'] / 2**20:,.1f} MiB (built and written in {b['seconds']:.1f} s)\n")
        runs: list[tuple[str, str, Path, bool]] = [("plain pickle.load (big)", "pickle", big, False),
                                                   ("load_snapshot (big)", "load", big, False)]
        for native in (False, True) if compiled else (False,):
            tag = " [compiled]" if native else ""
            for name, kind in (("default config", "default"), ("verify=True", "verify"),
                               ("expandable_segments:True", "expandable")):
                runs.append((f"replay{tag}, {name}", kind, big, native))
                if can_skip:  # every event replayed: the like-for-like figure for the peers
                    runs.append((f"replay{tag}, {name}, skip_cycles=False", f"{kind}-noskip", big, native))
                    if has_c and not native:
                        runs.append((f"replay [no C core], {name}, skip_cycles=False", f"python:{kind}-noskip",
                                     big, native))
            runs.append((f"replay{tag}, {SMALL.name}", "default-noskip", SMALL, native))
            if has_c and not native:
                runs.append((f"replay [no C core], {SMALL.name}", "python:default-noskip", SMALL, native))
        if dyn:
            runs += [("dynapipe simulator (its defaults)", "dynapipe", big, False),
                     ("dynapipe simulator, kSmallSize=1 MiB", "dynapipe-small", big, False),
                     (f"dynapipe simulator, {SMALL.name}", "dynapipe-small", SMALL, False)]
        if asim:
            runs += [("allocatorSim C++ core", "allocatorsim", big, False),
                     (f"allocatorSim C++ core, {SMALL.name}", "allocatorsim", SMALL, False)]
        print("| measurement | events | seconds | events/s | RSS after load (MiB) | "
              "peak RSS (MiB) | peak reserved (GiB) | notes |")
        print("|---|---:|---:|---:|---:|---:|---:|---|")
        rates: dict[str, float] = {}
        loads: dict[str, dict[str, Any]] = {}
        got: dict[str, dict[str, Any]] = {}
        for name, kind, path, native in runs:
            m = got[name] = measure(kind, path, native=native)
            rates[name] = m["events"] / m["seconds"]
            if kind in ("load", "pickle"):
                loads[kind] = m
            print(row(name, m, rate=kind not in ("load", "pickle")), flush=True)
        print()
        load, plain = loads["load"], loads["pickle"]
        print(f"load_snapshot / plain pickle.load: {load['seconds'] / plain['seconds']:.2f}x time, "
              f"{load['rss_peak'] / plain['rss_peak']:.2f}x peak RSS")
        pairs = [("replay{}, default config, skip_cycles=False", "{}", big.name),
                 (f"replay{{}}, {SMALL.name}", f"{{}}, {SMALL.name}", SMALL.name)]
        for ours, peer, trace_name in pairs:
            for tag in ("", " [no C core]", " [compiled]"):
                for name in ("dynapipe simulator, kSmallSize=1 MiB" if trace_name == big.name
                             else "dynapipe simulator", "allocatorSim C++ core"):
                    a, b = ours.format(tag), peer.format(name)
                    if a in rates and b in rates:
                        print(f"{trace_name}: `{a}` / `{b}`: {rates[a] / rates[b]:.3f}x events/s")
                    if tag == "" and "allocatorSim" in b and a in got and b in got:
                        _same_work(trace_name, got[a], got[b])
        if (dyn or asim) and has_c and can_skip and args.rounds > 0:
            _paired_rounds(big, args.rounds, dyn is not None, asim is not None)
    if not dyn:
        print("\ndynapipe comparison skipped: set DYNAPIPE_SRC to a checkout of "
              "awslabs/optimizing-multitask-training-through-dynamic-pipelines (the directory "
              f"holding {DYNAPIPE_MODULE}; needs sortedcontainers) to enable it.")
    if not asim:
        print("\nallocatorSim comparison skipped: set ALLOCATORSIM_SRC to a checkout of Lin-Mao/allocatorSim "
              "(needs g++) to enable it.")
    if not compiled:
        print(f"\ncompiled allocator not measured: {_native_unusable()}")
    if not has_c:
        print(f"\nC replay core not measured: {ccore.available()}")


if __name__ == "__main__":
    main()
