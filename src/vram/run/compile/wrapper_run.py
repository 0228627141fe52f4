"""Run an Inductor CUDA wrapper on the simulated GPU (inside `vram.run.runtime.simulated_cuda`).

The wrapper's module is executed as Inductor's ``PyCodeCache`` would load it, with three things
answered for the simulation: its Triton kernels (and the C++ kernels of host scalars,
`_host_kernel`) are never built and launch as no-ops
(``AsyncCompile.triton``; a Triton kernel allocates nothing of its own; given the kernels' configs,
the first launch autotunes as on a GPU: `autotune.AutotunedKernel`), ``empty_strided_cuda``
is ``torch.empty_strided(..., device="cuda")`` (the simulated GPU's allocation, as
``_empty_strided_cuda`` is the caching allocator's on a GPU), and ``get_raw_stream`` answers the
default stream. Its extern kernels (``extern_kernels.mm(..., out=)``, ``torch.ops.aten.*``) run
on the simulated GPU and allocate what `vram.run.kernels` says their CUDA kernels allocate.
Needs triton importable (the generated module imports it).
"""
from __future__ import annotations

import types
from typing import Any

import torch

from .autotune import AutotunedKernel
from .cuda_process import UnbuiltKernel


def _host_kernel(*args: Any) -> None:
    """A C++ kernel Inductor generates for host tensors in a CUDA graph (a 0-d CPU scalar cast for
    the GPU kernels): it writes host buffers the wrapper made (``empty_strided_cpu``), never GPU
    memory, and its values feed only kernels that compute nothing here: not built, not run."""


def _empty_strided_cuda(size: Any, stride: Any, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device="cuda")


def load_wrapper(source: str, name: str = "inductor_wrapper",
                 kernels: dict[str, dict[str, Any]] | None = None) -> types.ModuleType:
    """The wrapper module of `source`, ready to ``call`` on the simulated GPU. With `kernels`
    (`autotune.kernel_configs` of this source), each kernel's first launch autotunes as on a GPU."""
    from torch._inductor.async_compile import AsyncCompile

    saved = AsyncCompile.triton, AsyncCompile.wait, AsyncCompile.cpp_pybinding
    had_stream = hasattr(torch._C, "_cuda_getCurrentRawStream")

    def triton(self: Any, kernel_name: str, source_code: str, device_str: str = "cuda", **kwargs: Any) -> Any:
        if kernels is not None:
            return AutotunedKernel(kernel_name, kernels.get(kernel_name))
        return UnbuiltKernel(kernel_name, source_code)

    module = types.ModuleType(name)
    AsyncCompile.triton = triton  # type: ignore[method-assign]
    AsyncCompile.wait = lambda self, scope: None  # type: ignore[method-assign]
    AsyncCompile.cpp_pybinding = lambda self, argtypes, source_code: _host_kernel  # type: ignore[method-assign]
    if not had_stream:
        torch._C._cuda_getCurrentRawStream = lambda device: 0  # a CPU build has none to import
    try:
        exec(compile(source, f"<{name}>", "exec"), module.__dict__)  # noqa: S102 - Inductor's generated code
    finally:
        AsyncCompile.triton, AsyncCompile.wait, AsyncCompile.cpp_pybinding = saved  # type: ignore[method-assign]
        if not had_stream:
            del torch._C._cuda_getCurrentRawStream
    module.empty_strided_cuda = _empty_strided_cuda
    module.get_raw_stream = lambda device: 0
    return module


def call(module: types.ModuleType, args: list[Any]) -> Any:
    """``call(args)`` of a loaded wrapper (a ``Runner`` method or a module function). The wrapper
    clears `args` as it starts and drops each input after its last use, as on a GPU: pass a list
    nothing else holds, so inputs are freed where they would be."""
    runner = getattr(module, "runner", None)
    return runner.call(args) if runner is not None else module.call(args)
