"""Layer 4: a ``torch.cuda``-shaped API over simulated GPUs (``torch/cuda/memory.py``'s names and
signatures).

`simulate` (re)creates the GPUs and resets all state; until it is called a default GPU exists
(80 GiB, no CUDA context charged). Each device index has its own `SimulatedDevice` and
`CachingAllocator`.
"""
from __future__ import annotations

import itertools
import sys
import threading
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from vram.allocator.caching import CachingAllocator
from vram.allocator.config import parse_alloc_conf
from vram.allocator.history import ALL, ALLOC, NEVER, STATE
from vram.allocator.pools import check_pool_id
from vram.devices.simulated import SimulatedDevice
from vram.units import GiB
from vram.views.snapshot import dump_snapshot, segments, snapshot
from vram.views.summary import memory_summary_from_stats

DEFAULT_TOTAL_MEMORY = 80 * GiB

__all__ = [
    "simulate", "device_count", "current_device", "set_device", "synchronize", "Stream", "Event",
    "current_stream", "default_stream", "stream", "memory_allocated", "max_memory_allocated",
    "memory_reserved", "max_memory_reserved", "memory_stats", "memory_stats_as_nested_dict",
    "memory_summary", "empty_cache", "reset_peak_memory_stats", "reset_accumulated_memory_stats",
    "reset_max_memory_allocated", "reset_max_memory_cached", "memory_cached", "max_memory_cached",
    "set_per_process_memory_fraction", "get_per_process_memory_fraction", "mem_get_info",
    "memory_snapshot", "caching_allocator_alloc", "caching_allocator_delete", "list_gpu_processes",
    "get_allocator", "get_device",
]


class _PerThread(threading.local):
    """The current device and streams of one host thread: ``cudaSetDevice`` is per thread, and so
    are PyTorch's current streams (c10/cuda/CUDAStream.cpp ``thread_local current_streams``); a new
    thread starts on device 0 with each device's default stream."""

    def __init__(self) -> None:
        self.current_device = 0
        self.current_streams: dict[int, Stream] = {}


class _Runtime:
    """All simulated GPUs of the process, their allocators and each thread's current device/streams."""

    def __init__(self, devices: list[SimulatedDevice], alloc_conf: str | None, oom_format: str) -> None:
        self.devices = devices
        self.allocators = [CachingAllocator(d, alloc_conf, oom_format=oom_format) for d in devices]
        self.thread = _PerThread()
        self.lock = threading.Lock()

    @property
    def current_device(self) -> int:
        return self.thread.current_device

    @current_device.setter
    def current_device(self, index: int) -> None:
        self.thread.current_device = index

    @property
    def current_streams(self) -> dict[int, Stream]:
        return self.thread.current_streams


_runtime: _Runtime | None = None
_runtime_lock = threading.Lock()


def _rt() -> _Runtime:
    global _runtime
    if _runtime is None:
        with _runtime_lock:
            if _runtime is None:
                _runtime = _Runtime([SimulatedDevice(DEFAULT_TOTAL_MEMORY, 0, 0)], None, "current")
    return _runtime


def simulate(
    total_memory: int | str = DEFAULT_TOTAL_MEMORY,
    context: int | str = 0,
    device_count: int = 1,
    alloc_conf: str | None = None,
    *,
    other_processes: int | str | list[tuple[int, int | str]] = 0,
    event_completion: str = "immediate",
    nvml: bool = False,
    oom_format: str = "current",
    name: str = "Simulated GPU",
) -> list[SimulatedDevice]:
    """(Re)create `device_count` simulated GPUs and reset all allocator state.

    `alloc_conf` is a ``PYTORCH_CUDA_ALLOC_CONF`` string; None reads the environment. Buffers made
    before the call stay bound to the old GPUs. Returns the new devices.
    """
    global _runtime
    if isinstance(device_count, bool) or not isinstance(device_count, int) or device_count < 1:
        raise ValueError(f"device_count must be a positive int, got {device_count!r}")
    devices = [SimulatedDevice(total_memory, context, i, other_processes=other_processes,
                               event_completion=event_completion, nvml=nvml, name=name)
               for i in range(device_count)]
    rt = _Runtime(devices, alloc_conf, oom_format)  # validates alloc_conf before replacing state
    with _runtime_lock:
        _runtime = rt
    return devices


# -- devices and streams -------------------------------------------------------------------------
def device_count() -> int:
    return len(_rt().devices)


