"""Attention as a real H200 runs it: the math path, cuDNN attention and softmax backward.

Expected peaks are a real GPU's: ``shared/gpu-truth/h200-2026-11-27`` (one H200, torch 2.11.0+cu130),
program ``sdpa_backends.py`` (forward + backward, B=4, H=16, Hkv=4, L=1024, D=64, causal, each
variant after ``empty_cache`` and ``reset_peak_memory_stats``). The bfloat16 figures are the ones
its ``logs.txt`` prints; the float32 ones (cut from the log) are the peaks of each variant's
window in its recording, every request rounded to 512 B as the allocator counts it. Smaller
cases derive their bytes by hand from PyTorch's and the cuDNN frontend's sources.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from vram.run.runtime import simulated_cuda  # noqa: E402

MATH, CUDNN = SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION
#: (dtype, gqa, backend, the H200's peak allocated)
H200_PEAKS = [
    (torch.float32, False, MATH, 1_258_292_224),
    (torch.float32, True, MATH, 1_233_126_400),
    (torch.bfloat16, False, MATH, 1_224_737_792),
    (torch.bfloat16, False, CUDNN, 151_521_792),
    (torch.bfloat16, True, MATH, 1_212_154_880),
    (torch.bfloat16, True, CUDNN, 143_133_184),
]


def _variant(dtype: torch.dtype, gqa: bool, backend: SDPBackend) -> int:
    """One variant of sdpa_backends.py, as it runs there."""
    B, H, Hkv, L, D = 4, 16, 4, 1024, 64
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    q = torch.randn(B, H, L, D, device="cuda", dtype=dtype, requires_grad=True)
    kv = Hkv if gqa else H
    k = torch.randn(B, kv, L, D, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(B, kv, L, D, device="cuda", dtype=dtype, requires_grad=True)
    with sdpa_kernel([backend]):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        o.sum().backward()
    del q, k, v, o
    return torch.cuda.max_memory_allocated()


def test_sdpa_backends_peaks_are_the_h200s() -> None:
    # run in the program's order: the first math variant leaves the two cuBLAS workspaces
    # (forward and autograd threads, 32 MiB each on sm90) that every later peak includes
    with simulated_cuda(gpu="H200"):
        got = [(dtype, gqa, backend, _variant(dtype, gqa, backend)) for dtype, gqa, backend, _ in H200_PEAKS]
    assert got == H200_PEAKS


def test_softmax_backward_takes_the_product_of_grad_and_output() -> None:
    # softmax_backward_cuda_out (SoftMax.cu): grad_input, then tmp = grad * output, freed on return;
    # float32 [64, 1024] = 262,144 B each. The incoming gradient of sum() is an expanded scalar:
    # the product takes the output's layout (contiguous), so host_softmax_backward copies nothing
    with simulated_cuda():
        x = torch.randn(64, 1024, device="cuda", requires_grad=True)
        y = torch.softmax(x, -1)
        loss = y.sum()
        a0 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss.backward()
        # ones_like(loss) 512 (dies after the expand is used), x.grad, the product
        assert torch.cuda.max_memory_allocated() - a0 == 512 + 2 * 262144
        assert x.grad is not None and x.grad.shape == x.shape


def test_cudnn_grouped_query_backward_workspace() -> None:
    # bf16 q [2,8,128,64], k/v [2,2,128,64], forced cuDNN. Forward: seed, offset (512 each), o 262,144,
    # softmaxstats fp32 [2,8,128,1] 8,192, the engine's workspace 256 (-> 512; sm90 measurement).
    # Backward: grad of o.sum() 512; dq 262,144, dk and dv 65,536 each; grad_out is the expanded
    # scalar (innermost stride 0): permute_to_matching_layout copies it, 262,144; workspace =
    # dQ_accum 2*8*128*64*4 = 524,288 + softmax_sum 2*8*128*4 = 8,192 + dK/dV full-head
    # 2*8*128*(64+64)*2 = 524,288 + 256 = 1,057,024 (-> 1,057,280)
    with simulated_cuda(), sdpa_kernel([CUDNN]):
        q = torch.randn(2, 8, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(2, 2, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        a0 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        o = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        assert torch.cuda.max_memory_allocated() - a0 == 512 + 512 + 262144 + 8192 + 512
        assert torch.cuda.memory_allocated() - a0 == 512 + 512 + 262144 + 8192
        loss = o.sum()
        a1 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss.backward()
        assert torch.cuda.max_memory_allocated() - a1 == 512 + 262144 + 2 * 65536 + 262144 + 1057280
        assert k.grad is not None and k.grad.shape == k.shape


def test_cudnn_engine_workspace_is_charged_on_sm90_only() -> None:
    # the engine's 256 B was measured on sm90 only: on an A100 (sm80) only the frontend's part is
    # charged (none forward) and the run's notes name the rest
    with simulated_cuda(gpu="A100-80GB"), sdpa_kernel([CUDNN]):
        q, k, v = (torch.randn(2, 8, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        a0 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        F.scaled_dot_product_attention(q, k, v)
        assert torch.cuda.max_memory_allocated() - a0 == 512 + 512 + 262144   # no logsumexp, no workspace
