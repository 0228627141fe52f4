"""vram: PyTorch's CUDA caching allocator, byte-faithful, on a simulated GPU.

The top level mirrors ``torch.cuda``'s memory API (``vram.memory_allocated()``,
``vram.memory_summary()``, ``vram.empty_cache()``, …) over simulated GPUs made by
`vram.simulate`, plus tensor-like buffers (`vram.empty`) whose memory is freed when the last
reference dies. `vram.memory` holds the private history/snapshot functions as in
``torch.cuda.memory`` (``_record_memory_history``, ``_snapshot``, ``_dump_snapshot``).
"""
import os as _os
import sys as _sys

from .allocator import (
    AllocatorConfig,
    CachingAllocator,
    ConfigError,
    OutOfMemoryError,
    allocation_size,
    parse_alloc_conf,
    round_size,
)
from .devices import Device, SimulatedDevice
from .frontend import memory
from .frontend.memory import (
    Stream,
    caching_allocator_alloc,
    caching_allocator_delete,
    current_device,
    current_stream,
    default_stream,
    device_count,
    empty_cache,
    get_allocator,
    get_device,
    get_per_process_memory_fraction,
    list_gpu_processes,
    max_memory_allocated,
    max_memory_cached,
    max_memory_reserved,
    mem_get_info,
    memory_allocated,
    memory_cached,
    memory_reserved,
    memory_snapshot,
    memory_stats,
    memory_stats_as_nested_dict,
    memory_summary,
    reset_accumulated_memory_stats,
    reset_max_memory_allocated,
    reset_max_memory_cached,
    reset_peak_memory_stats,
    set_device,
    set_per_process_memory_fraction,
    simulate,
    stream,
    synchronize,
)
from .frontend.tensor import DTYPES as _DTYPES
from .frontend.tensor import (
    Storage,
    Tensor,
    dtype,
    empty,
    empty_like,
    ones,
    ones_like,
    rand,
    randn,
    zeros,
    zeros_like,
)

# ``import vram.memory`` / ``from vram.memory import _dump_snapshot`` keep working, as for
# ``torch.cuda.memory``.
_sys.modules[__name__ + ".memory"] = memory

float32 = _DTYPES["float32"]
float64 = _DTYPES["float64"]
float16 = _DTYPES["float16"]
bfloat16 = _DTYPES["bfloat16"]
int64 = _DTYPES["int64"]
int32 = _DTYPES["int32"]
int16 = _DTYPES["int16"]
int8 = _DTYPES["int8"]
uint8 = _DTYPES["uint8"]
bool = _DTYPES["bool"]  # noqa: A001 - torch.bool
float = float32  # noqa: A001
half = float16
double = float64
long = int64

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``vram.estimate(...)`` / ``vram.max_batch(...)`` import torch only when first used;
    ``vram.replay(...)`` imports the replay engine when first used.

    ``vram.estimate`` and ``vram.replay`` are packages that are callable: ``vram.estimate(model,
    inputs, ...)`` calls ``vram.estimate.estimate``, ``vram.replay("run.pickle", ...)``
    `vram.replay.replay`.
    """
    import importlib

    if name in ("estimate", "max_batch", "EstimateResult"):
        _estimate = importlib.import_module(".estimate", __name__)  # sets vram.estimate
        return _estimate if name == "estimate" else getattr(_estimate, name)
    if name == "replay":
        return importlib.import_module(".replay", __name__)
    raise AttributeError(f"module 'vram' has no attribute {name!r}")


def explain(path: str | _os.PathLike[str], **kwargs: object) -> object:
    """``vram explain PATH`` from Python: why the recording at `path` ran out of memory (or what
    its reserved peak is made of), with fixes checked by replay. Keywords: ``device``, ``gpu``,
    ``context`` (as the command's: the measured CUDA context with a ``gpu``, else 0), ``workers``.
    Returns a `vram.analysis.explain.Explanation` (``print()`` it for the command's report; a
    notebook shows it as HTML)."""
    from .analysis.explain import explain as _explain
    from .devices.gpus import context_on

    kwargs["context"] = context_on(kwargs.get("gpu"), kwargs.get("context"))  # type: ignore[arg-type]
    return _explain(_os.fspath(path), **kwargs)  # type: ignore[arg-type]


def tune(paths: str | _os.PathLike[str] | list[str], **kwargs: object) -> object:
    """``vram tune PATH...`` from Python: allocator settings ranked by peak reserved without OOM,
    each replayed through the recording(s). Keywords: ``gpu``, ``context`` (as ``explain``'s), ``devices``,
    ``workers``. Returns a `vram.analysis.tune.TuneResult` (``.best["conf"]``; ``print()`` it for
    the command's table)."""
    from .analysis.tune import tune as _tune
    from .devices.gpus import context_on

    kwargs["context"] = context_on(kwargs.get("gpu"), kwargs.get("context"))  # type: ignore[arg-type]
    many = [paths] if isinstance(paths, (str, _os.PathLike)) else list(paths)
    return _tune([_os.fspath(p) for p in many], **kwargs)  # type: ignore[arg-type]


__all__ = [
    "memory", "CachingAllocator", "SimulatedDevice", "Device", "OutOfMemoryError", "AllocatorConfig",
    "ConfigError", "parse_alloc_conf", "round_size", "allocation_size", "simulate", "Stream",
    "Tensor", "Storage", "dtype", "empty", "empty_like", "zeros", "ones", "rand", "randn",
    "zeros_like", "ones_like", "memory_allocated", "max_memory_allocated", "memory_reserved",
    "max_memory_reserved", "memory_stats", "memory_stats_as_nested_dict", "memory_summary",
    "empty_cache", "reset_peak_memory_stats", "reset_accumulated_memory_stats",
    "set_per_process_memory_fraction", "get_per_process_memory_fraction", "mem_get_info",
    "memory_snapshot", "caching_allocator_alloc", "caching_allocator_delete", "device_count",
    "current_device", "set_device", "current_stream", "default_stream", "stream", "synchronize",
    "list_gpu_processes", "get_allocator", "get_device", "memory_cached", "max_memory_cached",
    "reset_max_memory_allocated", "reset_max_memory_cached", "explain", "tune", "replay", "estimate", "max_batch",
]
