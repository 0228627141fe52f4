"""``torch.cuda`` answered by the simulator, for `vram.run.runtime` (layer 4; needs torch).

`patch_torch_cuda` swaps the device, stream, RNG and memory functions of ``torch.cuda``,
``torch.cuda.memory`` and ``torch.accelerator`` for ones backed by `vram.memory` and returns a function that puts every
original back. Memory statistics, ``memory_summary()``, ``empty_cache()``, snapshots and
``_record_memory_history`` are vram's own, which are PyTorch's byte for byte.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from vram.devices.gpus import max_threads_per_sm
from vram.frontend import graphs as _graphs
from vram.frontend import memory as _memory

from .comm import comm_functions
from .stand_ins import attribute_patches, device_type, generator_type

MiB = 1024 * 1024


#: ``cudaDeviceProp.l2CacheSize`` of cards where it was measured (Inductor's autotuning allocates
#: an L2-flush buffer of this size: 62,914,560 bytes in the H200 recording of compiled_gpt.py,
#: shared/gpu-truth/h200-2026-11-27); other cards: 50 MiB (an H100's)
L2_CACHE_SIZE = {"NVIDIA H200": 60 * MiB}


class DeviceProperties:
    """What ``torch.cuda.get_device_properties`` returns (``torch._C._CudaDeviceProperties``)."""

    def __init__(self, name: str, total_memory: int, major: int = 9, minor: int = 0,
                 multi_processor_count: int = 132) -> None:
        self.name = name
        self.total_memory = total_memory
        self.major = major
        self.minor = minor
        self.multi_processor_count = multi_processor_count
        self.is_integrated = 0
        self.is_multi_gpu_board = 0
        self.max_threads_per_multi_processor = max_threads_per_sm(major, minor)
        self.warp_size = 32
        self.regs_per_multiprocessor = 65536
        self.shared_memory_per_block = 49152
        self.shared_memory_per_block_optin = 232448
        self.shared_memory_per_multiprocessor = 233472
        self.L2_cache_size = L2_CACHE_SIZE.get(name, 50 * MiB)
        self.gcnArchName = "NVIDIA"
        self.uuid = "00000000-0000-0000-0000-000000000000"
        self.pci_bus_id = self.pci_device_id = self.pci_domain_id = 0

    def __repr__(self) -> str:
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory // MiB}MB, "
                f"multi_processor_count={self.multi_processor_count}, uuid={self.uuid}, "
                f"pci_bus_id={self.pci_bus_id}, pci_device_id={self.pci_device_id}, "
                f"pci_domain_id={self.pci_domain_id}, L2_cache_size={self.L2_cache_size // MiB}MB)")


class NVTX:
    """``torch._C._nvtx`` for the simulated GPU: ranges and marks are kept track of and cost
    nothing (a CPU build of torch has no NVTX, and profiling annotations allocate no GPU memory).
    Return values follow NVTX: push/pop give the zero-based depth of the range started/ended
    (pop without a range: -2, NVTX's error value), start gives a unique handle."""

    def __init__(self) -> None:
        self.depth = 0
        self.next_id = 1

    def rangePushA(self, msg: str) -> int:  # noqa: N802 - NVTX's names
        self.depth += 1
        return self.depth - 1

    def rangePop(self) -> int:  # noqa: N802
        if self.depth == 0:
            return -2
        self.depth -= 1
        return self.depth

    def rangeStartA(self, msg: str) -> int:  # noqa: N802
        self.next_id += 1
        return self.next_id - 1

    def rangeEnd(self, range_id: int) -> None:  # noqa: N802
        return None

    def markA(self, msg: str) -> None:  # noqa: N802
        return None

    def deviceRangeStart(self, msg: str, stream: int = 0) -> object:  # noqa: N802
        return object()

    def deviceRangeEnd(self, handle: object, stream: int = 0) -> None:  # noqa: N802
        return None


_MEMORY_NAMES = (
    "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
    "memory_cached", "max_memory_cached", "memory_stats", "memory_stats_as_nested_dict",
    "memory_summary", "empty_cache", "reset_peak_memory_stats", "reset_accumulated_memory_stats",
    "reset_max_memory_allocated", "reset_max_memory_cached", "set_per_process_memory_fraction",
    "get_per_process_memory_fraction", "mem_get_info", "memory_snapshot", "caching_allocator_alloc",
    "caching_allocator_delete", "list_gpu_processes")
_PRIVATE_MEMORY_NAMES = ("_record_memory_history", "_snapshot", "_dump_snapshot",
                         "_set_allocator_settings")


def _exchange_device(device: int) -> int:
    """``torch.cuda._exchange_device``: make `device` current (unless negative), return the
    previous (torch's parameter name)."""
    prev = _memory.current_device()
    if device >= 0:
        _memory.set_device(device)
    return prev


def _maybe_exchange_device(device: int) -> int:
    """``torch.cuda._maybe_exchange_device``: the same as `_exchange_device` (one simulated
    context per device), its own function: Dynamo keys its handlers by function
    (``TorchInGraphFunctionVariable._get_handlers`` refuses one function registered twice)."""
    return _exchange_device(device)


class LazyInit:
    """``torch.cuda.is_initialized()``: False until something calls ``_lazy_init`` — creating a
    CUDA tensor (``torch::utils::device_lazy_init``), ``set_device`` / ``current_device`` /
    ``_exchange_device`` (``THCPModule_*Device_wrap``, torch/csrc/cuda/Module.cpp), the Python
    functions that call ``_lazy_init()`` (device properties, streams, ``synchronize``), the
    accelerator's ``set/getDeviceIndex`` (torch/csrc/DeviceAccelerator.cpp). It decides
    something: ``DeviceMesh`` (FSDP2's default mesh, ``init_device_mesh``) calls
    ``set_device(LOCAL_RANK)`` only while CUDA is not initialised (``_setup_world_group_and_device``);
    a script that never selected its GPU gets ``cuda:LOCAL_RANK`` there, not ``cuda:0``."""

    def __init__(self) -> None:
        self.done = False

    def __call__(self) -> bool:
        """Is CUDA initialised? A charged CUDA tensor on any simulated GPU initialised it."""
        if not self.done:   # once initialised, CUDA stays so
            self.done = any(_memory.memory_stats(i)["allocation.all.allocated"]
                            for i in range(_memory.device_count()))
        return self.done

    def on(self, fn: Callable[..., Any], when: Callable[..., bool] = lambda *a, **k: True) -> Callable[..., Any]:
        """`fn`, which initialises CUDA first (when `when` holds for its arguments)."""
        @functools.wraps(fn)
        def initialising(*args: Any, **kwargs: Any) -> Any:
            if not self.done and when(*args, **kwargs):  # once initialised, CUDA stays so
                self.done = True
            return fn(*args, **kwargs)
        return initialising


def _non_negative(device: Any = None, *args: Any, **kwargs: Any) -> bool:
    return not (isinstance(device, int) and device < 0)


def _replacements(props: list[DeviceProperties], init: LazyInit | None = None) -> dict[str, Callable[..., Any] | type]:
    init = init or LazyInit()

    def props_of(device: Any = None) -> DeviceProperties:
        return props[_memory._device_index(device)]

    def set_device(device: Any) -> None:
        if isinstance(device, int) and device < 0:
            return
        _memory.set_device(device)

    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return torch.zeros(16, dtype=torch.uint8)

    def noop() -> Callable[..., None]:
        def nothing(*args: Any, **kwargs: Any) -> None:  # one object per name: dynamo's rule map
            return None                                   # rejects one object under two names
        return nothing

    return {
        "is_available": lambda: True,
        "is_initialized": init,
        "init": init.on(noop()),
        "_lazy_init": init.on(noop()),
        "device_count": _memory.device_count,
        "current_device": init.on(_memory.current_device),
        "set_device": init.on(set_device, _non_negative),
        "_exchange_device": init.on(_exchange_device, _non_negative),
        "_maybe_exchange_device": init.on(_maybe_exchange_device, _non_negative),
        "get_device_properties": init.on(props_of),
        "get_device_name": init.on(lambda device=None: props_of(device).name),
        "get_device_capability": init.on(lambda device=None: (props_of(device).major, props_of(device).minor)),
        "get_arch_list": lambda: [f"sm_{props[0].major}{props[0].minor}"],
        "is_bf16_supported": lambda including_emulation=True: props_of().major >= 8,
        "is_current_stream_capturing": _graphs.is_current_stream_capturing,
        "CUDAGraph": _graphs.CUDAGraph,
        "graph_pool_handle": _graphs.graph_pool_handle,
        "MemPool": _graphs.MemPool,
        "use_mem_pool": _graphs.use_mem_pool,
        "synchronize": init.on(_memory.synchronize),
        "current_stream": init.on(_memory.current_stream),
        "default_stream": init.on(_memory.default_stream),
        "stream": _memory.stream,
        "Stream": _memory.Stream,
        "Event": _memory.Event,
        "ipc_collect": noop(),
        "get_rng_state": get_rng_state,
        "get_rng_state_all": lambda: [get_rng_state() for _ in props],
        "set_rng_state": noop(),
        "set_rng_state_all": noop(),
        "manual_seed": noop(),
        "manual_seed_all": noop(),
        "seed": noop(),
        "seed_all": noop(),
        "initial_seed": torch.initial_seed,
    }


def _accelerator(init: LazyInit) -> dict[str, Callable[..., Any]]:
    """``torch._C``'s accelerator hooks, behind ``torch.accelerator`` and
    ``torch._C._get_accelerator()`` (FSDP2's default mesh, ``torch.distributed``'s default
    device): on a CPU build they say "cpu"; a simulated run's accelerator is CUDA."""
    cuda = torch.device("cuda")

    return {
        "_get_accelerator": lambda check=False: cuda,
        "_accelerator_getAccelerator": lambda: cuda,
        "_accelerator_getDeviceIndex": init.on(_memory.current_device),
        "_accelerator_setDeviceIndex": init.on(lambda idx: _memory.set_device(idx) if idx >= 0 else None,
                                               _non_negative),
        "_accelerator_exchangeDevice": init.on(_exchange_device, _non_negative),
        "_accelerator_maybeExchangeDevice": init.on(_maybe_exchange_device, _non_negative),
        "_accelerator_getStream": _memory.current_stream,
        "_accelerator_synchronizeDevice": _memory.synchronize,
        "_accelerator_isAllocatorInitialized": lambda: True,
        "_accelerator_emptyCache": _memory.empty_cache,
        "_accelerator_getDeviceStats": _memory.memory_stats_as_nested_dict,
        "_accelerator_resetAccumulatedStats": _memory.reset_accumulated_memory_stats,
        "_accelerator_resetPeakStats": _memory.reset_peak_memory_stats,
        "_accelerator_getMemoryInfo": _memory.mem_get_info,
    }


def patch_torch_cuda(props: list[DeviceProperties]) -> Callable[[], None]:
    """Point ``torch.cuda`` at the simulator; returns the function that restores it."""
    import torch.cuda.graphs
    import torch.cuda.memory
    import torch.cuda.nvtx
    import torch.cuda.random

    put, restore = attribute_patches()
    init = LazyInit()
    for name, value in _replacements(props, init).items():
        put(torch.cuda, name, value)
        for module in (torch.cuda.random, torch.cuda.graphs, torch.cuda.memory):
            if hasattr(module, name):
                put(module, name, value)
    for name in _MEMORY_NAMES:
        put(torch.cuda, name, getattr(_memory, name))
        put(torch.cuda.memory, name, getattr(_memory, name))
    for name in _PRIVATE_MEMORY_NAMES:
        put(torch.cuda.memory, name, getattr(_memory, name))
    put(torch.cuda.nvtx, "_nvtx", NVTX())
    put(torch.cuda.graphs.graph, "default_capture_stream", None)  # made lazily: a simulated stream
    put(torch._C, "_host_emptyCache", lambda: None)  # torch.cuda.graph's entry: pinned host memory
    for name, fn in {**_accelerator(init), **comm_functions()}.items():
        put(torch._C, name, fn)
    put(torch, "device", device_type(torch.device))
    put(torch, "Generator", generator_type(torch.Generator))
    return restore
