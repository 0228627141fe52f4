"""``torch.cuda`` answered by the simulator, for `vram.run.runtime` (layer 4; needs torch).

`patch_torch_cuda` swaps the device, stream, RNG and memory functions of ``torch.cuda``,
``torch.cuda.memory`` and ``torch.accelerator`` for ones backed by `vram.memory` and returns a function that puts every
original back. Memory statistics, ``memory_summary()``, ``empty_cache()``, snapshots and
``_record_memory_history`` are vram's own, which are PyTorch's byte for byte.
"""
from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from vram.frontend import graphs as _graphs
from vram.frontend import memory as _memory

from .comm import comm_functions
from .reductions import max_threads_per_sm

MiB = 1024 * 1024


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
        self.L2_cache_size = 50 * MiB
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
    put(torch, "device", _device_type(torch.device))
    put(torch, "Generator", _generator_type(torch.Generator))
    return restore


def _stand_in(real: type, make: Callable[..., Any]) -> type:
    """A class standing in for the C class `real` under its own name: calling it is `make`,
    its instances are `real`'s (``isinstance``/``issubclass`` checks still hold), and its other
    attributes are `real`'s."""

    class StandIn(type):
        def __instancecheck__(cls, obj: Any) -> bool:
            return isinstance(obj, real)

        def __subclasscheck__(cls, sub: Any) -> bool:
            return issubclass(sub, real)

        def __getattr__(cls, name: str) -> Any:
            return getattr(real, name)

        def __call__(cls, *args: Any, **kwargs: Any) -> Any:
            return make(*args, **kwargs)

    return StandIn(real.__name__, (), {"__module__": "torch", "__doc__": real.__doc__})


