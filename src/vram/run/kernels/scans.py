"""``cummax`` / ``cummin`` on CUDA (layer 4; needs torch): ``native/cuda/ScanKernels.cpp``
``cummax_helper_cuda`` and ``native/cuda/ScanUtils.cuh`` ``scan_dim_with_indices``.

``torch.cummax(x, dim)`` (``native/ReduceOps.cpp``) allocates ``values`` and ``indices`` itself
(``at::empty(self.sizes())``, contiguous) and calls ``_cummax_helper(self, values, indices, dim)``,
which has no meta kernel. On CUDA the helper takes a contiguous stand-in for an output that is not
contiguous (``contiguous_out_arg``: ``at::empty(sizes)``, values then indices) and
``scan_dim_with_indices`` a contiguous copy of ``self`` when it is not (``expect_contiguous``),
freed when the scan returns; the stand-ins are copied back and die when the helper returns
(indices, then values).
"""
from __future__ import annotations

from typing import Any

import torch

from .scratch import _Plan

HELPERS = frozenset({"_cummax_helper", "_cummin_helper"})


def _dense(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def cummaxmin_plan(name: str, args: tuple[Any, ...]) -> list[tuple[str, Any]] | None:
    """The helper's stand-ins and copy (module doc); None for other ops."""
    if name not in HELPERS or len(args) < 3 or not all(isinstance(t, torch.Tensor) for t in args[:3]):
        return None
    x, values, indices = args[:3]
    p = _Plan()
    for key, t in (("values_", values), ("indices_", indices)):
        if not t.is_contiguous():
            p.tmp(key, _dense(t))
    if not x.is_contiguous():
        p.tmp("self_", _dense(x))
    p.free("self_", "indices_", "values_")
    return p.steps


def _no_outputs(*args: Any, **kwargs: Any) -> None:
    """The helpers' meta kernel: they write ``values`` and ``indices`` and return nothing."""
    return None


CUDA_META = {torch.ops.aten._cummax_helper.default: _no_outputs,
             torch.ops.aten._cummin_helper.default: _no_outputs}
