"""Decoding a snapshot pickle (``safe_pickle.decode_pickle``: the key scan and the C unpickler):
this checkout against a baseline revision, alternating, with the ratio per pair.

Run: ``python3 benchmarks/bench_decode.py [--baseline REV] [--pairs N] [FILE ...]`` (default: the
previous commit, 20 pairs, the largest real recording). Each side decodes in its own process
(its own ``src``, the garbage collector paused as the loader pauses it), one decode per round,
old and new taking turns to go first, timed in CPU seconds of the decoding process (a shared
machine's other work moves wall time far more); printed: the median of each side and of the
new/old ratios, and their spread.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "recordings" / "ftcourse-memory-snapshot.pickle"

WORKER = """
import sys, time
sys.path.insert(0, sys.argv[1])
from vram.replay.safe_pickle import decode_pickle, gc_paused
data = open(sys.argv[2], "rb").read()
decode_pickle(data)  # warm: imports, the C core loaded
for line in sys.stdin:
    with gc_paused():
        t = time.process_time()
        obj = decode_pickle(data)
        dt = time.process_time() - t
    del obj
    print(dt, flush=True)
"""


def _src_of(rev: str, into: Path) -> Path:
    """`rev`'s ``src`` tree, extracted under `into`."""
    tar = subprocess.run(["git", "archive", rev, "src"], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(tar)) as t:
        t.extractall(into, filter="data")
    return into / "src"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", type=Path, default=[DEFAULT])
    ap.add_argument("--baseline", default="HEAD~1", help="git revision to compare with (default HEAD~1)")
    ap.add_argument("--pairs", type=int, default=20)
    args = ap.parse_args()
    print(f"Command: `{' '.join([Path(sys.executable).name, *sys.argv])}`")
    with tempfile.TemporaryDirectory(prefix="bench_decode_") as tmp:
        old_src = _src_of(args.baseline, Path(tmp))
        for path in args.files:
            procs = {name: subprocess.Popen([sys.executable, "-c", WORKER, str(src), str(path)],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                     for name, src in (("old", old_src), ("new", ROOT / "src"))}
            times: dict[str, list[float]] = {"old": [], "new": []}
            for k in range(args.pairs):
                for name in (("old", "new") if k % 2 == 0 else ("new", "old")):
                    proc = procs[name]
                    assert proc.stdin is not None and proc.stdout is not None
                    proc.stdin.write("go\n")
                    proc.stdin.flush()
                    times[name].append(float(proc.stdout.readline()))
            for proc in procs.values():
                proc.communicate("")
            ratios = [b / a for a, b in zip(times["old"], times["new"])]
            q = statistics.quantiles(ratios, n=4)
            old_ms, new_ms = (statistics.median(times[k]) * 1e3 for k in ("old", "new"))
            print(f"{path.name} ({path.stat().st_size:,} B), {args.pairs} pairs: old ({args.baseline}) median "
                  f"{old_ms:.1f} ms, new {new_ms:.1f} ms; new/old median {statistics.median(ratios):.3f} "
                  f"(quartiles {q[0]:.3f} .. {q[2]:.3f})")


if __name__ == "__main__":
    main()
