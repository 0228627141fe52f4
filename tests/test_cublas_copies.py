"""Operand copies inside CUDA's batched matmul (``baddbmm_out_cuda_impl``, ``native/cuda/Blas.cpp``):
``prepare_batch_matrix_for_cublas`` clones an operand cuBLAS cannot read in place — the expanded
gradient of ``sum()`` (strides 0) is the common case — after the output and before the cuBLAS call,
and frees it when the kernel returns. Expectations come from that source and from the A100
recording ``cs336-s-mem.pickle`` (its two 2 MiB ``clone`` requests inside ``BmmBackward0``)."""
from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from vram.replay.loader import load_snapshot  # noqa: E402
from vram.run.kernels import bmm_plan  # noqa: E402
from vram.run.runtime import simulated_cuda  # noqa: E402

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


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


@pytest.mark.skipif(not (TRACES / "cs336-s-mem.pickle").is_file(), reason="needs ../shared/traces")
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
