"""The device interface: what the caching allocator needs from a GPU (spec §22).

The allocator talks to a device only through `Device`: `malloc`/`free` (cudaMalloc/cudaFree),
`reserve`/`release`/`map`/`unmap` (the driver's virtual memory calls, for expandable segments),
`mem_get_info`, and events for cross-stream frees. `vram.devices.simulated.SimulatedDevice` is the
default; `vram.devices.trace.TraceDevice` replays recorded addresses; a real CUDA device would
implement the same methods (like RMM's upstream memory resources).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable


class DriverError(RuntimeError):
    """A failed CUDA driver call, as PyTorch's ``C10_CUDA_DRIVER_CHECK`` reports it (a
    ``RuntimeError`` reading ``CUDA driver error: <cuGetErrorString text>``)."""


class Event:
    """A CUDA event recorded on a stream: `completed` once the work before it has run."""

    __slots__ = ("stream", "completed")

    def __init__(self, stream: int, completed: bool) -> None:
        self.stream = stream
        self.completed = completed


@runtime_checkable
class Device(Protocol):
    """What the caching allocator needs from a GPU (spec §22)."""

    index: int
    total_memory: int

    def malloc(self, size: int) -> int | None:
        """cudaMalloc: the base address of `size` new bytes, or None when out of memory."""

    def free(self, ptr: int) -> None:
        """cudaFree of a base address returned by `malloc`."""

    def reserve(self, size: int) -> int:
        """Reserve `size` bytes of virtual address space (no physical memory); raise `DriverError`
        when the address space has no such range left."""

    def release(self, ptr: int) -> None:
        """Give back a reserved virtual range (all of it must be unmapped)."""

    def map(self, ptr: int, size: int) -> bool:
        """Back [ptr, ptr+size) of a reserved range with physical memory; False when out of memory."""

    def unmap(self, ptr: int, size: int) -> None:
        """Release the physical memory behind [ptr, ptr+size)."""

    def mem_get_info(self) -> tuple[int, int]:
        """cudaMemGetInfo: (free, total) bytes, device-wide."""

    def record_event(self, stream: int) -> Event:
        """cudaEventRecord on `stream`."""

    def query_event(self, event: Event) -> bool:
        """cudaEventQuery: has the event completed?"""

    def synchronize_event(self, event: Event) -> None:
        """cudaEventSynchronize: wait for the event."""