def _device_index(device: Any = None, optional: bool = True) -> int:
    """Resolve None / int / "cuda" / "cuda:1" / an object with ``.index`` to a device index."""
    rt = _rt()
    if device is None:
        return rt.current_device
    if isinstance(device, str):
        kind, _, num = device.partition(":")
        if kind != "cuda" or (num and not num.isdigit()):
            raise ValueError(f"Expected a cuda device, but got: {device}")
        idx = int(num) if num else rt.current_device
    elif isinstance(device, int) and not isinstance(device, bool):
        idx = device
    elif getattr(device, "index", None) is not None or getattr(device, "type", None) == "cuda":
        idx = device.index if device.index is not None else rt.current_device
    else:
        raise ValueError(f"Expected a cuda device, but got: {device!r}")
    if not 0 <= idx < len(rt.devices):
        raise ValueError(f"Invalid device index {idx}: {len(rt.devices)} simulated GPU(s) "
                         "(use vram.simulate(device_count=...))")
    return idx


def current_device() -> int:
    return _rt().current_device


def set_device(device: Any) -> None:
    _rt().current_device = _device_index(device)


def get_allocator(device: Any = None) -> CachingAllocator:
    """The `CachingAllocator` of a simulated GPU."""
    return _rt().allocators[_device_index(device)]


def get_device(device: Any = None) -> SimulatedDevice:
    """The `SimulatedDevice` behind a device index."""
    return _rt().devices[_device_index(device)]


_stream_ids = itertools.count(1)


class Stream:
    """A simulated CUDA stream (``torch.cuda.Stream``); ``cuda_stream`` is its "pointer" value.

    The default stream of every device has ``cuda_stream == 0``, as in PyTorch's traces.
    """

    def __init__(self, device: Any = None, priority: int = 0, *, _cuda_stream: int | None = None) -> None:
        self.device_index = _device_index(device)
        self.priority = priority
        self.cuda_stream = next(_stream_ids) * 0x100 if _cuda_stream is None else _cuda_stream

    def synchronize(self) -> None:
        """Wait for this stream: its recorded events complete (see `SimulatedDevice`)."""
        get_device(self.device_index).synchronize(self.cuda_stream)

    def query(self) -> bool:
        dev = get_device(self.device_index)
        return not dev._pending.get(self.cuda_stream)

    def wait_stream(self, stream: Stream) -> None:  # ordering only; no memory effect
        return None

    def is_capturing(self) -> bool:  # ``torch.Stream.is_capturing``: no graph capture here
        return False

    def wait_event(self, event: Event) -> None:  # ordering only; no memory effect
        return None

    def record_event(self, event: Event | None = None) -> Event:
        """``torch.cuda.Stream.record_event``: records (a new one when None) and returns it."""
        event = Event() if event is None else event
        event.record(self)
        return event

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Stream) and other.cuda_stream == self.cuda_stream
                and other.device_index == self.device_index)

    def __hash__(self) -> int:
        return hash((self.device_index, self.cuda_stream))

    def __repr__(self) -> str:
        return f"<vram.Stream device=cuda:{self.device_index} cuda_stream={self.cuda_stream:#x}>"


