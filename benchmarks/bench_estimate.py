"""`vram.estimate` speed on a GPT-2-small-sized training step.

Run: ``python3 benchmarks/bench_estimate.py`` (``--profile`` adds a cProfile listing, with the
backward on the calling thread where cProfile sees it; ``--rounds`` sets the split's rounds;
``--batch`` / ``--seq`` change the step). One process, one thread (``torch.set_num_threads(1)``);
times are CPU seconds of the process (``time.process_time``, the autograd engine's device thread
included), since the machine is shared. Prints:

1. cold: the first `estimate` in a fresh process — includes one-time imports torch makes on first
   use of meta kernels (``torch._dynamo``, ``torch._refs``) and the first run of each distinct
   op's meta kernel;
2. warm: `estimate` again (fp32 + AdamW, bf16 autocast + AdamW, + activation checkpointing): the
   cost of an estimate in a process that has already run one (best of 3);
3. where the time goes, for the fp32 step (3 iterations), in alternating rounds: the same step on
   plain ``meta`` tensors with no simulation (torch's own shape inference; SDPA takes its math
   path there, a few more ops than the simulated CUDA kernel), under ``simulated_cuda`` without
   `estimate`'s tracking, `estimate`, and `estimate` with every op's meta kernel run
   (`vram.run.engine.meta_cache` off: the baseline), with the ratios.

Measured 2026-11-27 (Python 3.11.7, torch 2.13.0 CPU, the 2-core machine under a load average of
8–12 from other jobs), fresh processes alternating the code before remembered meta runs
(b20a316) and after, the same script, A B A B: warm fp32 4.67 / 5.11 s before, 2.25 / 2.28 s
after (0.46x); bf16 6.53 / 5.74 -> 2.49 / 3.07 s; bf16 + checkpoint 8.28 / 8.13 -> 4.23 / 3.43 s;
cold 8.45 / 8.83 -> 5.98 / 5.84 s. The split: estimate / plain meta 2.39x / 2.26x before, 0.72x /
0.90x after; estimate / every meta kernel run (same process) 0.36x / 0.45x. Plain meta itself
took 2.2–2.5 s at that load (0.54 s idle in the earlier measurement on the meta engine), so
1 s is not measurable in absolute terms there; at the idle machine's 0.54 s the ratio puts a warm
estimate near 0.4–0.5 s. Before, about half of all time was torch's Python meta kernels, which
torch 2.13 registers at the Meta key over the C++ structured ones (``activate_meta``); a call
seen before now skips them, and what remains is the engine's own per-op Python (details and the
exactness check: benchmarks/README.md). The engine's per-op path was then cut (remembered views
straight to their view, the key's settings read without the config module, storages found by
their data address, ...): warm fp32 1.66-2.45 -> 1.11-1.45 s (0.63x median of 5 pairs), bf16
2.15-3.06 -> 1.45-2.09 s (0.72x), bf16 + checkpoint 2.53-3.58 -> 2.11-2.99 s (0.82x) (load average
3-6; benchmarks/README.md, with ``benchmarks/estimate_allocations.py``, the allocation sequences
compared before and after). Parts of that path were then compiled (``_fast.cpp``: new storages, a
tensor's block, the meta cache's key, same-dtype views): warm fp32 0.71x, bf16 0.79x, bf16 +
checkpoint 0.76x, cold 0.87x (medians of 5 alternating pairs, load average 2-11).

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


def _cpu(fn) -> float:  # type: ignore[no-untyped-def]
    """CPU seconds of the process (every thread: the autograd engine runs a GPU's backward on a
    thread of its own) while `fn` runs."""
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def _best(fn, n: int = 3) -> float:  # type: ignore[no-untyped-def]
    return min(_cpu(fn) for _ in range(n))


def _alternating(fns: dict, rounds: int) -> dict:  # type: ignore[type-arg]
    """Best CPU time of each function over `rounds` rounds that run each once in turn, so that
    a change in the machine's load reaches every one alike."""
    times: dict = {k: [] for k in fns}  # type: ignore[type-arg]
    for _ in range(rounds):
        for k, fn in fns.items():
            times[k].append(_cpu(fn))
    return {k: min(v) for k, v in times.items()}


def _split(args: argparse.Namespace, x: torch.Tensor) -> None:
    """Where the time goes: plain meta, simulated_cuda, estimate and estimate with every op's meta
    kernel run, in alternating rounds."""
    from vram.estimate.engine import estimate
    from vram.run.engine import meta_cache
    from vram.run.runtime import simulated_cuda

    def plain_meta() -> None:
        with torch.device("meta"):
            model = gpt2_small()
        _loop(model, "meta", args.batch, args.seq)

    def simulated() -> None:
        with torch.device("meta"):
            model = gpt2_small()
        with simulated_cuda():  # meta parameters have no values to copy: storage of the same shapes
            _loop(model.to_empty(device="cuda"), "cuda", args.batch, args.seq)

    def every_meta_kernel() -> None:  # the engine without its remembered meta runs: the baseline
        meta_cache.enabled = False
        try:
            estimate(gpt2_small, x, optimizer="adamw")
        finally:
            meta_cache.enabled = True

    best = _alternating({"meta": plain_meta, "sim": simulated, "every": every_meta_kernel,
                         "est": lambda: estimate(gpt2_small, x, optimizer="adamw")}, args.rounds)
    print(f"where the time goes (fp32 step, 3 iterations; best of {args.rounds} alternating rounds):")
    print(f"  plain meta tensors, no simulation (torch's shape inference): {best['meta']:6.2f} s")
    print(f"  simulated_cuda, no tracking (+ modes, allocator):            {best['sim']:6.2f} s")
    print(f"  vram.estimate (+ tracking, model clone, breakdowns):         {best['est']:6.2f} s")
    print(f"  vram.estimate, every op's meta kernel run (none remembered): {best['every']:6.2f} s")
    print(f"  estimate / plain meta: {best['est'] / best['meta']:.2f}x; "
          f"estimate / every meta kernel run: {best['est'] / best['every']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of the split (default 3)")
    ap.add_argument("--profile", action="store_true", help="cProfile one warm estimate (top 30 by own time)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from vram.estimate.engine import estimate
    from vram.units import format_size

    x = torch.empty(args.batch, args.seq, dtype=torch.long, device="meta")
    print(f"GPT-2 small (124.4 M parameters), batch {args.batch}, sequence {args.seq}, AdamW, 3 iterations; "
          f"Python {sys.version.split()[0]}, torch {torch.__version__}")
    holder = {}
    t = _cpu(lambda: holder.update(r=estimate(gpt2_small, x, optimizer="adamw")))
    r = holder["r"]
    print(f"cold (first estimate in the process): {t:6.2f} s   "
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

    _split(args, x)
    if args.profile:  # the backward on the calling thread, where cProfile sees it
        prof = cProfile.Profile()
        with torch.autograd.set_multithreading_enabled(False):
            prof.enable()
            estimate(gpt2_small, x, optimizer="adamw")
            prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
