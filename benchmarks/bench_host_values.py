"""Host-side values under `vram run` against plain CPU torch: initialisers that read what they drew.

Run: ``python3 benchmarks/bench_host_values.py`` (``--repeats N``, ``--tensors N``; needs torch).
torch's ``nn.init.trunc_normal_`` redraws the values outside [a, b] until none is left, so it reads
its tensor (``mask.any()``): under ``vram run`` the lazy host tensor is computed for real. The
script fills N [3072, 768] float32 tensors (a GPT-2 small MLP's weights) with ``trunc_normal_``
(std 0.02, a=-2, b=2 — the rejection branch), then sums one of them. It runs as plain
``python3 init.py`` and as ``vram run init.py``, alternately, each in a fresh process; printed:
the script's own time for the fills (torch's import and start-up excluded), wall and CPU time (the
process's own: steadier on a shared machine), and the paired ratios.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INIT = '''
import sys, time
import torch
torch.manual_seed(0)
t0, c0 = time.perf_counter(), time.process_time()
ws = [torch.empty(3072, 768) for _ in range({tensors})]
for w in ws:
    torch.nn.init.trunc_normal_(w, std=0.02, a=-2.0, b=2.0)
total = float(ws[-1].sum())
print(f"fills {{time.perf_counter() - t0:.3f}} {{time.process_time() - c0:.3f}} {{total!r}}", file=sys.stderr)
'''


def once(cmd: list[str]) -> tuple[tuple[float, float], str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    m = re.search(r"fills ([0-9.]+) ([0-9.]+) (\S+)", proc.stderr)
    if proc.returncode != 0 or m is None:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return (float(m[1]), float(m[2])), m[3]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tensors", type=int, default=12)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_host_values_") as tmp:
        init = Path(tmp) / "init.py"
        init.write_text(INIT.format(tensors=args.tensors))
        runs = {"plain CPU": [sys.executable, str(init)],
                "vram run": [sys.executable, "-m", "vram", "run", str(init)]}
        got: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
        sums: set[str] = set()
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            for name, cmd in runs.items():
                seconds, total = once(cmd)
                got[name].append(seconds)
                sums.add(total)
    if len(sums) != 1:
        raise SystemExit(f"the runs disagree on the values drawn: {sorted(sums)}")
    print(f"{args.tensors} x trunc_normal_([3072, 768]), {args.repeats} paired runs "
          f"({time.perf_counter() - t0:.0f} s in all); same values in every run\n")
    print("| run | fills, wall (s) | fills, CPU time (s) |\n|---|---:|---:|")
    for name, rows in got.items():
        wall, cpu = zip(*rows)
        print(f"| {name} | {min(wall):.2f}–{max(wall):.2f} | {min(cpu):.2f}–{max(cpu):.2f} |")
    for i, what in enumerate(("wall", "CPU time")):
        ratio = sorted(v[i] / p[i] for v, p in zip(got["vram run"], got["plain CPU"]))
        print(f"vram run / plain CPU, {what}, paired: {ratio[0]:.2f}–{ratio[-1]:.2f}x (median "
              f"{ratio[len(ratio) // 2]:.2f}x)")


if __name__ == "__main__":
    main()
