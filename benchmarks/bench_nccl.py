"""NCCL accounting on every collective: 10,000 ``all_reduce`` calls on a 2-rank group, with the
early return for a communicator whose ring is already connected (`vram.run.distributed.nccl`)
against the path before it, which re-derived the rank's whole NCCL figure on every collective.

Run: ``python3 benchmarks/bench_nccl.py`` (``--calls N``, ``--rounds R``; needs torch). One
process is rank 0 of a 2-rank world (``simulated_cuda``, one simulated H100 node, the first
collective connects the ring); the baseline is the previous ``note_collective`` body (`_change`
on every call: the group's ranks, a copy of the communicator, the ``NCCL_*`` environment parsed,
`nccl_memory` over the live communicators) swapped in for its rounds. Rounds alternate
(baseline, new, baseline, new, ...) so load on the machine falls on both; printed: the best and
median seconds of each, the ratio of the medians, for the whole ``all_reduce`` and for the
accounting call alone (``note_collective`` timed by itself, the same number of calls).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    for k, v in {"RANK": 0, "WORLD_SIZE": 2, "LOCAL_RANK": 0, "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": 29533}.items():
        os.environ[k] = str(v)
    import torch
    import torch.distributed as dist

    from vram.run.distributed import nccl, process_group
    from vram.run.runtime import simulated_cuda

    new = process_group.note_collective

    def before(pg: Any, device: int | None) -> None:   # the body before the early return
        nccl._change(pg, "", nccl._global_ranks(pg), nccl._where(pg, "", device), "ring")

    times: dict[tuple[str, str], list[float]] = {}
    with simulated_cuda(gpu="H100", device_count=2):
        torch.cuda.set_device(0)
        dist.init_process_group("nccl")
        t = torch.ones(1024, device="cuda")
        dist.all_reduce(t)                                   # creates and connects the communicator
        pg = dist.group.WORLD
        taken = torch.cuda.mem_get_info()
        for _ in range(a.rounds):
            for name, fn in (("before", before), ("early return", new)):
                process_group.note_collective = fn
                t0 = time.perf_counter()
                for _ in range(a.calls):
                    dist.all_reduce(t)
                times.setdefault((name, "all_reduce"), []).append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for _ in range(a.calls):
                    fn(pg, 0)
                times.setdefault((name, "accounting"), []).append(time.perf_counter() - t0)
                assert torch.cuda.mem_get_info() == taken     # both leave the card as it was
        process_group.note_collective = new
        dist.destroy_process_group()
    print(f"{a.calls:,} calls on a connected 2-rank communicator, {a.rounds} alternating rounds")
    for what in ("all_reduce", "accounting"):
        med = {n: statistics.median(times[n, what]) for n in ("before", "early return")}
        best = {n: min(times[n, what]) for n in ("before", "early return")}
        print(f"  {what:<11} before: median {med['before']:.3f} s (best {best['before']:.3f}); early return: "
              f"median {med['early return']:.3f} s (best {best['early return']:.3f}); "
              f"before / early return = {med['before'] / med['early return']:.2f}x")


if __name__ == "__main__":
    main()
