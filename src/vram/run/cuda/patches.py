"""Patches outside ``torch.cuda`` that a simulated run needs (`patch_torch_extras`), each one a
place where a CPU build of PyTorch, or the meta device under the simulation, would part from a
GPU build. Every patch is an attribute swap (`vram.run.cuda.stand_ins.attribute_patches`), undone
by the restore function `patch_torch_extras` returns."""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from .stand_ins import attribute_patches

Put = Callable[[Any, str, Any], None]
#: strided nested tensors (``NestedTensorImpl``) on a simulated GPU: PyTorch has no kernels for them
#: on a Python backend; jagged ones are Python tensor subclasses over dense tensors and run
STRIDED_NESTED = ("vram run: strided nested tensors on the simulated GPU (torch.nested.nested_tensor / "
                  "as_nested_tensor with layout=torch.strided, the default) are not modelled; "
                  "layout=torch.jagged is")


def patch_torch_extras(clear_cache: Callable[[], None], simulated: Callable[[Any], bool],
                       resize: Callable[[Any, int, Callable[..., Any]], Any], function_mode: Any,
                       exact: Callable[[Any], bool] = lambda t: False) -> Callable[[], None]:
    """Patches outside ``torch.cuda`` that a simulated run needs; returns the restore function.

    * autocast, ``GradScaler`` and foreach grouping (`_patch_training`);
    * ``Module.to(index)``, host/simulated shallow-copy compatibility (`_patch_modules`);
    * ``Tensor.record_stream``, ``UntypedStorage.resize_`` (`_patch_storages`);
    * the autograd engine and saved-tensor hooks under the function mode (`_patch_autograd`);
    * pinned memory and the profiler (`_patch_host_side`). (``torch.compile``: `vram.run.compile.backend`.)
    """
    from torch.overrides import _get_current_function_mode_stack

    put, restore = attribute_patches()
    _patch_training(put, clear_cache, simulated, exact, function_mode)
    _patch_modules(put, simulated)
    _patch_storages(put, simulated, resize, function_mode)
    _patch_autograd(put, function_mode)
    _patch_host_side(put, lambda: function_mode in _get_current_function_mode_stack())
    _patch_nested(put, simulated)
    return restore


def strided_nested_on_gpu(device: Any, tensors: Any, simulated: Callable[[Any], bool]) -> bool:
    """Would a strided nested tensor of `tensors` built for `device` live on the simulated GPU?"""
    if device is not None:
        kind = device if isinstance(device, str) else getattr(device, "type", "cuda" if isinstance(device, int)
                                                               else "")
        return str(kind).split(":")[0] == "cuda"
    return any(isinstance(t, torch.Tensor) and simulated(t) for t in tensors)


