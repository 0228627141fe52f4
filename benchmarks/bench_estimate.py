"""`vram.estimate` speed on a GPT-2-small-sized training step.

Run: ``python3 benchmarks/bench_estimate.py`` (``--profile`` adds a cProfile listing, ``--batch`` /
``--seq`` change the step). One process, one thread (``torch.set_num_threads(1)``); pin it to a
core with ``taskset -c 0`` to measure "one core". Prints:

1. cold: the first `estimate` in a fresh process — includes one-time imports torch makes on first
   use of meta kernels (``torch._dynamo``, ``torch._refs``), about a second;
2. warm: `estimate` again (fp32 + AdamW, bf16 autocast + AdamW, + activation checkpointing): the
   cost of an estimate in a process that has already run one (best of 3);
3. where the time goes, for the fp32 step (3 iterations): the same step on plain ``meta`` tensors
   with no simulation (torch's own shape inference — roughly the floor; SDPA takes its math path
   there, a few more ops than the simulated CUDA kernel), under ``simulated_cuda`` without
   `estimate`'s tracking (+ the two modes and the allocator), and `estimate` (+ tracking, model
   build and the report's bookkeeping).

Measured (Python 3.11.7, torch 2.13.0 CPU, one core of the 2-core CI-sized machine, idle): cold
1.88 s (of which ~1.25 s is ``import torch._dynamo``, which torch does on the first dispatch to a
Python meta kernel); warm fp32 0.70 s, bf16 0.77 s, bf16 + checkpoint 1.03 s; the split 0.54 s
plain meta / 0.63 s simulated / 0.70 s estimate. Under cProfile about half of all time is torch's
Python meta kernels and decompositions (``torch._prims_common``, ``torch._refs``, symbolic-shape
helpers), ~9 % pytree flattening, ~7 % `vram.run.runtime`'s modes, ~7 % the allocator, ~1 % tracking.
Re-measured 2026-11-21 on the same kind of machine, busier, alternating with the previous
session's code: this code cold 2.01–3.07 s, warm fp32 0.80–0.87 s, bf16 0.87–0.99 s, bf16 +
checkpoint 1.18–1.49 s; the previous code cold 2.19–2.27 s, warm 0.73–0.83 s — run-to-run noise of
the machine, no regression. The cold excess over 2 s is torch's one-time dynamo import (which the
optimizer's ``zero_grad``, wrapped by ``torch._disable_dynamo``, triggers on a GPU run too).

The model (`gpt2_small`) is GPT-2 small as nanoGPT writes it: 12 layers, d_model 768, 12 heads,
vocabulary 50,257, 1,024 positions, tied embedding / LM head, causal SDPA, tanh GELU (124.4 M
parameters), from ``examples/mymodels.py``.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from mymodels import GPT, gpt2_small  # noqa: E402,F401 - GPT is imported from here by estimate_accuracy


def _loop(model: nn.Module, device: str, batch: int, seq: int, iterations: int = 3) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    for _ in range(iterations):
        idx = torch.empty(batch, seq, dtype=torch.long, device=device)
        model(idx).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _best(fn, n: int = 3) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--profile", action="store_true", help="cProfile one warm estimate (top 30 by own time)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from vram.estimate.engine import estimate
    from vram.run.runtime import simulated_cuda
    from vram.units import format_size

    x = torch.empty(args.batch, args.seq, dtype=torch.long, device="meta")
    print(f"GPT-2 small (124.4 M parameters), batch {args.batch}, sequence {args.seq}, AdamW, 3 iterations; "
          f"Python {sys.version.split()[0]}, torch {torch.__version__}")
    t0 = time.perf_counter()
    r = estimate(gpt2_small, x, optimizer="adamw")
    print(f"cold (first estimate in the process): {time.perf_counter() - t0:6.2f} s   "
          f"peak allocated {format_size(r.peak_allocated)}, reserved {format_size(r.peak_reserved)}")
    for label, kw in (("fp32", {}), ("bf16 autocast", {"amp": "bf16"}),
                      ("bf16 + checkpoint", {"amp": "bf16", "checkpoint": True})):
        holder = {}

        def run(kw=kw, holder=holder) -> None:  # type: ignore[no-untyped-def]
            holder["r"] = estimate(gpt2_small, x, optimizer="adamw", **kw)

        t = _best(run)
        res = holder["r"]
        print(f"warm estimate, {label:<18} {t:6.2f} s   peak allocated {format_size(res.peak_allocated)}, "
              f"reserved {format_size(res.peak_reserved)}")

    def plain_meta() -> None:
        with torch.device("meta"):
            model = gpt2_small()
        _loop(model, "meta", args.batch, args.seq)

    def simulated() -> None:
        with torch.device("meta"):
            model = gpt2_small()
        with simulated_cuda():  # meta parameters have no values to copy: storage of the same shapes
            _loop(model.to_empty(device="cuda"), "cuda", args.batch, args.seq)

    t_meta, t_sim = _best(plain_meta), _best(simulated)
    t_est = _best(lambda: estimate(gpt2_small, x, optimizer="adamw"))
    print("where the time goes (fp32 step, 3 iterations, best of 3):")
    print(f"  plain meta tensors, no simulation (torch's shape inference): {t_meta:6.2f} s")
    print(f"  simulated_cuda, no tracking (+ modes, allocator):            {t_sim:6.2f} s")
    print(f"  vram.estimate (+ tracking, model clone, breakdowns):         {t_est:6.2f} s")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        estimate(gpt2_small, x, optimizer="adamw")
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
