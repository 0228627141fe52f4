"""`vram run` against plain meta-device execution of the same script.

Run: ``python3 benchmarks/bench_run.py`` (``--repeats N``; needs torch). The script builds the
README's GPT-2 small (``examples/mymodels.py``) on the CPU, moves it to the device named on its
command line and runs three AdamW steps on a batch of 8 x 512 tokens. It runs as
``python3 step.py meta`` and as ``vram run --gpu 24GiB step.py cuda``, alternately, each in a fresh
process; printed: wall time of the whole process (torch's import included) and the script's own
two phases (building the model on the CPU; moving it and the steps).
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
STEP = '''
import sys, time
import torch
sys.path.insert(0, {examples!r})
from mymodels import gpt2_small
dev = sys.argv[1]
t0 = time.perf_counter()
model = gpt2_small()
t1 = time.perf_counter()
model = model.to(dev)
opt = torch.optim.AdamW(model.parameters())
x = torch.randint(0, 50257, (8, 512), device=dev)
for _ in range(3):
    loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
print(f"phases {{t1 - t0:.3f}} {{time.perf_counter() - t1:.3f}}", file=sys.stderr)
'''


def once(cmd: list[str]) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    m = re.search(r"phases ([0-9.]+) ([0-9.]+)", proc.stderr)
    if proc.returncode != 0 or m is None:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return wall, float(m[1]), float(m[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_run_") as tmp:
        step = Path(tmp) / "step.py"
        step.write_text(STEP.format(examples=str(ROOT / "examples")))
        runs = {"plain meta": [sys.executable, str(step), "meta"],
                "vram run": [sys.executable, "-m", "vram", "run", "--gpu", "24GiB", str(step), "cuda"]}
        got: dict[str, list[tuple[float, float, float]]] = {k: [] for k in runs}
        for _ in range(args.repeats):
            for name, cmd in runs.items():
                got[name].append(once(cmd))
    print("| run | process wall (s) | model on CPU (s) | move + 3 steps (s) |\n|---|---:|---:|---:|")
    for name, rows in got.items():
        cols = list(zip(*rows))
        print(f"| {name} | " + " | ".join(f"{min(c):.2f}–{max(c):.2f}" for c in cols) + " |")
    ratio = [v[0] / m[0] for v, m in zip(got["vram run"], got["plain meta"])]
    print(f"\nvram run / plain meta, whole process, paired runs: {min(ratio):.2f}–{max(ratio):.2f}x")


if __name__ == "__main__":
    main()
