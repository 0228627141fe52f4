"""Inductor's ``pad_mm`` (torch/_inductor/fx_passes/pad_mm.py) as the compile process runs it
(`vram.run.compile.matmul_padding`): the rules that need no GPU decide as on the simulated card,
fed the card's clocks and bus (`vram.devices.clocks`); a matmul only a benchmark decides is
compiled unpadded and said once, with what padding would allocate. Expectations are derived by
hand from pad_mm.py, torch/_inductor/utils.py, triton/testing.py and the learned heuristics in
torch/_inductor/autoheuristic/artifacts."""
from __future__ import annotations

import json
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

from vram.devices.clocks import CARD_CLOCKS, card_clocks, max_shared_memory_per_block_optin
from vram.devices.gpus import GPU_PRESETS
from vram.run.compile.matmul_padding import padding_bytes

needs_triton = pytest.mark.skipif(find_spec("triton") is None, reason="needs triton (the 'compile' extra)")


def test_padding_bytes_are_the_padded_copies_and_the_outputs_growth() -> None:
    """pad_mm pads with ``constant_pad_nd`` (a copy) each operand that has a padded dimension
    and slices a larger output back; fp16/bf16 align to 8, fp32 to 4, a size of 1 is not padded."""
    # fp16 (64, 1000) @ (1000, 1001): n 1001 -> 1008; mat2 copy 1000*1008*2, output 64*7*2 larger
    assert padding_bytes(1, (64, 1000, 1001), (0, 0, 7), (2, 2)) == 2_016_000 + 896
    # ... as addmm with a (1001,) bias: the bias padded to (1008,)
    assert padding_bytes(1, (64, 1000, 1001), (0, 0, 7), (2, 2), bias=[1001]) == 2_016_896 + 2016
    # a (1, 1001) bias pads along n; a (64, 1) one is broadcast and not padded
    assert padding_bytes(1, (64, 1000, 1001), (0, 0, 7), (2, 2), bias=[1, 1001]) == 2_016_896 + 2016
    assert padding_bytes(1, (64, 1000, 1001), (0, 0, 7), (2, 2), bias=[64, 1]) == 2_016_896
    # fp32 (61, 64) @ (64, 66) with a (61, 66) bias: m 61 -> 64, n 66 -> 68; the bias is padded
    # along n, (61, 68), then m, (64, 68): two copies
    assert padding_bytes(1, (61, 64, 66), (3, 0, 2), (4, 4), bias=[61, 66]) == (
        64 * 64 * 4 + 64 * 68 * 4 + (64 * 68 - 61 * 66) * 4 + 61 * 68 * 4 + 64 * 68 * 4)
    # GPT-2's LM head in bf16: (8192, 768) @ (768, 50257) -> (768, 50264) copy, output 8192*7*2 larger
    assert padding_bytes(1, (8192, 768, 50257), (0, 0, 7), (2, 2)) == 768 * 50264 * 2 + 8192 * 7 * 2
    # its input gradient, (8192, 50257) @ (50257, 768): both operands copied along k
    assert padding_bytes(1, (8192, 50257, 768), (0, 7, 0), (2, 2)) == (8192 + 768) * 50264 * 2
    # fp32 bmm (12, 197, 64) @ (12, 64, 197): m and n 197 -> 200
    assert padding_bytes(12, (197, 64, 197), (3, 0, 3), (4, 4)) == (
        12 * 200 * 64 * 4 * 2 + 12 * (200 * 200 - 197 * 197) * 4)


def test_card_clocks_are_for_named_presets_and_shared_memory_by_capability() -> None:
    assert set(CARD_CLOCKS) <= {p.name for p in GPU_PRESETS.values()}
    assert card_clocks("NVIDIA H200") is None  # no print of its clocks found: unknown, not guessed
    h100 = card_clocks("NVIDIA H100 80GB HBM3")
    assert h100 is not None and h100.dram_gbps() == 2_619_000 * 5120 * 2 / 1e6 / 8 == 3352.32
    # the learned heuristics' keys: 166912 B on an A100 (8.0), 232448 B on an H100/H200 (9.0)
    assert max_shared_memory_per_block_optin(8, 0) == 166_912 and max_shared_memory_per_block_optin(9, 0) == 232_448
    assert max_shared_memory_per_block_optin(8, 9) == 101_376 and max_shared_memory_per_block_optin(11, 0) is None