def _device_type(real: type) -> type:
    """``torch.device`` accepting an index alone: ``torch.device(0)`` is the current accelerator's
    device 0 (``THPDevice_pynew``, torch/csrc/Device.cpp, ``at::getAccelerator``), CUDA on a GPU
    build, a refusal on a CPU one (FSDP1's ``_get_compute_device`` does it for a root without
    parameters). Instances are the real ``torch.device``."""

    def make(*args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and isinstance(args[0], int) and not isinstance(args[0], bool):
            return real("cuda", args[0])
        return real(*args, **kwargs)

    return _stand_in(real, make)


class SimulatedGenerator(torch._C.Generator):
    """A CUDA generator of the simulated GPU: a CPU generator whose ``device`` is ``cuda:N``.
    Random ops on simulated tensors draw only the values vram keeps (`vram.run.known`), from
    it. Its ``get_state`` is the CPU generator's (a CUDA generator's is 16 bytes of Philox seed
    and offset)."""

    _vram_index: int

    def __new__(cls, index: int) -> SimulatedGenerator:
        g = torch._C.Generator.__new__(cls)
        g._vram_index = index
        return g

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", self._vram_index)

    def __reduce__(self) -> Any:  # copy/deepcopy/pickle: the same device and state
        return _restored_generator, (self._vram_index, self.get_state())


def _restored_generator(index: int, state: torch.Tensor) -> SimulatedGenerator:
    g = SimulatedGenerator(index)
    g.set_state(state)
    return g


def _generator_type(real: type) -> type:
    """``torch.Generator`` that can make CUDA generators. On a CPU build ``torch.Generator(device=
    "cuda")`` raises "Cannot get CUDA generator without ATen_cuda library"; diffusers pipelines and
    sampling scripts make one (``torch.Generator(device).manual_seed(0)``). On a GPU its ``device``
    is ``cuda:N``, N the given index else the current device (``THPGenerator_pynew``,
    torch/csrc/Generator.cpp, asks the CUDA hooks for a new generator on that index): here a
    `SimulatedGenerator`. Other devices get the real one."""

    def make(device: Any = None) -> Any:
        if device is not None and torch.device(device).type == "cuda":
            return SimulatedGenerator(_memory._device_index(torch.device(device)))
        return real() if device is None else real(device)

    return _stand_in(real, make)


def attribute_patches() -> tuple[Callable[[Any, str, Any], None], Callable[[], None]]:
    """``(put, restore)``: ``put(owner, name, value)`` sets an attribute and remembers the old one
    (or its absence); ``restore()`` puts every one back, last first."""
    saved: list[tuple[Any, str, Any]] = []
    missing = object()

    def put(owner: Any, name: str, value: Any) -> None:
        saved.append((owner, name, getattr(owner, name, missing)))
        setattr(owner, name, value)

    def restore() -> None:
        for owner, name, old in reversed(saved):
            if old is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
        saved.clear()

    return put, restore


def patch_torch_extras(clear_cache: Callable[[], None], simulated: Callable[[Any], bool],
                       resize: Callable[[Any, int, Callable[..., Any]], Any], function_mode: Any,
                       exact: Callable[[Any], bool] = lambda t: False) -> Callable[[], None]:
    """Patches outside ``torch.cuda`` that a simulated run needs; returns the restore function.

    * ``torch.clear_autocast_cache`` (called when the outermost autocast exits) also runs
      `clear_cache`, the emulated autocast's weight-cast cache;
    * ``torch.compile`` returns the function or module unchanged and says so once on stderr: the
      run is eager, and so is its memory (a compiled graph fuses ops and usually needs less);
    * ``GradScaler._maybe_opt_step`` reads ``found_inf.item()``: for simulated tensors (for which
      `simulated` is true) whose values are not `exact` (known, not computed from placeholders;
      a real-values run knows them) it steps unconditionally, as a real run does whenever no
      inf/NaN gradient occurred;
    * ``torch._has_compatible_shallow_copy_type`` says a host tensor and a simulated one are
      compatible (CPU and CUDA are, to a GPU run), so ``Module._apply`` moves Parameters in place
      with ``param.data = moved`` instead of making new ones (see ``vram.run.modes.FunctionMode._set_data``);
    * ``torch._C._group_tensors_by_device_and_dtype`` keys a group of simulated tensors by
      ``cuda:N`` (C++ sees meta), so foreach paths chosen by device (``clip_grad_norm_``) are CUDA's;
    * ``Tensor.record_stream`` of a simulated tensor goes to `function_mode` (which records the
      stream on its block): C++'s argument parser rejects a simulated Stream before any mode
      sees the call ("unknown parameter type"; FSDP1's ``_free_unsharded_flat_param``);
    * ``UntypedStorage.resize_`` (not an aten op, so invisible to dispatch modes; FSDP frees
      parameters with ``resize_(0)``) is ``resize(storage, size, original)``, which runs the
      original and lets the simulated block follow;
    * ``Module.to(1)`` / ``Module.to(device=1)``: a device index is a CUDA device on a GPU build;
      ``Module.to`` parses it in C++ (``_parse_to``) as the current accelerator's, which a CPU build
      lacks ("Cannot access accelerator device", meta engine) or which is the PrivateUse1 engine's
      own numbering, so the index becomes ``cuda:N`` first (DDP examples: ``ToyModel().to(rank)``);
    * the autograd engine (``torch.autograd._engine_run_backward``, behind ``backward()`` and
      ``autograd.grad``) runs with `function_mode` on the torch-function mode stack. ``backward()``
      reaches the engine through that mode's own handler, where PyTorch pops the mode, and the
      engine's graph task keeps the mode stack it was started with: without this, Python code run
      during backward (custom ``Function.backward``, tensor hooks, saved-tensor unpack hooks, so
      ``torch.utils.checkpoint``'s recomputation) would run without the simulated GPU — no
      ``device="cuda"``, no emulated autocast, no SDPA routing, so checkpoint's recomputed
      tensors would differ from the forward's. Saved-tensor hooks (``saved_tensors_hooks``) run
      under it too: a pack hook runs inside an op, below the mode's handler, and would otherwise
      see a simulated tensor's ``device`` as meta in forward and as cuda when unpacked.
    """
    import torch.autograd.graph as autograd_graph
    from torch.amp.grad_scaler import GradScaler
    from torch.overrides import _get_current_function_mode_stack

    original_clear, original_compile = torch.clear_autocast_cache, torch.compile
    original_step = GradScaler._maybe_opt_step
    original_resize = torch.UntypedStorage.resize_
    original_record = torch.Tensor.record_stream
    original_engine = autograd_graph._engine_run_backward
    original_hooks_init = autograd_graph.saved_tensors_hooks.__init__
    original_compatible = torch._has_compatible_shallow_copy_type
    original_module_to = torch.nn.Module.to

    def module_to(self: Any, *args: Any, **kwargs: Any) -> Any:
        def cuda(d: Any) -> Any:
            return torch.device("cuda", d) if isinstance(d, int) and not isinstance(d, bool) else d
        if args:
            args = (cuda(args[0]), *args[1:])
        if "device" in kwargs:
            kwargs = {**kwargs, "device": cuda(kwargs["device"])}
        return original_module_to(self, *args, **kwargs)

    def compatible(input: Any, from_: Any) -> bool:  # noqa: A002 - torch's parameter names (dynamo checks)
        # A host tensor and a simulated one are CPU and CUDA to the script: compatible, so
        # Module._apply keeps Parameter objects (``param.data = moved``, done by the mode).
        on_sim = simulated(input)
        if on_sim != simulated(from_):
            host = from_ if on_sim else input
            return host.device.type == "cpu" and host.layout == torch.strided == input.layout == from_.layout
        return original_compatible(input, from_)

    def clear_autocast_cache() -> None:
        clear_cache()
        original_clear()

    told: list[bool] = []

    def compile(model: Any = None, **kwargs: Any) -> Any:  # noqa: A001 - torch.compile's name
        caller = sys._getframe(1).f_code.co_filename
        library = any(f"{os.sep}{d}{os.sep}" in caller for d in ("site-packages", "dist-packages"))
        # a library compiling its own helper functions (at import, as DeepSpeed's and litgpt's do) is not
        # a compiled model: said only for a module, or for what the script itself compiles
        if not told and (isinstance(model, torch.nn.Module) or not library):
            told.append(True)
            sys.stdout.flush()
            sys.stderr.write("vram run: torch.compile runs eagerly on the simulated GPU, so memory is "
                             "eager PyTorch's (a compiled graph fuses ops and usually needs less)\n")
        return model if model is not None else (lambda m: m)

    def maybe_opt_step(self: Any, optimizer: Any, optimizer_state: dict[str, Any], *args: Any,
                       **kwargs: Any) -> Any:
        if any(simulated(v) and not exact(v) for v in optimizer_state["found_inf_per_device"].values()):
            return optimizer.step(*args, **kwargs)
        return original_step(self, optimizer, optimizer_state, *args, **kwargs)

    def resize_(self: Any, size: int) -> Any:
        return resize(self, size, original_resize)

    def record_stream(self: Any, stream: Any) -> None:
        if simulated(self):
            function_mode.__torch_function__(original_record, (), (self, stream), {})
        else:
            original_record(self, stream)

    original_group = torch._C._group_tensors_by_device_and_dtype

    def group(tensorlistlist: Any, with_indices: bool = False) -> Any:
        # C++ groups by each tensor's real device, meta here; a group of simulated tensors is on
        # cuda:N to the script as on a GPU: clip_grad_norm_(foreach=True) and optimizers choose
        # their foreach paths by that key (torch/nn/utils/clip_grad.py, torch/optim/adam.py)
        fixed = {}
        for (device, dtype), value in original_group(tensorlistlist, with_indices).items():
            if device.type == "meta":
                first = next((t for t in value[0][0] if t is not None), None)
                idx = function_mode.sim.seen_idx(first)
                device = device if idx is None else torch.device("cuda", idx)
            fixed[(device, dtype)] = value
        return fixed

    def under_mode(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if function_mode in _get_current_function_mode_stack():
                return fn(*args, **kwargs)
            with function_mode:
                return fn(*args, **kwargs)
        return run

    def hooks_init(self: Any, pack_hook: Callable[..., Any], unpack_hook: Callable[..., Any]) -> None:
        original_hooks_init(self, under_mode(pack_hook), under_mode(unpack_hook))

    restore_host = _patch_host_side(lambda: function_mode in _get_current_function_mode_stack())
    engine_under_mode = under_mode(original_engine)

    def engine(t_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        with function_mode.backward_scope(t_outputs):
            return engine_under_mode(t_outputs, *args, **kwargs)

    torch.autograd._engine_run_backward = autograd_graph._engine_run_backward = engine
    autograd_graph.saved_tensors_hooks.__init__ = hooks_init  # type: ignore[method-assign]
    torch._C._group_tensors_by_device_and_dtype = group
    torch.clear_autocast_cache = clear_autocast_cache
    torch._has_compatible_shallow_copy_type = compatible
    torch.nn.Module.to = module_to  # type: ignore[method-assign,assignment]
    torch.compile = compile  # type: ignore[assignment]
    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
    torch.Tensor.record_stream = record_stream  # type: ignore[method-assign,assignment]
    GradScaler._maybe_opt_step = maybe_opt_step  # type: ignore[method-assign]

    def restore() -> None:
        restore_host()
        torch._C._group_tensors_by_device_and_dtype = original_group
        torch.clear_autocast_cache = original_clear
        torch._has_compatible_shallow_copy_type = original_compatible
        torch.nn.Module.to = original_module_to  # type: ignore[method-assign]
        torch.compile = original_compile
        GradScaler._maybe_opt_step = original_step  # type: ignore[method-assign]
        torch.UntypedStorage.resize_ = original_resize  # type: ignore[method-assign]
        torch.Tensor.record_stream = original_record  # type: ignore[method-assign]
        torch.autograd._engine_run_backward = autograd_graph._engine_run_backward = original_engine
        autograd_graph.saved_tensors_hooks.__init__ = original_hooks_init  # type: ignore[method-assign]

    return restore


def _patch_host_side(on_mode_stack: Callable[[], bool]) -> Callable[[], None]:
    """Host-side services a CPU build of PyTorch lacks; returns the restore function.

    * ``Tensor.pin_memory`` of a host tensor outside the run's thread (DataLoader's pin-memory
      thread, started with ``pin_memory=True`` and ``num_workers > 0``, has no torch-function
      mode) returns the tensor: page-locked host memory is not GPU memory, and a CPU build
      cannot pin ("Cannot access accelerator device when none is available"). In the run's
      thread the mode answers it the same way.
    * ``torch.profiler`` / ``torch.autograd.profiler.profile`` asked for CUDA activity profile the
      CPU only and say so once on stderr: a CPU build has no CUPTI, so PyTorch would fall back to
      recording a CUDA event per op (``KINETO_GPU_FALLBACK``), each failing with a warning and a
      C++ stack trace. Kernel timings cannot be simulated; the profiler allocates nothing on
      the GPU either way (``profile_memory`` records allocator events, not allocations).
    """
    import torch.autograd.profiler as autograd_profiler

    put, restore = attribute_patches()
    original_pin = torch.Tensor.pin_memory
    original_profile_init = autograd_profiler.profile.__init__
    told: list[bool] = []

    def pin_memory(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not on_mode_stack() and self.device.type == "cpu":
            return self
        return original_pin(self, *args, **kwargs)

    def profile_init(self: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_device") == "cuda" or kwargs.get("use_cuda"):
            kwargs = dict(kwargs, use_device=None, use_cuda=False)
            if not told:
                told.append(True)
                sys.stdout.flush()
                sys.stderr.write("vram run: the profiler records CPU activity only: CUDA kernels do not "
                                 "run on the simulated GPU, so they have no timings\n")
        original_profile_init(self, *args, **kwargs)

    put(torch.Tensor, "pin_memory", pin_memory)
    put(autograd_profiler.profile, "__init__", profile_init)
    return restore
