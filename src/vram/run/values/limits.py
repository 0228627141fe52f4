"""How much of the simulated GPU's memory contents a run keeps on the host: the size limit of a
storage's known values, and the error when host memory cannot hold the copies of a real-values run."""
from __future__ import annotations

#: Elements of a storage whose contents are kept on the CPU when known (64 Ki: masks, ids,
#: scalars; see `vram.run.values.known`). A host storage moved over keeps up to as many float32s.
VALUE_LIMIT = 1 << 16
#: Elements of an output kept when it is computed, by a deterministic op, from simulated tensors
#: whose values are all kept (and small host tensors): constants a kernel derives from known ones
#: (istft's window envelope: the window's squares expanded over every frame, overlap-added;
#: rotary tables: known positions times known frequencies). Such an output costs the host one
#: pass over at most this many elements; the values of factories and host data keep `VALUE_LIMIT`.
DERIVED_LIMIT = 1 << 20


class HostMemoryError(Exception):
    """The CPU copies of a real-values run (`vram.run.values.real_values`) do not fit in host memory."""


def cannot_allocate(e: BaseException) -> bool:
    """Is `e` a CPU allocation that failed (``MemoryError``, or c10's ``DefaultCPUAllocator:
    can't allocate memory``, c10/core/impl/alloc_cpu.cpp, raised as a RuntimeError)?"""
    return isinstance(e, MemoryError) or "DefaultCPUAllocator: can't allocate memory" in str(e)


def refusal(need: str, held: int, available: int | None) -> str:
    """The one line that stops a real-values run short of host memory: what it needed, the bytes
    its value copies hold, what the host has left, and how to go on."""
    left = "unknown" if available is None else f"{available / 2**20:,.0f} MiB"
    return (f"--values real: {need}; the CPU copies of the simulated GPU's values hold {held / 2**20:,.0f} MiB "
            f"of host memory and {left} is available; run without --values real (placeholders), "
            "with a smaller model or input, or where the host has more memory")
