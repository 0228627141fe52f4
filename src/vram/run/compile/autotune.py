"""First-launch autotuning of Inductor's Triton kernels, as it allocates on a GPU.

A generated kernel is a ``CachingAutotuner`` (torch/_inductor/runtime/triton_heuristics.py) built by
its ``@triton_heuristics.pointwise / reduction / persistent_reduction`` decorator with a list of
configs. At its first launch (``CachingAutotuner.run``), a kernel with more than one config is
benchmarked once per config (``autotune_to_one_config`` -> ``benchmark_all_configs`` -> ``bench``),
each through ``InductorBenchmarker.benchmark_gpu`` (runtime/benchmarking.py): a warm-up call, then
an L2-flush buffer of ``L2_cache_size`` bytes (``torch.empty(L2 // 4, dtype=torch.int)``) held
while the timed calls run, freed at the end. Each call (``bench``'s ``kernel_call``) first clones
the arguments the kernel mutates (``maybe_clone_args``: ``clone_preserve_strides``, the storage up
to the largest offset), dropped when the call returns; with ``optimize_mem`` an argument larger
than the headroom under the peak (``copy_args_to_cpu_if_needed``: ``max_memory_allocated() -
memory_allocated()``, spent argument by argument) is copied to pinned host memory instead and not
cloned. The timed calls repeat one call's allocations and frees, so one stands for them all.

`kernel_configs` (in the compile process) reads what each kernel's decorator built; `AutotunedKernel`
(in the run) replays the allocations. Not modelled: configs a GPU build drops before benchmarking
(ones that fail to compile, or spill more than ``spill_threshold`` registers: known only from
Triton's compiled kernel), and the autotune caches (a first run on an empty cache is modelled).

With ``coordinate_descent_tuning`` (``max-autotune``), every kernel's first launch then benchmarks
configs around the chosen one (``coordinate_descent_tuning`` -> ``bench``): the same clones and
flush buffer per benchmark, so one more round stands for them.
"""
from __future__ import annotations

import linecache
import re
from typing import Any

_KERNEL = re.compile(r"^\w+ = async_compile\.triton\('(\w+)', '''(.*?)''', device_str='cuda'\)", re.S | re.M)


def kernel_configs(wrapper_source: str) -> dict[str, dict[str, Any]]:
    """For each Triton kernel of a generated wrapper: how many configs its decorator kept
    (``len(CachingAutotuner.configs)``), the arguments it mutates, its argument names and
    ``optimize_mem``. Runs in a `cuda_process`-prepared process (the decorator reads the card)."""
    from torch._inductor.runtime import triton_helpers

    saved = triton_helpers.set_driver_to_gpu
    triton_helpers.set_driver_to_gpu = lambda: None  # Triton's CUDA driver needs libcuda: nothing launches here
    kernels = {}
    try:
        for name, source in _KERNEL.findall(wrapper_source):
            filename = f"<triton kernel {name}>"
            linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # @triton.jit reads it
            namespace: dict[str, Any] = {"__file__": filename, "__name__": name}
            exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - Inductor's generated kernel
            tuner = namespace[name]
            kernels[name] = {"configs": len(tuner.configs), "mutated": list(tuner.mutated_arg_names),
                             "arg_names": list(tuner.fn.arg_names), "optimize_mem": bool(tuner.optimize_mem),
                             "coordesc": bool(tuner.inductor_meta.get("coordinate_descent_tuning"))}
            linecache.cache.pop(filename, None)
    finally:
        triton_helpers.set_driver_to_gpu = saved
    return kernels


class AutotunedKernel:
    """A generated Triton kernel on the simulated GPU: launches compute nothing; the first one
    autotunes as on a GPU (see the module docstring)."""

    def __init__(self, name: str, info: dict[str, Any] | None) -> None:
        self.name, self.info = name, info
        self.tuned = info is None or (info["configs"] <= 1 and not info.get("coordesc"))

    def run(self, *args: Any, **kwargs: Any) -> None:
        if not self.tuned:
            self.tuned = True
            self.autotune(args)

    def autotune(self, args: tuple[Any, ...]) -> None:
        import torch

        info = self.info
        assert info is not None
        mutated = [(name, arg) for name, arg in zip(info["arg_names"], args) if name in info["mutated"]]
        flush_elements = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size // 4
        rounds = info["configs"] if info["configs"] > 1 else 0
        for _ in range(rounds + (1 if info.get("coordesc") else 0)):
            on_host = self.copied_to_host(mutated) if info["optimize_mem"] else set()
            self.call(mutated, on_host)  # benchmark_gpu's warm-up
            flush = torch.empty(flush_elements, dtype=torch.int, device="cuda")
            self.call(mutated, on_host)  # the timed calls
            del flush

    @staticmethod
    def copied_to_host(mutated: list[tuple[str, Any]]) -> set[str]:
        """``copy_args_to_cpu_if_needed``: the mutated arguments cloning would push past the peak."""
        import torch

        budget = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        on_host = set()
        for name, arg in mutated:
            size = _storage_length(arg) * arg.element_size()
            if size > budget:
                on_host.add(name)
            else:
                budget -= size
        return on_host

    @staticmethod
    def call(mutated: list[tuple[str, Any]], on_host: set[str]) -> None:
        """``bench``'s ``kernel_call``: clones of the mutated arguments, dropped after the launch."""
        import torch

        clones = [torch.empty(_storage_length(arg), dtype=arg.dtype, device="cuda")
                  for name, arg in mutated if name not in on_host]
        del clones


def _storage_length(t: Any) -> int:
    """``compute_required_storage_length`` / ``clone_preserve_strides``: elements up to the largest offset."""
    if 0 in t.size():
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.size(), t.stride()))
