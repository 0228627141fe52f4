"""`vram run`'s fixed cost: a one-line script under ``vram run`` against ``python -c "import torch"``.

Run: ``python3 benchmarks/bench_startup.py`` (``--repeats N``; needs torch). Three commands, each
in a fresh process, run in turn (``--repeats`` rounds, so each round is paired under the same load):
``python3 -c "import torch"``, ``vram run empty.py`` (a script with no torch call) and
``vram run one_line.py`` (``import torch; y = torch.ones(1024, device="cuda") * 2``). Printed:
each command's wall time and the process's CPU time (user + system, its children's included:
steadier than wall time on a shared machine), and the paired differences over ``import torch``.
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ONE_LINE = 'import torch; y = torch.ones(1024, device="cuda") * 2\n'


def once(cmd: list[str]) -> tuple[float, float]:
    """(wall, CPU time) of one run of `cmd`, in seconds."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return (s[len(s) // 2] + s[(len(s) - 1) // 2]) / 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        (Path(tmp) / "empty.py").write_text("x = 1\n")
        (Path(tmp) / "one_line.py").write_text(ONE_LINE)
        vram = [sys.executable, "-m", "vram", "run"]
        runs = {"import torch": [sys.executable, "-c", "import torch"],
                "vram run empty.py": [*vram, str(Path(tmp) / "empty.py")],
                "vram run one_line.py": [*vram, str(Path(tmp) / "one_line.py")]}
        got: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
        for _ in range(args.repeats):
            for name, cmd in runs.items():
                got[name].append(once(cmd))
    base = got["import torch"]
    print(f"{args.repeats} rounds, each command once per round in turn\n")
    print("| command | wall (s), median | CPU time (s), median | wall over import torch (s), paired median "
          "| CPU time over import torch (s), paired median |\n|---|---:|---:|---:|---:|")
    for name, rows in got.items():
        wall, cpu = zip(*rows)
        over = [_median([r[i] - b[i] for r, b in zip(rows, base)]) for i in (0, 1)]
        print(f"| {name} | {_median(list(wall)):.2f} | {_median(list(cpu)):.2f} | {over[0]:+.2f} | {over[1]:+.2f} |")


if __name__ == "__main__":
    main()
