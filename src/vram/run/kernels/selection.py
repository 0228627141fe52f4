"""Order statistics and sampling with replacement on CUDA: what they allocate beyond their outputs
(layer 4; needs torch).

`vram.run.kernels.plan.op_plan` asks `selection_plan` for these ops (steps as in `op_plan`:
("out", i), ("tmp", nbytes), ("free", j), ("note", text)). Read from PyTorch's CUDA host code
(paths under ``aten/src/ATen/native``):

* ``median(dim)`` / ``nanmedian(dim)`` (``cuda/Sorting.cpp`` ``median_with_indices_impl``): ``in =
  self.contiguous()`` first (a copy of a strided input; a 0-dim one is unsqueezed, a view), then
  ``values.resize_`` and ``indices.resize_``; ``launch_median_kernel`` (``cuda/Sorting.cu``: a
  radix select in shared memory) allocates nothing; the copy dies on return.
* ``kthvalue`` (``kthvalue_out_cuda``): ``kthvalue_out_impl_cuda(.., self.contiguous(), ..)``: the
  copy, then ``_reduction_with_indices_allocate_or_resize_output`` (values, indices);
  ``launch_kthvalue_kernel`` allocates nothing; the copy dies when the call returns.
* ``median()`` (``median_impl``): ``Tensor sorted = std::get<0>(self.flatten().sort())``: the
  flattened copy of a strided input, the sort's values and indices and its own buffers
  (`vram.run.kernels.sorting.sort_plan`); at the end of that statement the indices die, then the
  copy; ``at::where(sorted[-1].isnan(), sorted[-1], sorted[k])``: a 0-dim bool, then the 0-dim
  result; the bool dies, then ``sorted``.
* ``mode`` (``TensorCompare.cpp`` ``mode_out``, ``cuda/TensorModeKernel.cpp`` ``mode_kernel_impl``):
  ``resize_output`` of values and indices; a slice of one element is copied; otherwise
  ``self.transpose(dim, -1).contiguous()`` (a copy unless that is already contiguous) and, for
  slices of at most 2 * 1024 elements, at most 65535**3 slices and 32-bit indexing, the fused
  kernel (nothing allocated). Larger slices run ``launch_apply_mode_kernel``: a clone when the
  transposed input was contiguous, then per slice Thrust's sort and ``reduce_by_key`` with buffers
  sized by the number of distinct values: named (`MODE_APPLY`), not charged.
* ``multinomial`` with replacement and more than one sample (``Distributions.cpp``
  ``multinomial_out``: the result, then ``multinomial_with_replacement_stub``;
  ``cuda/MultinomialKernel.cu`` ``multinomial_with_replacement_kernel_impl``, the generic path):
  ``origDist``, ``normDist`` and ``prefixSum`` (``empty_like(self_v, LEGACY_CONTIGUOUS)``), then
  ``at::cuda::cumsum_out(prefixSum, normDist, 1)`` (contiguous operands of one dtype: ATen's own
  scan, or cub's for one distribution, whose storage is named); they die in reverse order.

``nanmedian()`` without a dim is named (`NANMEDIAN_ALL`): its index arithmetic changed across
releases (``.item()`` and ``sorted[k].clone()``, later ``at::div(at::rsub(...))`` and
``at::index``), so its temporaries are not derived here.
"""
from __future__ import annotations

from typing import Any

import torch

from .scratch import _Plan
from .sorting import _arg, _nbytes, cub_note, sort_plan

#: ``cuda/TensorModeKernel.cpp`` (CUDA, not ROCm): the fused kernel's block and grid limits
MODE_MAX_BLOCK, MODE_MAX_GRID = 1024, 65535
INT32_MAX = 2**31 - 1
MODE_APPLY = ("torch.mode over slices of more than 2,048 elements (TensorModeKernel.cu calculate_mode: "
              "per slice a sort buffer, keys and counts sized by the number of distinct values, Thrust's "
              "temporary storage)")
NANMEDIAN_ALL = ("torch.nanmedian() without a dim (cuda/Sorting.cpp median_impl: the flattened sort and "
                 "the index arithmetic after it, which differs between releases)")
SELECTION_OPS = ("median", "nanmedian", "kthvalue", "mode", "multinomial")


def can_use_32bit_index_math(t: torch.Tensor, max_elem: int = INT32_MAX) -> bool:
    """``native/CanUse32BitIndexMath`` (``canUse32BitIndexMath``): fewer elements than `max_elem`
    and the last element's offset below it."""
    n = t.numel()
    if n >= max_elem:
        return False
    if n == 0:
        return True
    linear, offset = n - 1, 0
    for i in reversed(range(t.dim())):
        offset += (linear % t.size(i)) * t.stride(i)
        linear //= t.size(i)
    return offset < max_elem


