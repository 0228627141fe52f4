"""`vram.run.kernels.selection`: what median, kthvalue, mode and multinomial with replacement
allocate on CUDA beyond their outputs.

Every expected sequence is worked by hand from PyTorch's CUDA host code (``aten/src/ATen/native``):

* ``cuda/Sorting.cpp`` ``median_with_indices_impl``: ``Tensor in = self.contiguous()`` before
  ``values.resize_`` / ``indices.resize_``; ``launch_median_kernel`` allocates nothing; ``in`` dies
  on return. ``kthvalue_out_cuda`` passes ``self.contiguous()`` to ``kthvalue_out_impl_cuda``,
  which allocates values then indices (``_reduction_with_indices_allocate_or_resize_output``).
* ``median_impl``: ``std::get<0>(self.flatten().sort())`` (flatten copies a strided input;
  ``sort`` of N > 4,096 elements in one segment: values, int64 indices, ``DeviceArray indices(N)``
  int64 around cub's radix sort, SortStable.cu); the tuple's indices die at the end of the
  statement, then the flattened copy; ``at::where(sorted[-1].isnan(), ...)``: a 0-dim bool, the
  0-dim result; the bool dies, then ``sorted``.
* ``cuda/TensorModeKernel.cpp`` ``mode_kernel_impl``: values, indices (``resize_output``), then
  ``self.transpose(dim, -1).contiguous()``; slices of at most 2,048 take the fused kernel (nothing
  else); larger ones clone a contiguous transposed input and run Thrust per slice (named).
* ``cuda/MultinomialKernel.cu`` ``multinomial_with_replacement_kernel_impl`` (more than one
  sample): ``origDist``, ``normDist``, ``prefixSum`` (``empty_like``, contiguous), ``cumsum_out``
  (cub's scan only when there is one distribution: ``ScanUtils.cuh`` ``scan_dim`` with numel ==
  size(dim)); they die in reverse order.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from vram.run.kernels.plan import op_plan  # noqa: E402
from vram.run.kernels.selection import MODE_APPLY, NANMEDIAN_ALL  # noqa: E402
from vram.run.kernels.sorting import cub_note  # noqa: E402
from vram.run.runtime import active_sim, simulated_cuda  # noqa: E402

H200 = 132
VOCAB = 50257


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, device="meta", dtype=dtype)


def _pair(*shape: int) -> list[torch.Tensor]:
    return [_meta(*shape), _meta(*shape, dtype=torch.long)]


def test_median_and_kthvalue_along_a_dim_copy_a_strided_input_first() -> None:
    # [64, 100] fp32 seen through .t() of [100, 64]: self.contiguous() = 6,400 * 4 = 25,600 B,
    # then values [64] and indices [64] (the outputs), the copy freed on return
    xt = _meta(100, 64).t()
    assert op_plan("median", (xt, 1), _pair(64), H200) == [("tmp", 25600), ("out", 0), ("out", 1), ("free", 0)]
    assert op_plan("kthvalue", (xt, 3, 1), _pair(64), H200) == [("tmp", 25600), ("out", 0), ("out", 1), ("free", 0)]
    # contiguous: the outputs alone (the radix selects run in shared memory)
    assert op_plan("nanmedian", (_meta(64, 100), 1), _pair(64), H200) == [("out", 0), ("out", 1)]


def test_median_of_all_elements_sorts_a_flattened_copy() -> None:
    # [64, 100] fp32 contiguous: flatten is a view; sort of 6,400 > 4,096 in one segment: values
    # 25,600 (0), indices 51,200 (1), DeviceArray 51,200 (2) around cub; the DeviceArray dies,
    # then the tuple's indices; isnan 1 B (3), the 0-dim result, then isnan and sorted die
    plan = op_plan("median", (_meta(64, 100),), [_meta()], H200)
    assert plan == [("tmp", 25600), ("tmp", 51200), ("tmp", 51200), ("note", cub_note("sort")), ("free", 2),
                    ("free", 1), ("tmp", 1), ("out", 0), ("free", 3), ("free", 0)]
    # strided: the flattened copy 25,600 (0) comes first and dies after the indices (2)
    plan = op_plan("median", (_meta(100, 64).t(),), [_meta()], H200)
    assert plan == [("tmp", 25600), ("tmp", 25600), ("tmp", 51200), ("tmp", 51200), ("note", cub_note("sort")),
                    ("free", 3), ("free", 2), ("free", 0), ("tmp", 1), ("out", 0), ("free", 4), ("free", 1)]
    # nanmedian() is named, not charged beyond its output
    assert op_plan("nanmedian", (_meta(64, 100),), [_meta()], H200) == [("out", 0), ("note", NANMEDIAN_ALL)]


def test_mode_copies_the_transposed_input_and_names_thrusts_path() -> None:
    x = _meta(64, 100)
    # dim 1 is innermost: transpose(1, 1) is contiguous, 100 <= 2,048: the fused kernel
    assert op_plan("mode", (x, 1), _pair(64), H200) == [("out", 0), ("out", 1)]
    # dim 0: transpose(0, 1) is strided: a 25,600 B copy after the outputs, freed on return
    assert op_plan("mode", (x, 0), _pair(100), H200) == [("out", 0), ("out", 1), ("tmp", 25600), ("free", 0)]
    # [4, 3000] dim 1: 3,000 > 2,048: the contiguous input is cloned (48,000 B), Thrust named
    assert op_plan("mode", (_meta(4, 3000), 1), _pair(4), H200) == [
        ("out", 0), ("out", 1), ("tmp", 48000), ("note", MODE_APPLY), ("free", 0)]


def test_multinomial_with_replacement_builds_three_distribution_buffers() -> None:
    # [2, 50257] fp32, 4 samples: the result [2, 4] int64, then origDist, normDist, prefixSum of
    # 402,056 B each; two rows: ATen's own scan; freed prefixSum, normDist, origDist
    p = _meta(2, VOCAB)
    plan = op_plan("multinomial", (p, 4, True), [_meta(2, 4, dtype=torch.long)], H200)
    assert plan == [("out", 0), ("tmp", 402056), ("tmp", 402056), ("tmp", 402056), ("free", 2), ("free", 1),
                    ("free", 0)]
    # one distribution (1-D): cub's inclusive scan, named
    row = _meta(VOCAB)
    plan = op_plan("multinomial", (row, 4, True), [_meta(4, dtype=torch.long)], H200)
    assert ("note", cub_note("cumsum")) in plan


def test_multinomial_with_replacement_peak_on_the_simulated_h200() -> None:
    """One row of 50,257 probabilities, 16 samples with replacement: the result (128 B -> a 512 B
    block) and three 201,028 B buffers (201,216 B blocks) live at once."""
    with simulated_cuda(gpu="H200"):
        probs = torch.ones(1, VOCAB, device="cuda")
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = torch.multinomial(probs, 16, replacement=True)
        assert out.shape == (1, 16)
        assert torch.cuda.max_memory_allocated() - before == 512 + 3 * 201216
        assert torch.cuda.memory_allocated() - before == 512
        assert active_sim().uncharged.get(cub_note("cumsum")) == 1