class Event:
    """``torch.cuda.Event`` on an infinitely fast GPU: always complete, and ``elapsed_time`` is
    0.0 ms. A simulation knows memory, not time: timings of a simulated run mean nothing."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False, external: bool = False) -> None:
        self.enable_timing = enable_timing

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end_event: Event) -> float:
        return 0.0


def default_stream(device: Any = None) -> Stream:
    return Stream(_device_index(device), _cuda_stream=0)


def current_stream(device: Any = None) -> Stream:
    idx = _device_index(device)
    return _rt().current_streams.get(idx) or default_stream(idx)


def current_stream_of(allocator_index: int) -> int:
    """``current_stream(i).cuda_stream`` for a valid device index `i`, with no `Stream` made for
    the default stream (0) — what every allocation asks."""
    stream = _rt().current_streams.get(allocator_index)
    return 0 if stream is None else stream.cuda_stream


@contextmanager
def stream(stream: Stream | None) -> Iterator[None]:
    """``torch.cuda.stream(stream)``: make `stream` the current stream of its device inside the
    block (torch's parameter name: callers pass it by keyword, e.g. timm's loader)."""
    if stream is None:
        yield
        return
    rt = _rt()
    idx = stream.device_index
    prev = rt.current_streams.get(idx)
    rt.current_streams[idx] = stream
    try:
        yield
    finally:
        if prev is None:
            rt.current_streams.pop(idx, None)
        else:
            rt.current_streams[idx] = prev


def synchronize(device: Any = None) -> None:
    """``torch.cuda.synchronize``: every stream of the device finishes its work."""
    get_device(device).synchronize()


# -- statistics --------------------------------------------------------------------------------
def memory_stats(device: Any = None) -> OrderedDict[str, Any]:
    """``torch.cuda.memory_stats``: the flattened, key-sorted statistics (spec §16.2)."""
    return get_allocator(device).memory_stats()  # type: ignore[return-value]


def memory_stats_as_nested_dict(device: Any = None) -> dict[str, Any]:
    a = get_allocator(device)
    with a.lock:
        return a.stats.as_nested_dict()


def memory_allocated(device: Any = None) -> int:
    """Bytes occupied by live allocations (``allocated_bytes.all.current``)."""
    return get_allocator(device).stats.allocated_bytes[0].current


def max_memory_allocated(device: Any = None) -> int:
    return get_allocator(device).stats.allocated_bytes[0].peak


def memory_reserved(device: Any = None) -> int:
    """Bytes held by the caching allocator (``reserved_bytes.all.current``)."""
    return get_allocator(device).stats.reserved_bytes[0].current


def max_memory_reserved(device: Any = None) -> int:
    return get_allocator(device).stats.reserved_bytes[0].peak


def memory_cached(device: Any = None) -> int:
    warnings.warn("torch.cuda.memory_cached has been renamed to torch.cuda.memory_reserved",
                  FutureWarning, stacklevel=2)
    return memory_reserved(device)


def max_memory_cached(device: Any = None) -> int:
    warnings.warn("torch.cuda.max_memory_cached has been renamed to torch.cuda.max_memory_reserved",
                  FutureWarning, stacklevel=2)
    return max_memory_reserved(device)


def reset_peak_memory_stats(device: Any = None) -> None:
    get_allocator(device).reset_peak_memory_stats()


def reset_accumulated_memory_stats(device: Any = None) -> None:
    get_allocator(device).reset_accumulated_memory_stats()


def reset_max_memory_allocated(device: Any = None) -> None:
    warnings.warn("torch.cuda.reset_max_memory_allocated now calls torch.cuda.reset_peak_memory_stats, "
                  "which resets /all/ peak memory stats.", FutureWarning, stacklevel=2)
    reset_peak_memory_stats(device)


def reset_max_memory_cached(device: Any = None) -> None:
    warnings.warn("torch.cuda.reset_max_memory_cached now calls torch.cuda.reset_peak_memory_stats, "
                  "which resets /all/ peak memory stats.", FutureWarning, stacklevel=2)
    reset_peak_memory_stats(device)


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    """``torch.cuda.memory_summary``: PyTorch's table, byte for byte (spec §17)."""
    idx = _device_index(device)
    return memory_summary_from_stats(memory_stats(idx), idx, abbreviated)


def empty_cache() -> None:
    """``torch.cuda.empty_cache``: every device releases its whole free segments (spec §11.1)."""
    for a in _rt().allocators:
        a.empty_cache()


def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
    """Cap this process's reserved memory on a device at ``fraction × total`` (spec §13)."""
    idx = _device_index(device)
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    if fraction < 0 or fraction > 1:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    if fraction != fraction:
        raise RuntimeError(f"invalid fraction:{fraction}. Please set within [0, 1].")
    _rt().allocators[idx].set_memory_fraction(fraction)


def get_per_process_memory_fraction(device: Any = None) -> float:
    return get_allocator(device).get_memory_fraction()


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """``torch.cuda.mem_get_info``: (free, total) for the whole device, all processes."""
    return get_allocator(device).mem_get_info()


def list_gpu_processes(device: Any = None) -> str:
    """``torch.cuda.list_gpu_processes``, from the simulated device's processes."""
    dev = get_device(device)
    lines = [f"GPU:{dev.index}"]
    procs = [(pid, used) for pid, used in dev.process_memory() if used]
    if not procs:
        lines.append("no processes are running")
    for pid, used in procs:
        lines.append(f"process {pid:>10d} uses {used / (1024 * 1024):>12.3f} MB GPU memory")
    return "\n".join(lines)


# -- raw allocation ------------------------------------------------------------------------------
def caching_allocator_alloc(size: int, device: Any = None, stream: Any = None) -> int:
    """``torch.cuda.caching_allocator_alloc``: allocate `size` bytes; returns the address."""
    idx = _device_index(device)
    if stream is None:
        stream = current_stream(idx)
    if isinstance(stream, Stream):
        stream = stream.cuda_stream
    if isinstance(stream, bool) or not isinstance(stream, int):
        raise TypeError("Invalid type for stream argument, must be `torch.cuda.Stream` or `int` "
                        "representing a pointer to a existing stream")
    return _rt().allocators[idx].malloc(size, stream)