def reduction_with_indices_plan(x: torch.Tensor) -> list[tuple[str, Any]]:
    """``median(dim)`` / ``nanmedian(dim)`` / ``kthvalue``: the contiguous copy, both outputs, the
    copy's release (module doc)."""
    p = _Plan()
    if x.dim() > 0 and not x.is_contiguous():
        p.tmp("in", _nbytes(x))
    p.steps += [("out", 0), ("out", 1)]
    p.free("in")
    return p.steps


def median_all_plan(x: torch.Tensor, out: torch.Tensor) -> list[tuple[str, Any]]:
    """``median()`` (``median_impl``, module doc); an empty input returns ``full({}, nan)`` made on
    the device (the output alone)."""
    n = x.numel()
    if n == 0:
        return [("out", 0)]
    p = _Plan()
    if not x.is_contiguous():
        p.tmp("flat", _nbytes(x))
    flat = torch.empty((n,), dtype=x.dtype, device="meta")
    values, indices = torch.empty_like(flat), torch.empty((n,), dtype=torch.int64, device="meta")
    p.splice(sort_plan((flat,), {}, [values, indices]), [("sorted", _nbytes(flat)), ("indices", n * 8)], "sort")
    p.free("indices", "flat")
    p.tmp("isnan", 1)
    p.steps.append(("out", 0))
    p.free("isnan", "sorted")
    return p.steps


def mode_plan(x: torch.Tensor, dim: int) -> list[tuple[str, Any]]:
    """``mode`` (module doc). ``ensure_nonempty``: a 0-dim input counts as [1]."""
    p = _Plan()
    p.steps += [("out", 0), ("out", 1)]
    if x.numel() <= 1:  # empty, or _dimreduce_return_trivial_no_ident / a one-element slice: a copy
        return p.steps
    ndim = max(x.dim(), 1)
    dim %= ndim
    slice_size = x.size(dim) if x.dim() else 1
    if slice_size == 1:
        return p.steps
    transposed = x.transpose(dim, ndim - 1)
    copied = not transposed.is_contiguous()
    if copied:
        p.tmp("contiguous", _nbytes(x))
    slices = x.numel() // slice_size
    if not (slice_size <= 2 * MODE_MAX_BLOCK and slices <= MODE_MAX_GRID ** 3 and can_use_32bit_index_math(x)):
        if not copied:
            p.tmp("clone", _nbytes(x))
        p.steps.append(("note", MODE_APPLY))
        p.free("clone")
    p.free("contiguous")
    return p.steps


def multinomial_replacement_plan(x: torch.Tensor) -> list[tuple[str, Any]]:
    """The with-replacement stub's generic path (module doc): three contiguous copies of the
    distribution's size; cub's scan for a single distribution is named."""
    p = _Plan()
    p.steps.append(("out", 0))
    for key in ("origDist", "normDist", "prefixSum"):
        p.tmp(key, _nbytes(x))
    rows = 1 if x.dim() == 1 else x.size(0)
    if rows == 1:
        p.steps.append(("note", cub_note("cumsum")))
    p.free("prefixSum", "normDist", "origDist")
    return p.steps


def selection_plan(name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                   outs: list[Any]) -> list[tuple[str, Any]] | None:
    """The allocation order of an op this module knows (see the module doc), None for others."""
    x = args[0] if args else kwargs.get("self")
    if name not in SELECTION_OPS or not isinstance(x, torch.Tensor) or not all(
            isinstance(o, torch.Tensor) for o in outs):
        return None
    if name == "multinomial":
        n = int(_arg(args, kwargs, 1, "num_samples", 1))
        replacement = bool(_arg(args, kwargs, 2, "replacement", False))
        if not replacement or n == 1 or len(outs) != 1:
            return None  # the fast path: `vram.run.kernels.sorting.multinomial_plan`
        if outs[0].numel() == 0:
            return [("out", 0)]
        return multinomial_replacement_plan(x)
    if name == "mode" and len(outs) == 2:
        return mode_plan(x, int(_arg(args, kwargs, 1, "dim", -1)))
    if name in ("median", "nanmedian") and len(outs) == 1:
        return median_all_plan(x, outs[0]) if name == "median" else [("out", 0), ("note", NANMEDIAN_ALL)]
    if len(outs) == 2:
        return reduction_with_indices_plan(x)
    return None
