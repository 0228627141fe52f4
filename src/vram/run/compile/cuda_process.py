"""Make this (fresh) process one where Inductor compiles for ``cuda`` without a GPU.

`prepare` must run before ``import torch`` (see the package docstring and ``sim_cuda.cpp``). It
loads the CUDA hooks library, then answers what a compile asks of the CUDA runtime with the
simulated card: ``torch.cuda`` (availability, properties, device index, RNG state),
``torch._dynamo.device_interface.CudaInterface`` (what Inductor's codegen and heuristics read),
Triton's presence (``torch.utils._triton``; Inductor refuses to schedule GPU kernels without it)
and the triton hash (Triton's driver needs a GPU to name its target).

Real CUDA tensors that compile-time code makes (the pattern matcher's example inputs in
``fx_passes/fuse_attention.py`` ``_get_sfdp_patterns``, constant folding's
``joint_graph._deduce_value``) are made on the CPU instead (`_register_cuda_kernels`): they are
examples and one-element values, never part of the program. On a GPU they are real allocations of
a few bytes, freed at once (the H200 recording shows them): not modelled.

``_fused_sdp_choice`` on a CUDA tensor answers what ``select_sdp_backend`` picks on the simulated
card (`vram.run.kernels.sdpa.select_sdpa_backend`).
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

_SOURCE = Path(__file__).with_name("sim_cuda.cpp")
#: ``sdp::SDPBackend`` values (aten/src/ATen/native/transformers/sdp_utils_cpp.h)
SDP_BACKENDS = {"math": 0, "flash": 1, "efficient": 2, "cudnn": 3}
_LIBS: list[Any] = []  # the loaded hooks library, and the CUDA kernel registrations
#: choices Inductor makes by benchmarking on the GPU at compile time, met since the last clear:
#: each made as named (the compile process reports them; the run says them)
GUESSED: set[str] = set()


class CompileSetupError(RuntimeError):
    """This process cannot be made to compile for CUDA (named reason)."""


def _torch_dir() -> Path:
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise CompileSetupError("torch is not installed")
    return Path(spec.origin).parent


def build_library(cache: Path | None = None) -> Path:
    """``sim_cuda.cpp`` built against the installed torch (g++), cached by source and torch build."""
    torch_dir = _torch_dir()
    version = (torch_dir / "version.py").read_bytes()
    key = hashlib.sha256(_SOURCE.read_bytes() + version).hexdigest()[:16]
    folder = cache or Path(os.environ.get("VRAM_CACHE", Path.home() / ".cache" / "vram")) / "compile"
    target = folder / f"sim_cuda_{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    include, lib = torch_dir / "include", torch_dir / "lib"
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    command = ["g++", "-O1", "-shared", "-fPIC", "-std=c++17", f"-I{include}",
               f"-I{sysconfig.get_paths()['include']}", str(_SOURCE), f"-L{lib}", f"-Wl,-rpath,{lib}",
               "-lc10", "-ltorch_cpu", "-o", str(tmp)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise CompileSetupError("modelling torch.compile needs a C++ compiler (g++) on PATH") from None
    if done.returncode != 0:
        raise CompileSetupError(f"building {_SOURCE.name} failed: {done.stderr.strip().splitlines()[-1:]}")
    tmp.replace(target)
    return target


def prepare(major: int = 9, minor: int = 0, name: str = "NVIDIA H200", total_memory: int = 150_110_011_392,
            multi_processor_count: int = 132, l2_cache_size: int = 60 * 1024 * 1024) -> None:
    """Set this process up to compile for the simulated card (see the module docstring)."""
    if _LIBS:
        return
    if "torch" in sys.modules:
        raise CompileSetupError("vram.run.compile.cuda_process.prepare must run before torch is imported")
    hooks = ctypes.CDLL(str(build_library()), os.RTLD_GLOBAL)
    from vram.run.kernels.sdpa_choice import CUDNN_VERSION  # imports torch, after the hooks

    hooks.vram_sim_cuda_set(ctypes.c_int(major), ctypes.c_long(CUDNN_VERSION))  # read at each hook call
    _LIBS.append(hooks)
    import torch

    from vram.run.cuda.api import DeviceProperties

    props = DeviceProperties(name, total_memory, major, minor, multi_processor_count)
    props.L2_cache_size = l2_cache_size
    _patch_cuda_module(torch, props)
    _patch_inductor(torch, props)
    from .matmul_padding import patch_pad_mm

    patch_pad_mm({"name": name, "major": major, "minor": minor, "multi_processor_count": multi_processor_count})
    _register_cuda_kernels(torch, major, minor)


def _patch_cuda_module(torch: Any, props: Any) -> None:
    """``torch.cuda`` as a one-GPU CUDA build answers it, for what compilation asks."""
    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda._lazy_init = lambda: None  # nothing to initialise (torch.accelerator calls back into it)
    cuda.device_count = lambda: 1
    cuda.current_device = lambda: 0
    cuda.get_device_properties = lambda device=None: props
    cuda.get_device_capability = lambda device=None: (props.major, props.minor)
    cuda.get_rng_state = lambda device="cuda": torch.zeros(16, dtype=torch.uint8)
    cuda.set_rng_state = lambda *args, **kwargs: None
    cuda._exchange_device = lambda device: 0
    cuda._maybe_exchange_device = lambda device: 0
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    torch._C._cuda_getCurrentRawStream = lambda device: 0
    torch._C._cuda_cudaCachingAllocator_is_enabled = lambda: True  # CUDA graphs' check (cudagraph_utils.py)


def _patch_inductor(torch: Any, props: Any) -> None:
    """Inductor's view of the device (``CudaInterface``) and of Triton, and no kernel ever built:
    ``AsyncCompile.triton`` returns a kernel whose ``run`` does nothing (the wrapper's buffers are
    what is modelled; a kernel allocates nothing of its own)."""
    import torch._functorch.config
    import torch.utils._triton as triton_utils
    from torch._dynamo import device_interface
    from torch._inductor import config
    from torch._inductor.async_compile import AsyncCompile

    interface = device_interface.CudaInterface
    cc = props.major * 10 + props.minor
    interface.get_device_properties = staticmethod(lambda device=None: props)
    interface.Worker.get_device_properties = staticmethod(lambda device=None: props)
    interface.is_available = staticmethod(lambda: True)
    interface.current_device = staticmethod(lambda: 0)
    interface.Worker.current_device = staticmethod(lambda: 0)
    interface.get_compute_capability = staticmethod(lambda device=None: cc)
    triton_utils.has_triton = lambda: True
    triton_utils.triton_hash_with_backend = lambda: "vram-simulated-cuda"
    config.compile_threads = 1
    config.fx_graph_cache = False
    config.autotune_local_cache = False
    torch._functorch.config.force_non_lazy_backward_lowering = True  # the backward's wrapper now

    def triton(self: Any, kernel_name: str, source_code: str, device_str: str = "cuda", **kwargs: Any) -> Any:
        return UnbuiltKernel(kernel_name, source_code)

    AsyncCompile.triton = triton
    AsyncCompile.wait = lambda self, scope: None


class UnbuiltKernel:
    """A Triton kernel Inductor generated and nothing built: its source, and a launch that does nothing."""

    def __init__(self, name: str, source: str) -> None:
        self.name, self.source = name, source

    def run(self, *args: Any, **kwargs: Any) -> None:
        return None


def _register_cuda_kernels(torch: Any, major: int, minor: int) -> None:
    """Every aten op with a CPU kernel gets a CUDA kernel that runs it on the CPU (see the module
    docstring; per-op registrations, since a Python fallback is not reached with a mode on the
    stack), and ``_fused_sdp_choice`` answers the simulated card's choice. (The composite
    ``scaled_dot_product_attention`` calls the CUDA *stub*, which a CPU build lacks, not this op:
    `vram.run.compile.inductor_cuda.route_sdpa` routes it in the graph.)"""
    from torch.utils._pytree import tree_map

    from vram.run.kernels.sdpa_choice import sdpa_args, select_sdpa_backend

    cpu = torch.device("cpu")

    def host(value: Any) -> Any:
        if isinstance(value, torch.device) and value.type == "cuda":
            return cpu
        return value

    def on_host(op: Any) -> Any:
        return lambda *args, **kwargs: op(*tree_map(host, args), **tree_map(host, kwargs))

    def sdp_choice(*args: Any, **kwargs: Any) -> int:
        return SDP_BACKENDS[select_sdpa_backend(sdpa_args(args, kwargs), major, minor)]

    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - CUDA kernels of a CPU build
    for qualified in torch._C._dispatch_get_all_op_names():
        name, _, overload = qualified.removeprefix("aten::").partition(".")
        if not qualified.startswith("aten::") or name == "_fused_sdp_choice":
            continue
        if not torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CPU"):
            continue
        op = getattr(getattr(torch.ops.aten, name), overload or "default", None)
        if op is not None:
            lib.impl(qualified.removeprefix("aten::"), on_host(op), "CUDA")
    lib.impl("_fused_sdp_choice", sdp_choice, "CUDA")
    _LIBS.append(lib)
