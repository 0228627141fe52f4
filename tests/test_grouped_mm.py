"""``torch._grouped_mm`` (mixture-of-experts layers) on the simulated GPU, both engines.

transformers 5's default experts (``integrations/moe.py`` ``grouped_mm_experts_forward``) call it in
the model's dtype on CUDA sm80+, float32 included. torch 2.13's meta kernel accepts bfloat16 only, so
Mixtral/Qwen-MoE training in float32 stopped with "Expected inputs of BF16 type". The CUDA kernel
(``native/cuda/GroupedBlas.cpp`` ``_grouped_mm_cuda``, ``native/GroupedMMUtils.h``) accepts
float32/float16/bfloat16 and pads its output's row stride to 16 bytes; the CPU kernel shares that
output helper, so the expected layouts and sizes below are the CPU's, computed here without vram.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from vram.run.kernels.grouped_mm import CUTLASS  # noqa: E402
from vram.run.runtime import active_sim, simulated_cuda  # noqa: E402

BACKENDS = ["privateuse1", "meta"]


def r512(n: int) -> int:
    return -(-n // 512) * 512


def _inputs(device: str, n: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    a = torch.randn(1000, 64, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(4, n, 64, device=device, dtype=dtype, requires_grad=True)  # (experts, out, in): transposed
    offs = torch.tensor([300, 300, 800, 1000], dtype=torch.int32, device=device)
    return a, w, offs


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_grouped_mm_gives_the_cuda_kernels_padded_output(backend: str) -> None:
    a, w, offs = _inputs("cpu", 6)
    cpu = torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
    assert cpu.stride() == (8, 1)  # a row of 6 floats padded to 16 bytes
    with simulated_cuda(gpu="A100-80GB", backend=backend):
        a, w, offs = _inputs("cuda", 6)
        torch.mm(a, a.t())  # the thread's cuBLAS workspace, once
        before = torch.cuda.memory_allocated()
        out = torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
        assert (out.shape, out.stride(), out.dtype, out.device.type) == (cpu.shape, cpu.stride(), cpu.dtype, "cuda")
        assert torch.cuda.memory_allocated() - before == r512(cpu.untyped_storage().nbytes())


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_mm_backward_gives_the_cpus_gradients(backend: str) -> None:
    a, w, offs = _inputs("cpu", 32)
    (torch._grouped_mm(a, w.transpose(-2, -1), offs=offs) ** 2).sum().backward()
    expected = [(t.grad.shape, t.grad.stride()) for t in (a, w)]
    with simulated_cuda(gpu="A100-80GB", backend=backend):
        a, w, offs = _inputs("cuda", 32)
        (torch._grouped_mm(a, w.transpose(-2, -1), offs=offs) ** 2).sum().backward()
        assert [(t.grad.shape, t.grad.stride()) for t in (a, w)] == expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_on_sm90_names_cutlass_scratch_and_sm80_runs_the_cublas_fallback(backend: str) -> None:
    """bfloat16 on sm90 runs CUTLASS's grouped GEMM (scratch sized by CUTLASS: named, not charged);
    on sm80 the per-group cuBLAS fallback, whose first call takes the thread's workspace."""
    with simulated_cuda(gpu="H100", backend=backend):
        a, w, offs = _inputs("cuda", 32, torch.bfloat16)
        torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
        sim = active_sim()
        assert sim is not None and sim.uncharged.get(CUTLASS) == 1
    with simulated_cuda(gpu="A100-80GB", backend=backend):
        a, w, offs = _inputs("cuda", 32, torch.bfloat16)
        before = torch.cuda.memory_allocated()
        out = torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
        sim = active_sim()
        assert sim is not None and CUTLASS not in sim.uncharged
        assert torch.cuda.memory_allocated() - before == r512(out.numel() * 2) + 8_519_680  # sm80 workspace


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_grouped_mm_input_is_refused_with_the_cuda_message_and_nothing_allocated(backend: str) -> None:
    with simulated_cuda(gpu="A100-80GB", backend=backend):
        a, w, offs = _inputs("cuda", 32)
        before = torch.cuda.memory_allocated()
        with pytest.raises(RuntimeError, match="Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Long"):
            torch._grouped_mm(a.detach().long(), w.detach().transpose(-2, -1), offs=offs)
        with pytest.raises(RuntimeError, match="Offsets have to be int32"):
            torch._grouped_mm(a, w.transpose(-2, -1), offs=offs.long())
        assert torch.cuda.memory_allocated() == before
