"""Errors the allocator raises, and PyTorch's OOM message text (spec §15)."""
from __future__ import annotations

from vram.units import format_size

DOCS_URL = "https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf"


class OutOfMemoryError(RuntimeError):
    """``torch.OutOfMemoryError``: a RuntimeError whose text is PyTorch's OOM message."""


def oom_message(
    *,
    device: int,
    alloc_size: int,
    device_total: int,
    device_free: int,
    allocated: int,
    reserved: int,
    allowed: int | None,
    private_pool_free: int = 0,
    processes: list[tuple[int, int]] | None = None,
    own_pid: int | None = None,
    legacy: bool = False,
) -> str:
    """The text of a CUDA OOM error (spec §15.1, or §15.2 with ``legacy=True`` for torch ≤ 2.0).

    `processes` is what NVML would report as (pid, bytes) per process; None means NVML is not
    available and the per-process clause is left out, as PyTorch does.
    """
    allowed_info = f"{format_size(allowed)} allowed; " if allowed is not None else ""
    if legacy:
        return (
            f"CUDA out of memory. Tried to allocate {format_size(alloc_size)} (GPU {device}; "
            f"{format_size(device_total)} total capacity; {format_size(allocated)} already allocated; "
            f"{format_size(device_free)} free; {allowed_info}{format_size(reserved)} reserved in total by "
            "PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb to avoid "
            "fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF"
        )
    proc_info = ""
    for pid, used in processes or ():
        if pid == own_pid:
            proc_info += f"Including non-PyTorch memory, this process has {format_size(used)} memory in use. "
        else:
            proc_info += f"Process {pid} has {format_size(used)} memory in use. "
    pp_msg = (f"with {format_size(private_pool_free)} allocated in private pools (e.g., CUDA Graphs), "
              if private_pool_free > 0 else "")
    return (
        f"CUDA out of memory. Tried to allocate {format_size(alloc_size)}. GPU {device} has a total "
        f"capacity of {format_size(device_total)} of which {format_size(device_free)} is free. "
        f"{proc_info}{allowed_info}Of the allocated memory {format_size(allocated + private_pool_free)} "
        f"is allocated by PyTorch, {pp_msg}and {format_size(reserved - allocated - private_pool_free)} "
        "is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
        f"Memory Management  ({DOCS_URL})"
    )


EB_MESSAGE = "CUDA out of memory. Tried to allocate more than 1EB memory."
