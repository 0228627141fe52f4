"""The host's memory: what this process can still get (layer 1, no torch).

Shared by the snapshot decoder's memory cap (`vram.replay.safe_pickle`) and the value copies of a
real-values run (`vram.run.memory.storages.SimState.reserve`).
"""
from __future__ import annotations

__all__ = ["available_memory"]


def available_memory() -> int | None:
    """Bytes of RAM this process can still get: /proc/meminfo's MemAvailable, and a cgroup v2
    limit less its usage where one is set; None where neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                found.append(max(0, int(limit) - int(f.read().strip())))
    except (OSError, ValueError):
        pass
    return min(found) if found else None
