"""Tensor kinds beyond dense real ones on the simulated GPU: complex tensors, their real views and
autograd, FFTs. Each runs and charges what CUDA allocates, or stops with one line.

Byte counts follow the CUDA storages: a complex64 element is 8 bytes, and a view that changes the
element type (``view_as_real``, ``view(dtype)``) shares its base's storage, allocating nothing.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from vram.run.runtime import simulated_cuda  # noqa: E402


def test_view_as_real_shares_the_complex_storage() -> None:
    with simulated_cuda():
        s = torch.randn(64, 64, dtype=torch.complex64, device="cuda")
        a0 = torch.cuda.memory_allocated()
        assert a0 == 64 * 64 * 8
        r = torch.view_as_real(s)
        back = torch.view_as_complex(r)
        as_int = s.view(torch.int32)
        assert r.shape == (64, 64, 2) and r.dtype == torch.float32 and r.stride() == (128, 2, 1)
        assert as_int.shape == (64, 128)
        assert r.data_ptr() == s.data_ptr() == back.data_ptr() == as_int.data_ptr()
        assert torch.cuda.memory_allocated() == a0


def test_complex_autograd_runs_and_keeps_the_gradient() -> None:
    # the backward of s*s multiplies by s.conj(): a conjugate-bit view, which PyTorch's math-bit
    # fallback resolves with a clone whose copy reaches the backend's _copy_from
    with simulated_cuda():
        s = torch.randn(64, 64, dtype=torch.complex64, device="cuda", requires_grad=True)
        (s * s).abs().sum().backward()
        assert s.grad is not None and s.grad.dtype == torch.complex64 and s.grad.shape == s.shape
        assert torch.cuda.memory_allocated() == 2 * 64 * 64 * 8       # s and its gradient
        c = s.detach().conj()
        d = torch.empty_like(s.detach())
        d.copy_(c)                                                    # a conjugate copy between GPU tensors
        assert not d.is_conj() and torch.cuda.memory_allocated() == 3 * 64 * 64 * 8


def test_rfft_backward_runs() -> None:
    with simulated_cuda():
        x = torch.randn(8, 1024, device="cuda", requires_grad=True)
        y = torch.fft.rfft(x)
        assert y.dtype == torch.complex64 and y.shape == (8, 513)
        assert y.untyped_storage().nbytes() == 8 * 513 * 8
        y.abs().sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape


def test_vmap_over_simulated_tensors() -> None:
    # vmap's BatchedTensor wraps a simulated tensor without a storage of its own (FlexAttention's
    # create_block_mask vmaps its mask function this way)
    with simulated_cuda():
        x = torch.arange(16, device="cuda").view(4, 4)
        y = torch.vmap(lambda r: r >= 2)(x)
        assert y.shape == (4, 4) and y.dtype == torch.bool
        assert torch.cuda.memory_allocated() == 512 + 512   # x (128 B) and y (16 B), each rounded to 512
