"""Layer 1, devices: where segments come from (like RMM's upstream memory resources).

`base.Device` is the interface the allocator uses; `simulated.SimulatedDevice` is a GPU with a
capacity, a CUDA context and an address model; `trace.TraceDevice` hands out the addresses a
recording got; `gpus` names real cards (``--gpu A100-80GB``).
"""
from .base import Device, DriverError, Event
from .gpus import GPU_PRESETS, GpuPreset, resolve_gpu
from .simulated import SimulatedDevice
from .trace import TraceDevice

__all__ = ["Device", "DriverError", "Event", "GPU_PRESETS", "GpuPreset", "SimulatedDevice", "TraceDevice",
           "resolve_gpu"]
