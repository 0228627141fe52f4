"""Hostile and adversarial-size snapshots: time, peak RSS and outcome of each.

Run: ``python3 benchmarks/bench_adversarial.py`` (``--quick`` for smaller files, ``--only NAME``,
``--src DIR`` to measure another checkout's ``src``, e.g. the previous commit's, for a
before/after table; ``--timeout S``, ``--memory GiB``).

Every case is built programmatically (pickle opcodes by hand where the pickler would not write
them) and run as ``vram replay FILE --verify`` (or the command named) in a fresh subprocess
under an address-space limit, so a crash, a hang or a memory blow-up is measured, not suffered.
The figures the issue asks for: every case ends in well under a second or two with one line on
stderr and exit status 2 (refused) or 0 (accepted and replayed), never a signal, a traceback or
a timeout, and peak RSS stays in proportion to the file.
"""
from __future__ import annotations

import argparse
import os
import pickle
import platform
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hostile_files import deep_tuple, short_str, snapshot_opcodes  # noqa: E402 - the tests' file builders

ROOT = Path(__file__).resolve().parents[1]
TRACES = Path(os.environ.get("VRAM_TRACES", ROOT.parent / "shared" / "traces"))
MiB = 1 << 20


def case_deep_key_settings(scale: int) -> bytes:
    """allocator_settings = {<tuple nested 200,000 deep>: 1}: hashing the key recurses in C."""
    return snapshot_opcodes(settings=deep_tuple(200_000 * scale) + b"K\x01")


def case_deep_key_frame(scale: int) -> bytes:
    entry = (b"}(" + short_str("action") + short_str("alloc") + short_str("addr") + b"K\x00"
             + short_str("size") + b"K\x01"
             + short_str("frames") + b"]}(" + deep_tuple(200_000 * scale) + b"K\x01ua" + b"u")
    return snapshot_opcodes(entries=entry)


def case_deep_frozenset(scale: int) -> bytes:
    """{"x": frozenset({<deep tuple>})}: FROZENSET hashes its members."""
    return snapshot_opcodes(settings=short_str("x") + b"(" + deep_tuple(200_000 * scale) + b"\x91")


def case_deep_key_10k(scale: int) -> bytes:
    return snapshot_opcodes(settings=deep_tuple(10_000) + b"K\x01")


def _shared_bomb() -> Any:
    x: Any = "z"
    for _ in range(9):
        x = [x] * 10  # 10 references at each of 9 levels: 10**9 leaves from ~1 KB
    return x


