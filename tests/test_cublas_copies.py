"""Operand copies inside CUDA's matmuls (``native/cuda/Blas.cpp``): ``prepare_batch_matrix_for_cublas``
(bmm, baddbmm) and ``cublasCommonArgs``'s ``prepare_matrix_for_cublas`` (mm, addmm,
``native/cuda/cuBlasCommonArgs.h``) clone an operand cuBLAS cannot read in place — the expanded
gradient of ``sum()`` (strides 0) is the common case — after the output and before the cuBLAS call,
and free it when the kernel returns. Expectations come from that source and from the A100
recording ``cs336-s-mem.pickle`` (its two 2 MiB ``clone`` requests inside ``BmmBackward0``)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from paths import RECORDINGS as TRACES  # noqa: E402
from vram.replay.loader import load_snapshot  # noqa: E402
from vram.run.kernels.blas import bmm_plan, mm_plan, non_overlapping_and_dense  # noqa: E402
from vram.run.runtime import simulated_cuda  # noqa: E402


def _meta(*shape: int) -> torch.Tensor:
    return torch.empty(shape, device="meta")


def test_an_expanded_operand_is_cloned_after_the_output_and_freed_after_cublas() -> None:
    grad = torch.ones((), device="meta").expand(8, 64, 16)  # strides (0, 0, 0): no leading dim
    b = _meta(8, 16, 32)
    out = _meta(8, 64, 32)
    assert bmm_plan("bmm", (grad, b), [out]) == [("out", 0), ("tmp", 8 * 64 * 16 * 4), ("blas", None),
                                                  ("free", 0)]


def test_contiguous_and_transposed_operands_are_read_in_place() -> None:
    a, b = _meta(8, 64, 16), _meta(8, 32, 16).transpose(1, 2)  # row-major and column-major
    assert bmm_plan("bmm", (a, b), [_meta(8, 64, 32)]) == [("out", 0), ("blas", None)]
    assert bmm_plan("baddbmm", (_meta(8, 64, 32), a, b), [_meta(8, 64, 32)]) == [("out", 0), ("blas", None)]


def test_both_operands_copied_free_in_reverse_order() -> None:
    g1 = torch.ones((), device="meta").expand(4, 8, 8)
    g2 = torch.ones((), device="meta").expand(4, 8, 8)
    plan = bmm_plan("bmm", (g1, g2), [_meta(4, 8, 8)])
    assert plan == [("out", 0), ("tmp", 1024), ("tmp", 1024), ("blas", None), ("free", 1), ("free", 0)]


def test_other_ops_have_no_bmm_plan() -> None:
    assert bmm_plan("mm", (_meta(4, 4), _meta(4, 4)), [_meta(4, 4)]) is None
    assert mm_plan("bmm", (_meta(2, 4, 4), _meta(2, 4, 4)), [_meta(2, 4, 4)]) is None


def test_a_linear_backward_after_sum_clones_the_expanded_gradient() -> None:
    """``grad.mm(weight)`` with grad = ones.expand(32, 64): strides (0, 0), neither row- nor
    column-major, so ``prepare_matrix_for_cublas`` clones it (32 x 64 fp32 = 8 KiB)."""
    grad = torch.ones((), device="meta").expand(32, 64)
    assert mm_plan("mm", (grad, _meta(64, 16)), [_meta(32, 16)]) == [("out", 0), ("tmp", 8192), ("blas", None),
                                                                     ("free", 0)]


def test_dense_and_transposed_matrices_are_read_in_place() -> None:
    w = _meta(16, 64)
    assert mm_plan("mm", (_meta(32, 64), w.t()), [_meta(32, 16)]) == [("out", 0), ("blas", None)]
    assert mm_plan("addmm", (_meta(16), _meta(32, 64), w.t()), [_meta(32, 16)]) == [("out", 0), ("blas", None)]
    sliced = _meta(32, 128)[:, :64]  # unit stride, leading stride 128 >= 64: cuBLAS's lda
    assert mm_plan("mm", (sliced, _meta(64, 16)), [_meta(32, 16)]) == [("out", 0), ("blas", None)]


def test_cublas_common_args_frees_result_then_matb_then_mata() -> None:
    """Both operands expanded: copied as mata (mat2, the result being row-major) then matb (mat1);
    the struct's members are destroyed result, matb, mata."""
    g1 = torch.ones((), device="meta").expand(8, 4)
    g2 = torch.ones((), device="meta").expand(4, 6)
    assert mm_plan("mm", (g1, g2), [_meta(8, 6)]) == [("out", 0), ("tmp", 96), ("tmp", 128), ("blas", None),
                                                    ("free", 1), ("free", 0)]


@pytest.mark.parametrize(("shape", "stride"), [((4, 3), (3, 1)), ((4, 3), (1, 4)), ((4, 3), (0, 0)), ((4, 3), (6, 2)),
                                               ((1, 3), (7, 1)), ((4, 1), (1, 9)), ((2, 3, 4), (12, 1, 3)),
                                               ((2, 3, 4), (1, 2, 6)), ((5,), (2,)), ((1,), (5,)), ((3, 3), (1, 1))])
def test_non_overlapping_and_dense_is_torchs(shape: tuple[int, ...], stride: tuple[int, ...]) -> None:
    from torch._prims_common import is_non_overlapping_and_dense_or_false

    t = torch.empty(64, device="meta").as_strided(shape, stride)
    assert non_overlapping_and_dense(t) == is_non_overlapping_and_dense_or_false(t)


def test_bmm_backward_of_a_sum_allocates_what_the_a100_did() -> None:
    """``(w @ v).sum().backward()`` for w 8x4096x4096, v 8x4096x16: the recording's requests 16-21
    (ones_like, v's gradient, its operand clone, the backward thread's cuBLAS workspace, w's
    gradient, its operand clone)."""
    events = [e for e in load_snapshot(TRACES / "cs336-s-mem.pickle")["device_traces"][0] if e["action"] == "alloc"]
    recorded = [e["size"] for e in events[16:22]]
    with simulated_cuda(gpu="A100-80GB"):
        w = torch.randn(8, 4096, 4096, device="cuda", requires_grad=True)
        v = torch.randn(8, 4096, 16, device="cuda", requires_grad=True)
        out = torch.bmm(w, v)  # the forward's cuBLAS workspace is the main thread's
        loss = out.sum()
        torch.cuda.memory._record_memory_history()
        loss.backward()
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        torch.cuda.memory._record_memory_history(enabled=None)
    mine = [e["size"] for e in trace if e["action"] == "alloc"]
    assert mine[:6] == recorded == [4, 2 << 20, 2 << 20, 8_519_680, 512 << 20, 2 << 20]
