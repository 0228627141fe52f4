"""Reduced pointwise losses allocate the unreduced loss as a temporary (``native/Loss.cpp``):
``mse_loss``/``smooth_l1_loss`` are structured, so their 0-dim output comes first, then the
``TensorIterator`` loss (broadcast shape, promoted dtype), freed on return; ``huber_loss`` makes
``at::empty_like(input)`` first and returns its ``mean()``. Expected sequences are read off that
source; a 32,768-element mean on an 80 GiB preset is a single-block reduction (no staging)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from vram.run.runtime import simulated_cuda  # noqa: E402


def _requests(fn) -> list[tuple[str, int]]:  # type: ignore[no-untyped-def]
    with simulated_cuda():
        a = torch.randn(128, 256, device="cuda")
        b = torch.randn(128, 256, device="cuda")
        c = torch.randn(128, 1, device="cuda", dtype=torch.float16)
        torch.cuda.memory._record_memory_history()
        out = fn(a, b, c)
        events = torch.cuda.memory._snapshot()["device_traces"][0]
        del out
    return [(e["action"], e["size"]) for e in events if e["action"] in ("alloc", "free_requested")]


@pytest.mark.parametrize("fn", [lambda a, b, c: F.mse_loss(a, b), lambda a, b, c: F.smooth_l1_loss(a, b)],
                         ids=["mse", "smooth_l1"])
def test_structured_losses_allocate_output_then_loss(fn) -> None:  # type: ignore[no-untyped-def]
    assert _requests(fn) == [("alloc", 4), ("alloc", 131072), ("free_requested", 131072)]


def test_smooth_l1_with_beta_0_is_l1_loss() -> None:
    # torch/nn/functional.py sends beta == 0 to l1_loss, a composite
    # (``apply_loss_reduction((input - target).abs(), reduction)``): sub, abs, mean, then the two
    # temporaries die at the end of the full expression, the later one first
    assert _requests(lambda a, b, c: F.smooth_l1_loss(a, b, beta=0.0)) == [
        ("alloc", 131072), ("alloc", 131072), ("alloc", 4), ("free_requested", 131072),
        ("free_requested", 131072)]


def test_huber_loss_allocates_loss_then_output() -> None:
    assert _requests(lambda a, b, c: F.huber_loss(a, b)) == [
        ("alloc", 131072), ("alloc", 4), ("free_requested", 131072)]


def test_sum_reduction_and_broadcast_target() -> None:
    # the target (128, 1) float16 broadcasts to (128, 256); float32 wins the promotion
    assert _requests(lambda a, b, c: F.mse_loss(a, c.float().expand(128, 256), reduction="sum")) == [
        ("alloc", 512), ("alloc", 4), ("alloc", 131072), ("free_requested", 131072), ("free_requested", 512)]


def test_unreduced_loss_is_the_output() -> None:
    assert _requests(lambda a, b, c: F.mse_loss(a, b, reduction="none")) == [("alloc", 131072)]