def _segment(address: int, total: int, blocks: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    return {"device": 0, "address": address, "total_size": total, "stream": 0,
            "segment_type": "small" if total == 2 * MiB else "large", "is_expandable": False,
            "frames": [], "blocks": blocks, **kw}


def case_shared_segment_type(scale: int) -> bytes:
    seg = _segment(0x7F0000000000, 20 * MiB, [{"size": 20 * MiB, "state": "inactive"}],
                   segment_type=_shared_bomb())
    return pickle.dumps({"segments": [seg], "device_traces": [[]]})


def case_shared_block_state(scale: int) -> bytes:
    seg = _segment(0x7F0000000000, 20 * MiB, [{"size": 20 * MiB, "state": _shared_bomb()}])
    return pickle.dumps({"segments": [seg], "device_traces": [[]]})


def case_huge_int(scale: int) -> bytes:
    seg = _segment(7**20000, 20 * MiB, [{"size": 20 * MiB, "state": "inactive"}])
    return pickle.dumps({"segments": [seg], "device_traces": [[]]})


def case_shared_entry(scale: int) -> bytes:
    """One trace entry dict referenced 1.5M x scale times (BINGET refs, ~2 bytes each)."""
    entry = {"action": "alloc", "addr": 0x7F0000000000, "size": 512, "stream": 0, "time_us": 1,
             "frames": [], "compile_context": "N/A"}
    return pickle.dumps({"segments": [], "device_traces": [[entry] * (1_500_000 * scale)]})


def case_memo_fallback_bomb(scale: int) -> bytes:
    """Millions of empty dicts, then a memo index the C unpickler cannot hold: the pure-Python
    unpickler decodes the whole file again (it used to, without any memory guard)."""
    n = 10_000_000 * scale
    return b"\x80\x04](" + b"}" * n + b"er\xff\xff\xff\x7f."


def case_json_bomb(scale: int) -> bytes:
    return b"[" + b"{}," * (5_000_000 * scale) + b"{}]"


def case_json_deep(scale: int) -> bytes:
    return b"[" * 100_000 + b"]" * 100_000


def _alloc(t: int, addr: int, size: int, action: str = "alloc", stream: int = 0) -> dict[str, Any]:
    return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": t, "frames": []}


def case_reserved_peaks(scale: int) -> bytes:
    """80k allocations of 10 MiB + 1 B, each a new 12 MiB segment leaving a 2 MiB free tail:
    every one raises the reserved peak while the free blocks pile up."""
    n = 40_000 * scale
    trace = [_alloc(t, 0x10000000000 + t * 16 * MiB, 10 * MiB + 1) for t in range(n)]
    return pickle.dumps({"segments": [], "device_traces": [trace]})


def case_many_streams_peaks(scale: int) -> bytes:
    """Allocate and free a 1 MiB + 1 B block on each of 25k streams: every stream keeps a free
    20 MiB segment and every allocation raises the reserved peak."""
    trace = []
    for k in range(12_500 * scale):
        addr = 0x10000000000 + k * 32 * MiB
        trace += [_alloc(3 * k, addr, MiB + 1, stream=k + 1),
                  _alloc(3 * k + 1, addr, MiB + 1, "free_requested", k + 1),
                  _alloc(3 * k + 2, addr, MiB + 1, "free_completed", k + 1)]
    return pickle.dumps({"segments": [], "device_traces": [trace]})


def case_rewind_segments(scale: int) -> bytes:
    """50k segments, each created in the trace (a segment_alloc per segment)."""
    n = 50_000 * scale
    base = 0x10000000000
    segs = [_segment(base + k * 32 * MiB, 20 * MiB, [{"address": base + k * 32 * MiB, "size": 20 * MiB,
                                                      "requested_size": 0, "state": "inactive", "frames": []}],
                     allocated_size=0, active_size=0, requested_size=0) for k in range(n)]
    trace = [_alloc(k, base + k * 32 * MiB, 20 * MiB, "segment_alloc") for k in range(n)]
    return pickle.dumps({"segments": segs, "device_traces": [trace]})


def case_held_back_frees(scale: int) -> bytes:
    """20k frees held back (free_requested now, free_completed much later, in reverse order)
    with 20k allocations in between: one pseudo stream each used to make every malloc visit all."""
    n = 10_000 * scale
    base = 0x10000000000
    trace = [_alloc(k, base + k * 1024, 1000) for k in range(n)]
    trace += [_alloc(n + k, base + k * 1024, 1000, "free_requested") for k in range(n)]
    trace += [_alloc(2 * n + k, base + (n + k) * 1024, 1000) for k in range(n)]
    trace += [_alloc(3 * n + k, base + (n - 1 - k) * 1024, 1000, "free_completed") for k in range(n)]
    return pickle.dumps({"segments": [], "device_traces": [trace]})


def case_shared_stack(scale: int) -> bytes:
    """10k blocks whose allocation stack is one shared 10k-frame list (PyTorch shares frame
    lists too): copying it per block would be 10**8 references."""
    n = 10_000 * scale
    stack = [{"filename": "model.py", "line": 1, "name": "forward"}] * n
    base = 0x7F0000000000
    segs = [_segment(base + k * 2 * MiB, 2 * MiB,
                     [{"address": base + k * 2 * MiB, "size": MiB, "requested_size": MiB,
                       "state": "active_allocated", "frames": stack},
                      {"address": base + k * 2 * MiB + MiB, "size": MiB, "requested_size": 0,
                       "state": "inactive", "frames": []}],
                     allocated_size=MiB, active_size=MiB, requested_size=MiB) for k in range(n)]
    return pickle.dumps({"segments": segs, "device_traces": [[]]})


def case_export_shared_trace(scale: int) -> bytes:
    """1,000 references to one 200k-entry trace (`vram export` used to copy it 1,000 times)."""
    trace = [_alloc(t, 0x7F0000000000 + t * 512, 512) for t in range(200_000 * scale)]
    return pickle.dumps({"segments": [], "device_traces": [trace] * 1000})


def case_synthetic_window(scale: int) -> bytes:
    """50k segments at addresses inside the window TraceDevice draws synthetic addresses from
    (vram.devices.trace): each adoption splits a hole of its virtual-address map."""
    n = 50_000 * scale
    base = 0x4000_0000_0000
    segs = [_segment(base + k * 4 * MiB, 2 * MiB, [{"address": base + k * 4 * MiB, "size": 2 * MiB,
                                                    "requested_size": 0, "state": "inactive", "frames": []}],
                     allocated_size=0, active_size=0, requested_size=0) for k in range(n)]
    return pickle.dumps({"segments": segs, "device_traces": [[]]})


def case_terminal_escapes(scale: int) -> bytes:
    evil = "\x1b]0;pwned\x07\x1b[2J\x1b[H\nFAKE: all good\r\u202e"
    frames = [{"filename": evil + ".py", "line": 1, "name": evil}]
    trace = [dict(_alloc(0, 0x7F0000000000, 1 << 50), frames=frames)]
    return pickle.dumps({"segments": [], "device_traces": [trace]})


def _settings(items: bytes) -> bytes:
    """A snapshot whose allocator_settings dict is built by the raw opcodes `items` (on the dict)."""
    return snapshot_opcodes()[:-2] + short_str("allocator_settings") + b"}" + items + b"u."


def case_tuple_dag_key(scale: int) -> bytes:
    """allocator_settings = {t30: 1}, t0 = ("x",), t(k+1) = (t(k), t(k)) put in the memo and fetched
    back: 2**30 leaves in ~200 bytes, which hashing walks one by one (about 60 s)."""
    out = short_str("x") + b"\x85q\x00"
    for k in range(30):
        out += b"h" + bytes([k]) + b"\x86q" + bytes([k + 1])
    return _settings(out + b"K\x01s")


def case_int_key_flood(scale: int) -> bytes:
    """40k distinct int keys k * (2**61 - 1): all hash to 0, so each insertion compares with all before."""
    p = (1 << 61) - 1
    keys = b"".join(pickle.dumps(k * p, protocol=4)[2:-1] + b"N" for k in range(1, 40_000 * scale + 1))
    return _settings(b"(" + keys + b"u")


def case_equal_str_keys(scale: int) -> bytes:
    """A 1 MB str key, then an equal but distinct str set 200k times: each compares all 1 MB."""
    big = b"X" + (1 << 20).to_bytes(4, "little") + b"s" * (1 << 20)
    return _settings(big + b"q\x00Ns" + big + b"q\x01Ns" + b"h\x01Ns" * (200_000 * scale))


def case_recorded_ooms(scale: int) -> bytes:
    """A 256 MiB tensor, then 8k recorded OOMs of 8 GiB (a script retrying): with expandable
    segments each leaves a reserved range behind, which every later search walked."""
    trace = [_alloc(0, 0x7F0000000000, 256 * MiB)]
    trace += [{"action": "oom", "device_free": 512 * MiB, "size": 8 << 30, "stream": 0, "time_us": k + 1}
              for k in range(4_000 * scale)]
    return pickle.dumps({"segments": [], "device_traces": [trace]})


#: name ({n}: the count at scale 1, times the scale) -> (builder, vram arguments)
CASES: dict[str, tuple[Callable[[int], bytes], list[str]]] = {
    "deep tuple key 200k (settings)": (case_deep_key_settings, ["replay", "--verify"]),
    "deep tuple key 200k (frame)": (case_deep_key_frame, ["replay", "--verify"]),
    "deep tuple in frozenset 200k": (case_deep_frozenset, ["replay", "--verify"]),
    "deep tuple key 10k": (case_deep_key_10k, ["replay", "--verify"]),
    "shared-ref list as segment_type": (case_shared_segment_type, ["replay", "--verify"]),
    "shared-ref list as block state": (case_shared_block_state, ["replay", "--verify"]),
    "address 7**20000": (case_huge_int, ["replay", "--verify"]),
    "one entry referenced {n} times": (case_shared_entry, ["replay", "--verify"]),
    "{n} empty dicts + memo bomb": (case_memo_fallback_bomb, ["replay", "--verify"]),
    "JSON: {n} empty dicts": (case_json_bomb, ["replay", "--verify"]),
    "JSON nested 100k deep": (case_json_deep, ["replay", "--verify"]),
    "{n} reserved peaks, growing free list": (case_reserved_peaks, ["replay", "--verify"]),
    "{n} streams, a peak on each": (case_many_streams_peaks, ["replay", "--verify"]),
    "{n} segment_alloc to rewind": (case_rewind_segments, ["replay", "--verify"]),
    "{n} held-back frees, reverse order": (case_held_back_frees, ["replay", "--verify"]),
    "{n} blocks sharing a {n}-frame stack": (case_shared_stack, ["replay", "--verify"]),
    "export: 1,000 refs to a {n}-entry trace": (case_export_shared_trace, ["export", "-o", "{out}"]),
    "{n} segments inside the synthetic address window": (case_synthetic_window, ["replay", "--verify"]),
    "terminal escapes in an OOM stack": (case_terminal_escapes, ["replay", "--gpu", "1GiB"]),
    "tuple key of 2**30 leaves from memo fetches": (case_tuple_dag_key, ["replay", "--verify"]),
    "{n} int keys sharing one hash": (case_int_key_flood, ["replay", "--verify"]),
    "a 1 MB str key set again {n} times": (case_equal_str_keys, ["replay", "--verify"]),
    "{n} recorded OOMs, expandable segments": (case_recorded_ooms, ["replay", "--gpu", "1GiB", "--conf",
                                                                     "expandable_segments:True"]),
}
COUNTS = {"case_shared_entry": 1_500_000, "case_memo_fallback_bomb": 10_000_000, "case_json_bomb": 5_000_000,
          "case_reserved_peaks": 40_000, "case_many_streams_peaks": 12_500, "case_rewind_segments": 50_000,
          "case_held_back_frees": 10_000, "case_shared_stack": 10_000, "case_export_shared_trace": 200_000,
          "case_synthetic_window": 50_000, "case_int_key_flood": 40_000, "case_equal_str_keys": 200_000,
          "case_recorded_ooms": 4_000}
FILES = {  # cases that are paths, not built bytes
    "/dev/zero": ("/dev/zero", ["replay"]),
    "sparse 3 GiB file": ("{sparse}", ["replay"]),
}


def run_case(src: Path, argv: list[str], timeout: float, memory: int) -> dict[str, Any]:
    """`vram ARGV` in a fresh process: seconds, peak RSS (MiB), exit status, last stderr line."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from vram.cli.commands import main; "
            "sys.exit(main(sys.argv[2:]))")

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code, str(src), *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, preexec_fn=limit)
    status, usage, timed_out = 0, None, False
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() - t0 > timeout:
            proc.kill()
            _, status, usage = os.wait4(proc.pid, 0)
            timed_out = True
            break
        time.sleep(0.02)
    seconds = time.perf_counter() - t0
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    lines = err.strip().splitlines()
    if timed_out:
        outcome = f"TIMEOUT > {timeout:.0f} s"
    elif os.WIFSIGNALED(status):
        outcome = f"killed by signal {os.WTERMSIG(status)}"
    else:
        rc = os.WEXITSTATUS(status)
        traceback = any(line.startswith("Traceback") for line in lines)
        outcome = f"exit {rc}" + (", traceback" if traceback else "") + (
            f", {len(lines)} stderr lines" if len(lines) > 1 else "")
    return {"seconds": seconds, "rss": usage.ru_maxrss / 1024 if usage else 0.0, "outcome": outcome,
            "message": (lines[-1] if lines else "")[:150]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", type=Path, default=ROOT / "src", help="the src/ directory to measure")
    ap.add_argument("--quick", action="store_true", help="smaller adversarial-size files")
    ap.add_argument("--only", help="run the cases whose name contains this")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per case (default 120)")
    ap.add_argument("--memory", type=float, default=8.0, help="address-space limit per case, GiB")
    args = ap.parse_args()
    scale = 1 if args.quick else 2
    memory = int(args.memory * 2**30)
    print(f"Command: `{' '.join([Path(sys.executable).name, *sys.argv])}`")
    print(f"Python {platform.python_version()} on {platform.machine()} ({os.cpu_count()} CPUs), "
          f"src {args.src}, limit {args.memory:g} GiB address space, timeout {args.timeout:g} s\n")
    print("| case | file | command | seconds | peak RSS (MiB) | outcome | last stderr line |")
    print("|---|---:|---|---:|---:|---|---|")
    with tempfile.TemporaryDirectory(prefix="bench_adversarial_") as tmp:
        sparse = Path(tmp) / "sparse.pickle"
        with open(sparse, "wb") as f:
            f.truncate(3 * 2**30)
        jobs: list[tuple[str, str, int, list[str]]] = []
        for name, (build, argv) in CASES.items():
            if args.only and args.only not in name:
                continue
            path = Path(tmp) / "case.json" if "JSON" in name else Path(tmp) / "case.pickle"
            data = build(scale)
            path.write_bytes(data)
            out = str(Path(tmp) / "out.pickle")
            jobs.append((name, str(path), len(data), [argv[0], str(path), *(a.format(out=out) for a in argv[1:])]))
            m = run_case(args.src, jobs[-1][3], args.timeout, memory)
            name = name.format(n=f"{COUNTS.get(build.__name__, 0) * scale:,}")
            print(f"| {name} | {len(data) / 1e6:.2f} MB | vram {' '.join(argv)} | {m['seconds']:.2f} | "
                  f"{m['rss']:,.0f} | {m['outcome']} | {m['message'].replace('|', '/')} |", flush=True)
        for name, (where, argv) in FILES.items():
            if args.only and args.only not in name:
                continue
            path = where.format(sparse=sparse)
            m = run_case(args.src, [argv[0], path, *argv[1:]], args.timeout, memory)
            print(f"| {name} | {os.path.getsize(path) / 1e6:.0f} MB | vram {' '.join(argv)} | "
                  f"{m['seconds']:.2f} | {m['rss']:,.0f} | {m['outcome']} | {m['message'].replace('|', '/')} |",
                  flush=True)
        real = TRACES / "cs336-s-mem.pickle"
        if real.exists() and not args.only:
            m = run_case(args.src, ["replay", str(real), "--verify"], args.timeout, 2 * 2**30)
            print(f"| real recording under a 2 GiB address-space limit | {real.stat().st_size / 1e6:.2f} MB | "
                  f"vram replay --verify | {m['seconds']:.2f} | {m['rss']:,.0f} | {m['outcome']} | "
                  f"{m['message'].replace('|', '/')} |")


if __name__ == "__main__":
    main()