def caching_allocator_delete(mem_ptr: int) -> None:
    """``torch.cuda.caching_allocator_delete``: free memory from `caching_allocator_alloc`."""
    if isinstance(mem_ptr, bool) or not isinstance(mem_ptr, int):
        raise TypeError(f"mem_ptr must be an int address, got {type(mem_ptr).__name__}")
    if mem_ptr == 0:
        return
    for a in _rt().allocators:
        with a.lock:
            if mem_ptr in a.active or mem_ptr in a.uncached:
                a.free(mem_ptr)
                return
    raise RuntimeError(f"invalid device pointer: {mem_ptr:#x}")


# -- history and snapshots (torch.cuda.memory._record_memory_history etc.) ----------------------------
_CONTEXT_LEVELS: Mapping[str | None, int] = {None: NEVER, "state": STATE, "alloc": ALLOC, "all": ALL}
_SKIPPABLE = frozenset({"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
                        "oom", "snapshot"})


def _record_memory_history(enabled: Any = "all", *args: Any, **kwargs: Any) -> None:
    """``torch.cuda.memory._record_memory_history``: start/stop recording allocation history.

    New form: ``enabled`` ∈ {"all", "state", None}, ``context`` ∈ {"all", "alloc", "state", None},
    ``stacks`` ∈ {"all", "python"}, ``max_entries``, ``clear_history``, ``skip_actions``. A bool
    first argument selects the legacy form (spec §18.1). Applies to every simulated device.
    """
    if isinstance(enabled, bool):
        return _record_memory_history_legacy(enabled, *args, **kwargs)
    return _record_memory_history_impl(enabled, *args, **kwargs)


def _record_memory_history_impl(enabled: str | None = "all", context: str | None = "all",
                                stacks: str = "all", max_entries: int = sys.maxsize,
                                device: Any = None, clear_history: bool = False,
                                compile_context: bool = False, global_record_annotations: bool = False,
                                skip_actions: list[str] | None = None) -> None:
    if enabled not in ("state", "all", None):
        raise RuntimeError("expected state to be 'state', 'all', or None")
    if context not in ("state", "alloc", "all", None):
        raise RuntimeError("expected context to be 'state', 'alloc', 'all', or None")
    if stacks not in ("python", "all"):
        raise RuntimeError("expected stacks to be 'python', or 'all'")
    entries = max_entries if enabled == "all" else 1
    skip = frozenset(skip_actions or ()) & _SKIPPABLE
    for a in _rt().allocators:
        with a.lock:
            a.history.configure(enabled is not None, _CONTEXT_LEVELS[context], entries,
                                clear_history, skip, stacks)


def _record_memory_history_legacy(enabled: bool, record_context: bool = True,
                                  trace_alloc_max_entries: int = 1,
                                  trace_alloc_record_context: bool = False, device: Any = None,
                                  record_context_cpp: bool = False, clear_history: bool = False,
                                  compile_context: bool = False, global_record_annotations: bool = False,
                                  skip_actions: list[str] | None = None) -> None:
    level = ALLOC if trace_alloc_record_context else (STATE if record_context else NEVER)
    skip = frozenset(skip_actions or ()) & _SKIPPABLE
    for a in _rt().allocators:
        with a.lock:
            a.history.configure(enabled, level, trace_alloc_max_entries, clear_history, skip)


def memory_snapshot(mempool_id: Any = None, include_traces: bool = True) -> list[dict[str, Any]]:
    """``torch.cuda.memory_snapshot``: the segments of every device (spec §18.3); given a private
    pool's id, only that pool's (``_cuda_memorySnapshot((id[0], id[1], include_traces))``:
    ``snapshot(mempool_id)`` on each device, in device order)."""
    if mempool_id is None or tuple(mempool_id) == (0, 0):
        return _snapshot()["segments"]
    pool_id = check_pool_id(tuple(mempool_id))
    return [s for a in sorted(_rt().allocators, key=lambda a: a.device.index) for s in segments(a, pool_id)]


def _snapshot(device: Any = None) -> dict[str, Any]:
    """``torch.cuda.memory._snapshot``: segments, device_traces, allocator_settings."""
    return snapshot(_rt().allocators)


def _dump_snapshot(filename: str = "dump_snapshot.pickle") -> None:
    """``torch.cuda.memory._dump_snapshot``: pickle `_snapshot()` to `filename`."""
    dump_snapshot(_snapshot(), filename)


def _set_allocator_settings(env: str) -> None:
    """``torch.cuda.memory._set_allocator_settings``: re-parse the config on every device."""
    allocs = _rt().allocators
    for a in allocs:  # validate against every device before changing any
        parse_alloc_conf(env, a.config)
    for a in allocs:
        a.set_allocator_settings(env)


def segment_snapshot(device: Any = None) -> list[dict[str, Any]]:
    """The segments of one device only."""
    return segments(get_allocator(device))

