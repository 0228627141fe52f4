"""Layer 1: named GPUs (``--gpu A100-80GB``) — what CUDA reports for real cards.

A preset's ``total_memory`` is ``cudaDeviceProp.totalGlobalMem`` in bytes, which is what
``torch.cuda.get_device_properties(0).total_memory`` and ``torch.cuda.mem_get_info()[1]`` return
and what the OOM message's "total capacity" shows. It is not nvidia-smi's "MiB" total (NVML's
framebuffer size, larger) and not the marketing size. It is also not a constant of the card: the
driver reserves a little, differently by version and settings (ECC), so one card reports values a
few tens of MiB apart on different machines. Each figure below was printed by CUDA's
``deviceQuery`` sample (or ``torch``) on a real card under the driver named in `source`; the
alternatives found are listed in docs/gpus.md. Cards for which no exact byte count could be
sourced (A10G, H100 PCIe: only MiB-rounded prints) have no preset: use ``--gpu <bytes>``.

The compute capability decides cuBLAS's workspace size and the SM count flash attention's split
heuristic (`vram.run.kernels.plan`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from vram.units import SizeOverflow, parse_size, shown_value

__all__ = ["CUDA_CONTEXT", "context_on", "GpuPreset", "GPU_PRESETS", "gpu_preset", "gpu_memory", "parse_arch",
           "resolve_gpu"]

#: The CUDA context's device memory, which nvidia-smi shows besides PyTorch's reserved memory and
#: which a program cannot allocate: 718,077,952 B (684.8 MiB) measured on an NVIDIA H200 (driver
#: 580.159.04, CUDA 13.0, torch 2.11.0+cu130; shared/gpu-truth/h200-2026-11-27/context.txt): device
#: memory used after a first matmul 774,701,056 B, less ``memory_reserved()`` 56,623,104 B. It is the
#: default of every "will it fit" answer (``vram run``/``estimate`` and `vram.estimate`); it depends
#: on the driver, CUDA and the kernels loaded (552,402,944 B right after ``torch.cuda.init()``).
CUDA_CONTEXT = 718_077_952


def context_on(gpu: object, context: int | str | None) -> int | str:
    """The CUDA context counted when replaying a recording: `context` as given, else `CUDA_CONTEXT`
    on a given GPU, else 0 (on the recording's own GPU its free memory already leaves it out)."""
    if context is not None:
        return context
    return CUDA_CONTEXT if gpu is not None else 0


@dataclass(frozen=True)
class GpuPreset:
    """One card as CUDA describes it."""

    key: str                     #: what a user types: ``--gpu A100-80GB``
    name: str                    #: ``cudaDeviceProp.name``
    total_memory: int            #: ``cudaDeviceProp.totalGlobalMem``, bytes
    major: int                   #: compute capability
    minor: int
    multi_processor_count: int   #: SMs
    source: str                  #: where `total_memory` was printed, and under which driver


_DQ = "deviceQuery output"
GPU_PRESETS: dict[str, GpuPreset] = {p.key: p for p in (
    GpuPreset("T4", "Tesla T4", 15_828_320_256, 7, 5, 40,
              "Google Colab, driver 550.54.15 / CUDA 12.4 (four independent prints agree)"),
    GpuPreset("V100-16GB", "Tesla V100-SXM2-16GB", 16_928_342_016, 7, 0, 80, f"{_DQ}, CUDA 12.4 driver"),
    GpuPreset("V100-32GB", "Tesla V100-SXM2-32GB", 34_072_559_616, 7, 0, 80,
              f"{_DQ}, CUDA 12.9 driver (github.com/infn-esc/esc25 gpu/cuda.md)"),
    GpuPreset("A10", "NVIDIA A10", 23_696_375_808, 8, 6, 72, f"{_DQ}, CUDA 12.8 driver"),
    GpuPreset("L4", "NVIDIA L4", 23_570_219_008, 8, 9, 58,
              f"{_DQ}, CUDA 12.4 driver (github.com/thamada/nvidia-smi gls/L4_deviceQuery.py)"),
    GpuPreset("A100-40GB", "NVIDIA A100-SXM4-40GB", 42_298_834_944, 8, 0, 108,
              f"{_DQ} on AWS p4d, CUDA 12.2 driver (github.com/bottlerocket-os/bottlerocket/pull/3873)"),
    GpuPreset("A100-PCIE-40GB", "NVIDIA A100-PCIE-40GB", 42_405_855_232, 8, 0, 108,
              f"{_DQ}, CUDA 13.0 driver"),
    GpuPreset("A100-80GB", "NVIDIA A100-SXM4-80GB", 85_100_068_864, 8, 0, 108,
              f"{_DQ}, CUDA 12.5 driver (github.com/thamada/nvidia-smi gls/A100SXMx4_deviceQuery.py)"),
    GpuPreset("A100-PCIE-80GB", "NVIDIA A100 80GB PCIe", 84_974_239_744, 8, 0, 108,
              f"{_DQ}, CUDA 12.4 driver (a single source)"),
    GpuPreset("H100", "NVIDIA H100 80GB HBM3", 85_017_755_648, 9, 0, 132, f"{_DQ}, CUDA 13.0 driver"),
    GpuPreset("H200", "NVIDIA H200", 150_110_011_392, 9, 0, 132,
              "a CUDA total printed on H200 nodes; torch prints the same card as 143156MB"),
    GpuPreset("L40S", "NVIDIA L40S", 47_803_596_800, 8, 9, 142,
              f"{_DQ}, CUDA 12.4 driver (github.com/thamada/nvidia-smi nvsim/L40S_deviceQuery.py); "
              "torch elsewhere prints 45589MB, the same MiB"),
    GpuPreset("RTX3090", "NVIDIA GeForce RTX 3090", 25_327_697_920, 8, 6, 82,
              f"{_DQ} on Linux, CUDA 12.6 driver (github.com/thamada/nvidia-smi gls/RTX3090_deviceQuery.py)"),
    GpuPreset("RTX4090", "NVIDIA GeForce RTX 4090", 25_386_352_640, 8, 9, 128,
              f"{_DQ} on Linux, CUDA 12.4 driver (github.com/thamada/nvidia-smi gls/RTX4090_deviceQuery.py)"),
    GpuPreset("RTX-A6000", "NVIDIA RTX A6000", 51_160_023_040, 8, 6, 84,
              f"{_DQ}, CUDA 12.7 driver (ECC off; with ECC on torch has printed 48676MB)"),
)}

_ALIASES = {"H100-80GB": "H100", "H100-SXM": "H100", "H100-80GB-HBM3": "H100",
            "A100-SXM4-80GB": "A100-80GB", "A100-SXM4-40GB": "A100-40GB", "A100-80GB-PCIE": "A100-PCIE-80GB",
            "V100-SXM2-16GB": "V100-16GB", "V100-SXM2-32GB": "V100-32GB", "A6000": "RTX-A6000",
            "GeForce-RTX-3090": "RTX3090", "GeForce-RTX-4090": "RTX4090", "3090": "RTX3090", "4090": "RTX4090"}


def _norm(text: str) -> str:
    return re.sub(r"[\s_\-]+", "", text).upper().removeprefix("NVIDIA").removeprefix("TESLA")


_BY_NORM = {_norm(k): k for k in GPU_PRESETS} | {_norm(a): k for a, k in _ALIASES.items()}


def gpu_preset(value: object) -> GpuPreset | None:
    """The preset a ``--gpu`` value names (case, spaces, ``-`` and ``_`` ignored), else None."""
    if not isinstance(value, str):
        return None
    key = _BY_NORM.get(_norm(value))
    return GPU_PRESETS[key] if key is not None else None


def gpu_memory(value: int | str, what: str = "gpu") -> int:
    """Bytes for a ``--gpu`` value: a preset's ``total_memory``, or a size (``24GiB``, an int)."""
    preset = gpu_preset(value)
    if preset is not None:
        return preset.total_memory
    hint = f"expected a byte count such as 24GiB or 80000000000, or a GPU name: {', '.join(GPU_PRESETS)}"
    try:
        total = parse_size(value, what)
    except SizeOverflow:
        raise
    except ValueError:
        raise ValueError(f"invalid {what} {shown_value(value)}: {hint}") from None
    if isinstance(value, str) and value.strip().isdigit() and total < 1 << 20:
        # "--gpu 24" is a 24-byte GPU to parse_size; nobody means that: say so instead
        raise ValueError(f"invalid {what} {shown_value(value)}: a bare number is bytes; {hint}")
    return total


def parse_arch(text: str) -> tuple[int, int]:
    """A compute capability: ``9.0``, ``sm90`` or ``sm_86`` -> (major, minor)."""
    t = str(text).strip().lower().removeprefix("sm").removeprefix("_")
    if "." in t:
        major, _, minor = t.partition(".")
    elif t.isdigit() and len(t) >= 2:
        major, minor = t[:-1], t[-1]
    else:
        major, minor = "", ""
    if not (major.isdigit() and minor.isdigit()):
        raise ValueError(f"invalid arch {text!r}: expected a compute capability such as 9.0, sm80 or sm_86")
    return int(major), int(minor)


def resolve_gpu(gpu: int | str | GpuPreset, arch: str | None = None) -> GpuPreset:
    """The card a ``--gpu`` value (and ``--arch``) describe.

    A preset (by name, or a `GpuPreset` itself, e.g. one resolved before) is that card (`arch`
    overrides its compute capability). A size is a GPU of that
    many bytes that is otherwise an H100 (sm90, 132 SMs) — or, with `arch`, a GPU of that compute
    capability (its name says so; the SM count, which only flash attention's split heuristic
    reads, stays 132).
    """
    preset = gpu if isinstance(gpu, GpuPreset) else gpu_preset(gpu)
    cc = parse_arch(arch) if arch is not None else None
    if preset is not None:
        return preset if cc is None else replace(preset, major=cc[0], minor=cc[1])
    assert not isinstance(gpu, GpuPreset)
    total = gpu_memory(gpu)
    major, minor = cc if cc is not None else (9, 0)
    name = "NVIDIA H100 (simulated by vram)" if (major, minor) == (9, 0) else \
        f"NVIDIA GPU sm_{major}{minor} (simulated by vram)"
    return GpuPreset("", name, total, major, minor, 132, "")


def max_threads_per_sm(major: int, minor: int) -> int:
    """``cudaDeviceProp::maxThreadsPerMultiProcessor`` by compute capability (CUDA C Programming
    Guide, "Technical Specifications per Compute Capability": 1,024 on 7.5, 1,536 on 8.6, 8.9 and
    12.x, 2,048 otherwise)."""
    if (major, minor) == (7, 5):
        return 1024
    if (major, minor) in ((8, 6), (8, 9)) or major == 12:
        return 1536
    return 2048
