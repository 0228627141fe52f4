"""`--gpu` presets (vram.devices.gpus): CUDA's own figures for real cards.

Expected values are the sourced figures (deviceQuery / torch prints on real cards, docs/gpus.md)
and, independently, what real PyTorch OOM messages on those cards print: Colab's T4 reports
"GPU 0 has a total capacity of 14.74 GiB" in its current-format OOM messages (many public
reports; spec §15's format_size of totalGlobalMem).
"""
from __future__ import annotations

import pytest

from vram import SimulatedDevice
from vram.devices.gpus import GPU_PRESETS, gpu_memory, gpu_preset, parse_arch, resolve_gpu
from vram.units import format_size


def test_presets_resolve_by_key_and_by_cuda_name() -> None:
    for key, p in GPU_PRESETS.items():
        assert gpu_preset(key) is p and gpu_preset(key.lower()) is p
        assert gpu_preset(p.name) is p, p.name  # what torch.cuda.get_device_name() prints
    assert gpu_preset("a100_80gb").key == "A100-80GB"
    assert gpu_preset("NVIDIA GeForce RTX 4090").key == "RTX4090"
    assert gpu_preset("A100") is None          # ambiguous (40 or 80 GB): no guess
    assert gpu_preset("24GiB") is None and gpu_preset(24) is None


def test_t4_total_capacity_matches_colab_oom_messages() -> None:
    assert gpu_memory("T4") == 15_828_320_256
    assert format_size(gpu_memory("T4")) == "14.74 GiB"


def test_sizes_still_work_and_bad_values_name_the_presets() -> None:
    assert gpu_memory("24GiB") == 24 << 30 and gpu_memory(1000) == 1000
    with pytest.raises(ValueError, match="A100-80GB"):
        gpu_memory("A10G")  # no exact byte count could be sourced: not a preset
    with pytest.raises(ValueError):
        gpu_memory("-1GiB")
    with pytest.raises(ValueError, match="a bare number is bytes"):
        gpu_memory("24")           # meant 24 GB: refused rather than a 24-byte GPU
    assert gpu_memory("4090") == GPU_PRESETS["RTX4090"].total_memory  # a card, not 4,090 bytes


def test_resolve_gpu_and_arch() -> None:
    a100 = resolve_gpu("A100-80GB")
    assert (a100.name, a100.major, a100.minor, a100.multi_processor_count) == ("NVIDIA A100-SXM4-80GB", 8, 0, 108)
    assert resolve_gpu("A100-80GB", "9.0").major == 9
    size = resolve_gpu("24GiB")
    assert (size.total_memory, size.major, size.minor) == (24 << 30, 9, 0)
    assert resolve_gpu("24GiB", "sm_86").major == 8
    assert parse_arch("8.6") == (8, 6) and parse_arch("sm75") == (7, 5)
    with pytest.raises(ValueError, match="arch"):
        parse_arch("ampere")


def test_simulated_device_takes_a_preset() -> None:
    d = SimulatedDevice("H100", context="500MiB")
    assert d.total_memory == 85_017_755_648 and d.name == "NVIDIA H100 80GB HBM3"
    assert SimulatedDevice("H100", name="mine").name == "mine"