_PROBE = """
import json, sys
from vram.run.compile import cuda_process
card = json.loads(sys.argv[1])
cuda_process.prepare(**card)
import torch
from torch._inductor import utils
from torch._inductor.fx_passes import pad_mm
from vram.run.compile.matmul_padding import card_answers
with card_answers(card):
    out = {}
    for name, dtype in (("fp16", torch.float16), ("fp32", torch.float32)):
        try:
            out[name] = utils.get_device_tflops(dtype)
        except Exception as e:
            out[name] = type(e).__name__
    try:
        out["gbps"] = utils.get_gpu_dram_gbps()
    except Exception as e:
        out["gbps"] = type(e).__name__
    out["shared"] = utils.get_gpu_shared_memory()
    out["bound"] = [pad_mm.is_mm_compute_bound(m, k, n, torch.float16) for m, k, n in
                    ((64, 1000, 1001), (2048, 2048, 2049), (3, 3, 3))]
print(json.dumps(out))
"""


def _probe(preset: str) -> dict[str, object]:
    p = GPU_PRESETS[preset]
    card = {"name": p.name, "major": p.major, "minor": p.minor, "total_memory": p.total_memory,
            "multi_processor_count": p.multi_processor_count}
    done = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(card)], capture_output=True, text=True,
                          timeout=300, check=False, cwd=Path(__file__).parent)
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow
@needs_triton
def test_inductors_cost_model_reads_the_simulated_cards_figures() -> None:
    """``get_device_tflops``: the datasheet table by exact name (an L4: 242 fp16, 30.3 fp32), else
    Triton's ``SMs * 4 * clock * ops * 1e-9`` with nvidia-smi's MHz clock where kHz is meant (an
    H100: 132*4*1980*512e-9 fp16 tensor cores, *32 fp32 SIMD without TF32); ``get_gpu_dram_gbps``:
    Triton's memory clock (kHz) * bus * 2 / 1e6 / 8. ``is_mm_compute_bound``: intensity
    m*k*n/(mk+kn+mn) above half the machine balance 1000*tflops/gbps: on the L4 (balance 403.3)
    a (64, 1000, 1001) matmul (intensity 56.7) is memory bound, (2048, 2048, 2049) (682.8) is
    not; on the H100 (0.0799) even (3, 3, 3) (intensity 1) is compute bound. A card without a
    print of its clocks (the H200) raises there, as without nvidia-smi: compute bound."""
    l4 = _probe("L4")
    assert l4["fp16"] == 242.0 and l4["fp32"] == 30.3 and l4["gbps"] == 6_251_000 * 192 * 2 / 1e6 / 8
    assert l4["shared"] == 101_376 and l4["bound"] == [False, True, False]
    h100 = _probe("H100")
    assert h100["fp16"] == pytest.approx(132 * 4 * 1980 * 512 * 1e-9, rel=1e-12)
    assert h100["fp32"] == pytest.approx(132 * 4 * 1980 * 32 * 1e-9, rel=1e-12)
    assert h100["gbps"] == 3352.32 and h100["shared"] == 232_448 and h100["bound"] == [True, True, True]
    h200 = _probe("H200")
    assert h200["fp16"] == "RuntimeError" and h200["gbps"] == "KeyError" and h200["bound"] == [True, True, True]


@needs_triton
@pytest.mark.slow  # two compile processes: about a minute
def test_a_memory_bound_matmul_is_not_padded_and_a_benchmarked_one_says_its_bound(
        capsys: pytest.CaptureFixture[str]) -> None:
    """fp16 (64, 1000) @ (1000, 1001) (n padded to 1008): memory bound on an L4 (above), so not
    padded and nothing said; compute bound on an H100, where pad_mm would time both: compiled
    unpadded, said once with its bound, a (1000, 1008) copy of the weight and an output 64*7*2
    bytes larger."""
    import torch

    from vram.run.runtime import simulated_cuda

    said = {}
    for gpu in ("L4", "H100"):
        with simulated_cuda(gpu):
            m = torch.compile(torch.nn.Linear(1000, 1001, bias=False).cuda().half())
            with torch.no_grad():
                assert m(torch.zeros(64, 1000, device="cuda", dtype=torch.half)).shape == (64, 1001)
        said[gpu] = capsys.readouterr().err
    assert "pad_mm" not in said["L4"] and "not modelled (" not in said["L4"]
    assert said["H100"].count("pad_mm") == 1
    assert "1 matmul with unaligned sizes compiled unpadded; padding it allocates 2,016,896 bytes more" \
        in said["H100"]


