"""``index_put_(..., accumulate=True)`` on CUDA: the backward of every ``x[idx]`` (layer 4; needs torch).

Read from ``aten/src/ATen/native/TensorAdvancedIndexing.cpp`` ``_index_put_impl_`` (on CUDA an
accumulating put goes to ``index_put_with_sort_stub``) and ``native/cuda/Indexing.cu``
``index_put_with_sort_kernel``, for a contiguous ``self`` and int64 index tensors on adjacent
dims, as autograd's ``index_backward`` calls it (``_index_put_impl_(zeros_like(self), indices, grad,
true, /*unsafe=*/true)``, FunctionsManual.cpp):

* ``makeLinearIndex`` → ``computeLinearIndex``: per index tensor, ``wrapIndexOnce`` (with
  ``unsafe`` no range check: ``index.remainder(dim_size)``, N int64) times its linear stride (N
  int64), the remainder dying at the end of the expression; the first product is ``linearIndex``,
  later ones are added into it and die with the loop's local;
* ``expandedValue = value.expand(vals_shape).contiguous()``: a copy when the expanded value is not
  contiguous (a gradient expanded from a sum);
* ``sorted_indices``, ``orig_indices`` (``empty_like(linearIndex)``) and ``range``
  (``arange(num_indices)``), cub's ``radix_sort_pairs`` (its temporary storage named); they die at
  the end of their block (range first), then ``expandedValue`` and ``linearIndex`` when the
  function returns.

Other cases (a non-contiguous ``self``, int32 or boolean indices, indices on non-adjacent dims,
the range check of a user's ``index_put_``) are named, not charged (`vram.run.kernels.sorting`).
"""
from __future__ import annotations

import math
from typing import Any

import torch

_INT64 = 8


def index_put_plan(args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[Any],
                   cub_note: str) -> list[tuple[str, Any]] | None:
    """The steps of ``index_put_with_sort_kernel`` (module doc), None outside the modelled case."""
    self = args[0] if args else kwargs.get("self")
    indices = args[1] if len(args) > 1 else kwargs.get("indices")
    value = args[2] if len(args) > 2 else kwargs.get("values")
    unsafe = args[4] if len(args) > 4 else kwargs.get("unsafe", False)
    if not (isinstance(self, torch.Tensor) and isinstance(value, torch.Tensor) and unsafe is True
            and self.is_contiguous() and isinstance(indices, (list, tuple)) and len(indices) <= self.dim()):
        return None
    defined = [i for i, t in enumerate(indices) if t is not None]
    if (not defined or defined != list(range(defined[0], defined[-1] + 1))
            or any(indices[i].dtype != torch.int64 for i in defined)):
        return None
    shape = torch.broadcast_shapes(*(indices[i].shape for i in defined))
    n = math.prod(shape)
    first, last = defined[0], defined[-1] + 1
    slice_size = math.prod(self.shape[last:])
    vals_shape = [*self.shape[:first], *shape, *self.shape[last:]]
    steps: list[tuple[str, Any]] = [("out", 0)]
    held = 0
    for k, _ in enumerate(defined):
        steps += [("tmp", _INT64 * n), ("tmp", _INT64 * n), ("free", held)]  # remainder, * stride
        if k:
            steps.append(("free", held + 1))  # added into linearIndex, then the loop's local dies
        held += 2
    linear = 1  # the first product
    try:
        copied = not value.expand(vals_shape).is_contiguous()
    except RuntimeError:
        return None
    if copied:
        steps.append(("tmp", math.prod(vals_shape) * value.element_size()))
        copy = held
        held += 1
    if n > 0 and slice_size > 0:
        steps += [("tmp", _INT64 * n), ("tmp", _INT64 * n), ("tmp", _INT64 * n), ("note", cub_note),
                  ("free", held + 2), ("free", held + 1), ("free", held)]
    if copied:
        steps.append(("free", copy))
    steps.append(("free", linear))
    return steps
