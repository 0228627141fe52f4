"""``x[idx]``'s backward on the simulated GPU as CUDA runs it: autograd's ``index_backward``
(FunctionsManual.cpp: ``_index_put_impl_(zeros_like(self), indices, grad, true, /*unsafe=*/true)``)
reaches ``index_put_with_sort_kernel`` (native/cuda/Indexing.cu); every expected size below is
derived from that source (`vram.run.kernels.indexing`), in bytes, ``a`` an allocation, ``f`` a free."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from traced import allocator_events  # noqa: E402
from vram.run.kernels.sorting import UNMODELLED, cub_note  # noqa: E402
from vram.run.runtime import active_sim, simulated_cuda  # noqa: E402

N, ROWS, F = 5000, 1000, 64
IDX = 8 * N    # one int64 per index


def _backward_events(loss: torch.Tensor) -> list[tuple[str, int]]:
    return allocator_events(loss.backward, short=True)


def test_gather_backward_sorts_linear_indices_and_copies_an_expanded_gradient() -> None:
    """``x[idx].sum().backward()``: the initial gradient (4 B), ``zeros_like(x)`` (256,000 B);
    ``computeLinearIndex``: ``idx.remainder(1000)`` (40,000 B), times the stride 64 (40,000 B), the
    remainder dying with the expression; the gradient, ``sum``'s expanded 0-dim one, made contiguous
    as ``vals_shape`` [5000, 64] (1,280,000 B); ``sorted_indices``, ``orig_indices``, ``range``
    (40,000 B each) freed last made first, then the contiguous gradient and the linear index; the
    zeros become ``x.grad``. cub's sort storage is named."""
    with simulated_cuda(gpu="H200"):
        x = torch.randn(ROWS, F, device="cuda", requires_grad=True)
        idx = torch.randint(0, ROWS, (N,), device="cuda")
        got = _backward_events(x[idx].sum())
        sim = active_sim()
        assert sim is not None and sim.uncharged.get(cub_note("index_put_(accumulate=True)")) == 1
        assert UNMODELLED["_index_put_impl_"] not in sim.uncharged
    assert got == [("a", 4), ("a", ROWS * F * 4), ("a", IDX), ("a", IDX), ("f", IDX), ("a", N * F * 4),
                   ("a", IDX), ("a", IDX), ("a", IDX), ("f", IDX), ("f", IDX), ("f", IDX), ("f", N * F * 4),
                   ("f", IDX), ("f", 4)]


def test_a_contiguous_gradient_is_used_in_place_and_a_users_checked_put_is_named() -> None:
    """``(x[idx] * w).sum()``: the gradient reaching ``index_backward`` is ``grad * w``, contiguous
    [5000, 64]: no copy. A user's ``index_put_(..., accumulate=True)`` (not ``unsafe``: the range
    check's ``aminmax`` and asserts) stays named, not charged."""
    with simulated_cuda(gpu="H200"):
        x = torch.randn(ROWS, F, device="cuda", requires_grad=True)
        w = torch.randn(N, F, device="cuda")
        idx = torch.randint(0, ROWS, (N,), device="cuda")
        got = _backward_events((x[idx] * w).sum())
        put = got.index(("a", ROWS * F * 4))
        assert got[put + 1:put + 10] == [("a", IDX), ("a", IDX), ("f", IDX), ("a", IDX), ("a", IDX), ("a", IDX),
                                         ("f", IDX), ("f", IDX), ("f", IDX)]
        assert got[put + 10] == ("f", IDX)
        sim = active_sim()
        assert sim is not None
        torch.zeros(ROWS, F, device="cuda").index_put_((idx,), w, accumulate=True)
        assert sim.uncharged.get(UNMODELLED["_index_put_impl_"]) == 1