@needs_triton
@pytest.mark.slow  # a compile process: about 40 s
def test_the_learned_heuristic_pads_under_deterministic_on_an_a100(capsys: pytest.CaptureFixture[str]) -> None:
    """``deterministic`` turns on pad_mm's AutoHeuristic (``use_autoheuristic``) and forbids its
    benchmark. An A100 (163 KB of shared memory, 8.0) runs _PadMMA100 for m, k, n >= 512: fp16
    (8192, 8191) @ (8191, 2048) (a Linear's transposed weight, strides (1, 8191)): mat1's innermost
    dimension needs padding, intensity 1365.3 > 880.02, not fp32, n <= 2640, m not padded,
    mat2's stride 8191 > 6069: 'pad' with probability 1.0 (threshold 0.929). The wrapper pads x
    to (8192, 8192) and the weight to (8191 + 1, 2048), then the mm's output and the cuBLAS
    workspace (sm80: 8,519,680 B); the pointwise pad kernels' first-launch autotuning adds its
    L2-flush buffers."""
    import torch

    from vram.run.runtime import simulated_cuda

    torch._inductor.config.deterministic = True
    try:
        with simulated_cuda("A100-80GB"):
            m = torch.nn.Linear(8191, 2048, bias=False).cuda().half()
            x = torch.zeros(8192, 8191, device="cuda", dtype=torch.half)
            f = torch.compile(m)
            torch.cuda.memory._record_memory_history()
            with torch.no_grad():
                f(x)
            flush = torch.cuda.get_device_properties(0).L2_cache_size
            trace = torch.cuda.memory._snapshot()["device_traces"][0]
            torch.cuda.memory._record_memory_history(enabled=None)
    finally:
        torch._inductor.config.deterministic = False
    allocs = [e["size"] for e in trace if e["action"] == "alloc" and e["size"] != flush]
    assert allocs == [8192 * 8192 * 2, 8192 * 2048 * 2, 8192 * 2048 * 2, 8_519_680]
    assert "pad_mm" not in capsys.readouterr().err


@needs_triton
@pytest.mark.slow  # two compile processes: about a minute
def test_the_scripts_tf32_setting_reaches_pad_mms_cost_model(capsys: pytest.CaptureFixture[str]) -> None:
    """An L4's float32 figure is 30.3 TFLOPS, with TF32 120 (Inductor's datasheet table): machine
    balances 0.5*1000*30.3/300.048 = 50.49 and 199.97. fp32 (256, 256) @ (256, 257) (n padded to
    260; intensity 256*256*257/(3*256*257 - 256) = 85.44) is memory bound with TF32, so not padded
    and not said, and compute bound without it (left to the timing, said). (``get_device_tflops``
    is cached per dtype for the process's life, on a GPU as in the compile process: one run each.)"""
    import torch

    from vram.run.runtime import simulated_cuda

    saved, said = torch.backends.cuda.matmul.fp32_precision, {}
    try:
        for precision in ("tf32", "ieee"):
            torch.backends.cuda.matmul.fp32_precision = precision
            with simulated_cuda("L4"), torch.no_grad():
                torch.compile(torch.nn.Linear(256, 257, bias=False).cuda())(torch.zeros(256, 256, device="cuda"))
            said[precision] = capsys.readouterr().err
    finally:
        torch.backends.cuda.matmul.fp32_precision = saved
    assert "pad_mm" not in said["tf32"] and "not modelled (" not in said["tf32"]
    assert said["ieee"].count("pad_mm") == 1 and "1 matmul with unaligned sizes" in said["ieee"]