def _patch_nested(put: Put, simulated: Callable[[Any], bool]) -> None:
    """``torch.nested.nested_tensor`` with the strided layout on the GPU stops with one line
    (`STRIDED_NESTED`): its C++ constructor is no torch function, so the CPU build would fail
    with "PyTorch is not linked with support for cuda devices"."""
    original = torch.nested.nested_tensor

    def nested_tensor(tensor_list: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("layout") in (None, torch.strided) and strided_nested_on_gpu(
                kwargs.get("device"), tensor_list if isinstance(tensor_list, (list, tuple)) else [], simulated):
            raise NotImplementedError(STRIDED_NESTED)
        return original(tensor_list, *args, **kwargs)

    put(torch.nested, "nested_tensor", nested_tensor)


def _patch_training(put: Put, clear_cache: Callable[[], None], simulated: Callable[[Any], bool],
                    exact: Callable[[Any], bool], function_mode: Any) -> None:
    """* ``torch.clear_autocast_cache`` (called when the outermost autocast exits) also runs
      `clear_cache`, the emulated autocast's weight-cast cache;
    * ``GradScaler._maybe_opt_step`` reads ``found_inf.item()``: for simulated tensors (for which
      `simulated` is true) whose values are not `exact` (known, not computed from placeholders;
      a real-values run knows them) it steps unconditionally, as a real run does whenever no
      inf/NaN gradient occurred;
    * ``torch._C._group_tensors_by_device_and_dtype`` keys a group of simulated tensors by
      ``cuda:N`` (C++ sees meta), so foreach paths chosen by device (``clip_grad_norm_``) are CUDA's.
    """
    from torch.amp.grad_scaler import GradScaler

    original_clear, original_step = torch.clear_autocast_cache, GradScaler._maybe_opt_step
    original_group = torch._C._group_tensors_by_device_and_dtype

    def clear_autocast_cache() -> None:
        clear_cache()
        original_clear()

    def maybe_opt_step(self: Any, optimizer: Any, optimizer_state: dict[str, Any], *args: Any,
                       **kwargs: Any) -> Any:
        if any(simulated(v) and not exact(v) for v in optimizer_state["found_inf_per_device"].values()):
            return optimizer.step(*args, **kwargs)
        return original_step(self, optimizer, optimizer_state, *args, **kwargs)

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

    put(torch, "clear_autocast_cache", clear_autocast_cache)
    put(GradScaler, "_maybe_opt_step", maybe_opt_step)
    put(torch._C, "_group_tensors_by_device_and_dtype", group)


def _patch_modules(put: Put, simulated: Callable[[Any], bool]) -> None:
    """* ``torch._has_compatible_shallow_copy_type`` says a host tensor and a simulated one are
      compatible (CPU and CUDA are, to a GPU run), so ``Module._apply`` moves Parameters in place
      with ``param.data = moved`` instead of making new ones (see
      ``vram.run.engine.function_mode.FunctionMode._set_data``);
    * ``Module.to(1)`` / ``Module.to(device=1)``: a device index is a CUDA device on a GPU build;
      ``Module.to`` parses it in C++ (``_parse_to``) as the current accelerator's, which a CPU build
      lacks ("Cannot access accelerator device", meta engine) or which is the PrivateUse1 engine's
      own numbering, so the index becomes ``cuda:N`` first (DDP examples: ``ToyModel().to(rank)``).
    """
    original_compatible, original_module_to = torch._has_compatible_shallow_copy_type, torch.nn.Module.to

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

    put(torch, "_has_compatible_shallow_copy_type", compatible)
    put(torch.nn.Module, "to", module_to)


def _patch_storages(put: Put, simulated: Callable[[Any], bool], resize: Callable[[Any, int, Callable[..., Any]], Any],
                    function_mode: Any) -> None:
    """* ``Tensor.record_stream`` of a simulated tensor goes to `function_mode` (which records the
      stream on its block): C++'s argument parser rejects a simulated Stream before any mode
      sees the call ("unknown parameter type"; FSDP1's ``_free_unsharded_flat_param``);
    * ``UntypedStorage.resize_`` (not an aten op, so invisible to dispatch modes; FSDP frees
      parameters with ``resize_(0)``) is ``resize(storage, size, original)``, which runs the
      original and lets the simulated block follow.
    """
    original_resize, original_record = torch.UntypedStorage.resize_, torch.Tensor.record_stream

    def resize_(self: Any, size: int) -> Any:
        return resize(self, size, original_resize)

    def record_stream(self: Any, stream: Any) -> None:
        if simulated(self):
            function_mode.__torch_function__(original_record, (), (self, stream), {})
        else:
            original_record(self, stream)

    put(torch.UntypedStorage, "resize_", resize_)
    put(torch.Tensor, "record_stream", record_stream)


def _patch_autograd(put: Put, function_mode: Any) -> None:
    """The autograd engine (``torch.autograd._engine_run_backward``, behind ``backward()`` and
    ``autograd.grad``) runs with `function_mode` on the torch-function mode stack. ``backward()``
    reaches the engine through that mode's own handler, where PyTorch pops the mode, and the
    engine's graph task keeps the mode stack it was started with: without this, Python code run
    during backward (custom ``Function.backward``, tensor hooks, saved-tensor unpack hooks, so
    ``torch.utils.checkpoint``'s recomputation) would run without the simulated GPU — no
    ``device="cuda"``, no emulated autocast, no SDPA routing, so checkpoint's recomputed tensors
    would differ from the forward's. Saved-tensor hooks (``saved_tensors_hooks``) run under it
    too: a pack hook runs inside an op, below the mode's handler, and would otherwise see a
    simulated tensor's ``device`` as meta in forward and as cuda when unpacked."""
    import torch.autograd.graph as autograd_graph
    from torch.overrides import _get_current_function_mode_stack

    original_engine = autograd_graph._engine_run_backward
    original_hooks_init = autograd_graph.saved_tensors_hooks.__init__

    def under_mode(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if function_mode in _get_current_function_mode_stack():
                return fn(*args, **kwargs)
            with function_mode:
                return fn(*args, **kwargs)
        return run

    def hooks_init(self: Any, pack_hook: Callable[..., Any], unpack_hook: Callable[..., Any]) -> None:
        original_hooks_init(self, under_mode(pack_hook), under_mode(unpack_hook))

    engine_under_mode = under_mode(original_engine)

    def engine(t_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        with function_mode.backward_scope(t_outputs):
            return engine_under_mode(t_outputs, *args, **kwargs)

    put(torch.autograd, "_engine_run_backward", engine)
    put(autograd_graph, "_engine_run_backward", engine)
    put(autograd_graph.saved_tensors_hooks, "__init__", hooks_init)


def _patch_host_side(put: Put, on_mode_stack: Callable[[], bool]) -> None:
    """Host-side services a CPU build of PyTorch lacks.

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
