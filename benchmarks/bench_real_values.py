"""`vram run --values real` against the default mode, and the value ops' thread count.

Run: ``python3 benchmarks/bench_real_values.py`` (``--repeats N``; needs torch). Two workloads, each
a GPT (causal SDPA, tied head, AdamW) built on the CPU and moved to the device, trained with
``loss.item()`` logged every step, then a greedy ``generate()``: *small* (d=48: every value is
within the default mode's value limit, so both modes compute all of them on the CPU: minGPT
chargpt's case) and *larger* (d=256, 4 layers: the default mode knows few values). Each runs in a
fresh process under ``simulated_cuda(values=...)`` with the CPU value ops on one intra-op thread
(``value_threads=1``, the default) or on the script's (torch's default pool), and once as plain
CPU torch; configurations alternate within each repeat. Printed: the script's time (median), and
ratios against the default mode with one thread.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = '''
import sys, time, math
import torch, torch.nn as nn, torch.nn.functional as F
d, layers, steps, values, threads = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]

class Block(nn.Module):
    def __init__(s, d, h):
        super().__init__(); s.h = h
        s.ln1, s.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        s.qkv, s.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        s.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
    def forward(s, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, s.h, C // s.h).transpose(1, 2) for t in s.qkv(s.ln1(x)).split(C, 2))
        x = x + s.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))
        return x + s.mlp(s.ln2(x))

class GPT(nn.Module):
    def __init__(s, vocab=65, T=64):
        super().__init__()
        s.wte, s.wpe = nn.Embedding(vocab, d), nn.Embedding(T, d)
        s.blocks = nn.Sequential(*(Block(d, 4) for _ in range(layers)))
        s.ln, s.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        s.wte.weight = s.head.weight
    def forward(s, idx):
        return s.head(s.ln(s.blocks(s.wte(idx) + s.wpe(torch.arange(idx.size(1), device=idx.device)))))

def work(dev):
    torch.manual_seed(0)
    model = GPT().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.arange(4096) % 61
    for _ in range(steps):
        ix = torch.randint(0, 4096 - 65, (8,))
        x = torch.stack([data[i:i + 64] for i in ix]).to(dev)
        y = torch.stack([data[i + 1:i + 65] for i in ix]).to(dev)
        loss = F.cross_entropy(model(x).view(-1, 65), y.view(-1))
        opt.zero_grad(); loss.backward(); opt.step()
        print(f"loss {loss.item():.4f}")
    idx = torch.zeros(1, 1, dtype=torch.long, device=dev)
    with torch.no_grad():
        for _ in range(40):
            nxt = model(idx[:, -64:])[:, -1].argmax(-1, keepdim=True)
            idx = torch.cat([idx, nxt], 1)
            if nxt.item() == 64:
                break

t0 = time.perf_counter()
if values == "cpu":
    work("cpu")
else:
    from vram.run.runtime import active_sim, simulated_cuda
    with simulated_cuda("24GiB", values=values):
        active_sim().value_threads = 1 if threads == "1" else None
        work("cuda")
print(f"seconds {time.perf_counter() - t0:.3f}", file=sys.stderr)
'''
WORKLOADS = {"small": ("48", "2", "10"), "larger": ("256", "4", "10")}
CONFIGS = [("known", "1"), ("known", "script"), ("real", "1"), ("real", "script"), ("cpu", "script")]


def once(child: Path, workload: tuple[str, ...], values: str, threads: str) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(child), *workload, values, threads], capture_output=True,
                          text=True, env=env)
    if proc.returncode != 0 or "seconds " not in proc.stderr:
        raise SystemExit(f"{values}/{threads} failed:\n{proc.stderr[-2000:]}")
    return float(proc.stderr.rsplit("seconds ", 1)[1].split()[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{os.cpu_count()} cores, load average {load:.1f}; torch's default threads in each child")
    with tempfile.TemporaryDirectory(prefix="bench_real_values_") as tmp:
        child = Path(tmp) / "child.py"
        child.write_text(CHILD)
        for name, workload in WORKLOADS.items():
            times: dict[tuple[str, str], list[float]] = {c: [] for c in CONFIGS}
            start = time.perf_counter()
            for _ in range(args.repeats):
                for c in CONFIGS:  # alternating: each repeat runs every configuration once
                    times[c].append(once(child, workload, *c))
            base = statistics.median(times[("known", "1")])
            print(f"\n{name} (d={workload[0]}, {workload[1]} layers, {workload[2]} steps + generate; "
                  f"{time.perf_counter() - start:.0f} s in all)")
            for (values, threads), ts in times.items():
                med = statistics.median(ts)
                label = "plain CPU torch" if values == "cpu" else f"--values {values}, value ops on {threads} thread(s)"
                print(f"  {label:<48} {med:8.2f} s  x{med / base:5.2f}  ({', '.join(f'{t:.2f}' for t in ts)})")


if __name__ == "__main__":
    main()
