"""One rank of a launched run (`vram.run.distributed.launcher`), inside its own process: the
torchrun environment it was given, where its ``_dump_snapshot`` files go, and the result it
hands back to the launcher (a JSON file named by ``VRAM_RANK_RESULT``)."""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from vram.devices.gpus import GpuPreset
from vram.frontend import memory as _memory

__all__ = ["RESULT_ENV", "STAGING_ENV", "stage_snapshots", "write_result"]

RESULT_ENV = "VRAM_RANK_RESULT"     # where this rank writes its result (set by the launcher)
STAGING_ENV = "VRAM_RANK_STAGING"   # where this rank's snapshot dumps wait for the launcher

_staged: list[tuple[str, str]] = []  # (path the script asked for, file written)


def stage_snapshots(dump: Callable[..., None]) -> Callable[..., None] | None:
    """A ``_dump_snapshot`` that writes into the launcher's staging folder instead of the path the
    script names: every rank of a run shares one file system, so ranks asking for the same path
    would overwrite each other. The launcher moves each file to its path afterwards (see
    `vram.run.distributed.launcher`). None when this process is not a launched rank."""
    folder = os.environ.get(STAGING_ENV)
    if not folder:
        return None
    rank = os.environ.get("RANK", "0")

    def dump_snapshot(filename: str = "dump_snapshot.pickle") -> None:
        staged = os.path.join(folder, f"rank{rank}-{len(_staged)}.pickle")
        dump(staged)
        _staged.append((os.path.abspath(os.fspath(filename)), staged))
    return dump_snapshot


def write_result(status: int, context: int, gpu: GpuPreset | None = None) -> None:
    """Write this rank's result for the launcher, when it asked for one: exit status, and per
    simulated GPU the allocator's current and whole-run peak figures (``reset_peak_memory_stats``
    does not lower them) and OOM count; with `gpu` (the simulated card), the NCCL communicators'
    memory outside the allocator (`vram.run.distributed.nccl`)."""
    path = os.environ.get(RESULT_ENV)
    if not path:
        return
    from .nccl import rank_figure

    nccl = rank_figure(gpu) if gpu is not None else None
    devices: list[dict[str, Any]] = []
    for i in range(_memory.device_count()):
        stats = _memory.memory_stats(i)
        run = _memory.get_allocator(i).stats   # whole-run peaks, whatever the script reset
        devices.append({
            "index": i,
            "allocated": stats.get("allocated_bytes.all.current", 0),
            "peak_allocated": run.run_peak("allocated_bytes"),
            "reserved": stats.get("reserved_bytes.all.current", 0),
            "peak_reserved": run.run_peak("reserved_bytes"),
            "num_ooms": stats.get("num_ooms", 0),
            "total": _memory.get_device(i).total_memory,
        })
    result = {"rank": int(os.environ.get("RANK", "0")), "status": status, "context": context,
              "nccl": nccl, "devices": devices, "snapshots": _staged}
    with open(path, "w") as f:
        json.dump(result, f)
