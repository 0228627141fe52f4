"""Layer 1: a card's clocks, memory bus and shared memory as its driver and ``nvidia-smi`` report
them: what Inductor's compile-time cost model reads on a GPU.

``pad_mm.is_mm_compute_bound`` (torch/_inductor/fx_passes/pad_mm.py) compares a matmul's
arithmetic intensity with ``0.5 * 1000 * get_device_tflops(dtype) / get_gpu_dram_gbps()``
(torch/_inductor/utils.py). A card named in Inductor's datasheet table
(``torch/_inductor/analysis/device_info.py``, by exact ``get_device_name()``: "NVIDIA H100",
"NVIDIA A100", "NVIDIA L4") has its TFLOPS from there; every other card has them from Triton:
``triton.testing.get_max_tensorcore_tflops`` (``float16``/``bfloat16`` on sm80+, ``float32`` with
TF32) or ``get_max_simd_tflops``, ``SMs * 4 * clock_rate * ops_per_sub_core * 1e-9``, with
``clock_rate`` from ``torch._utils_internal.max_clock_rate()``: ``nvidia-smi
--query-gpu=clocks.max.sm`` in MHz, where Triton's formula wants kHz (pytorch/pytorch#196372), so
the figure is 1000 times too small. The bandwidth always comes from Triton's driver,
``get_dram_gbps() = memory_clock_khz * bus_width * 2 / 1e6 / 8`` (``cuDeviceGetAttribute``'s
``MEMORY_CLOCK_RATE`` and ``GLOBAL_MEMORY_BUS_WIDTH``). ``pad_mm``'s learned heuristics
(``torch/_inductor/autoheuristic``) key on ``max_shared_mem``
(``MAX_SHARED_MEMORY_PER_BLOCK_OPTIN``) and the compute capability.

`CARD_CLOCKS` holds the cards where a print of these figures was found (by ``cudaDeviceProp.name``,
as `vram.devices.gpus` names them); a card without an entry has no clocks here, and the compile
process answers for it as a machine without ``nvidia-smi`` would.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CardClocks", "CARD_CLOCKS", "card_clocks", "max_shared_memory_per_block_optin"]


@dataclass(frozen=True)
class CardClocks:
    """One card's clocks and memory bus as its driver and ``nvidia-smi`` report them."""

    max_sm_clock_mhz: int | None  #: ``nvidia-smi --query-gpu=clocks.max.sm`` (MHz); None: no print found
    sm_clock_khz: int             #: ``CU_DEVICE_ATTRIBUTE_CLOCK_RATE`` (deviceQuery's "GPU Max Clock rate")
    memory_clock_khz: int         #: ``CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE`` (deviceQuery's "Memory Clock rate")
    memory_bus_width: int         #: ``CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH``, bits
    source: str

    def dram_gbps(self) -> float:
        """Triton's ``get_dram_gbps()`` for this card (triton/testing.py)."""
        return self.memory_clock_khz * self.memory_bus_width * 2 / 1e6 / 8


_NVSIM = "github.com/thamada/nvidia-smi nvsim/"
CARD_CLOCKS: dict[str, CardClocks] = {
    "NVIDIA H100 80GB HBM3": CardClocks(
        1980, 1_980_000, 2_619_000, 5120,
        f"nvidia-smi -q 'Max Clocks: SM 1980 MHz' ({_NVSIM}H100SXMx8_smi.py, driver 565.57.01); deviceQuery "
        f"'GPU Max Clock rate 1980 MHz, Memory Clock rate 2619 Mhz, Memory Bus Width 5120-bit' "
        f"({_NVSIM}H100SXMx8_deviceQuery.py, CUDA 12.7 driver)"),
    "NVIDIA A100-SXM4-80GB": CardClocks(
        1410, 1_410_000, 1_593_000, 5120,
        "nvidia-smi -q of an A100-SXM4-80GB, driver 525.60.13: 'Max Clocks: SM 1410 MHz, Memory 1593 MHz'; "
        "the bus: five 1024-bit HBM2e stacks (NVIDIA A100 Tensor Core GPU Architecture whitepaper)"),
    "NVIDIA L4": CardClocks(
        None, 2_040_000, 6_251_000, 192,
        "deviceQuery 'GPU Max Clock rate 2040 MHz, Memory Clock rate 6251 Mhz, Memory Bus Width 192-bit' "
        "(github.com/thamada/nvidia-smi gls/L4_deviceQuery.py, CUDA 12.4 driver); its TFLOPS come from "
        "Inductor's datasheet table, so nvidia-smi's clock is not read"),
}


def card_clocks(name: str) -> CardClocks | None:
    """The clocks of the card named `name` (``cudaDeviceProp.name``), if a print of them was found."""
    return CARD_CLOCKS.get(name)


def max_shared_memory_per_block_optin(major: int, minor: int) -> int | None:
    """``cudaDevAttrMaxSharedMemoryPerBlockOptin`` by compute capability (CUDA C++ Programming
    Guide, "Technical Specifications per Compute Capability": 96 KB on 7.0, 64 KB on 7.5, 163 KB
    on 8.0 and 8.7, 99 KB on 8.6, 8.9 and 12.x, 227 KB on 9.0 and 10.x); None for others."""
    kib = {(7, 0): 96, (7, 5): 64, (8, 0): 163, (8, 7): 163, (8, 6): 99, (8, 9): 99}.get((major, minor))
    if kib is None and major in (9, 10, 12):
        kib = 99 if major == 12 else 227
    return kib * 1024 if kib is not None else None
