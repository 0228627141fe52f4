"""Backward formulas whose C++ code branches on ``is_cuda()``, given CUDA's branch on PrivateUse1.

A few formulas in ``torch/csrc/autograd/FunctionsManual.cpp`` test the device rather than
subclass-likeness. On a PrivateUse1 tensor they take the CPU branch, which allocates other tensors
and reads a value (``.item()``) that a simulated GPU does not have. The ops whose derivative
uses such a formula get an ``AutogradPrivateUse1`` kernel here: an ``autograd.Function`` that
saves what the generated node saves (``derivatives.yaml``) and runs the CUDA branch op for op, in
C++'s order of allocation and destruction.
"""
from __future__ import annotations

from typing import Any

import torch

#: derivatives.yaml: ``self: evenly_distribute_backward(grad, self, result)``
EVENLY_DISTRIBUTED = ("max", "min", "median", "nanmedian")


def evenly_distribute_backward(grad: torch.Tensor, input: torch.Tensor,
                               value: torch.Tensor) -> torch.Tensor:
    """FunctionsManual.cpp ``evenly_distribute_backward``, the ``input.is_cuda()`` branch::

        const auto input_isnan = input.isnan();
        const auto value_isnan = value.isnan();
        const auto& input_and_value_isnan = input_isnan.logical_and_(value_isnan);
        const auto mask = (input == value).logical_or_(input_and_value_isnan);
        return mask * (grad / mask.sum());

    The full expression's temporaries (the quotient, then the sum) die after the product is
    made, then the locals in reverse order of declaration."""
    input_isnan = input.isnan()
    value_isnan = value.isnan()
    input_isnan.logical_and_(value_isnan)
    mask = (input == value).logical_or_(input_isnan)
    count = mask.sum()
    share = grad / count
    out = mask * share
    del share, count, mask, value_isnan, input_isnan
    return out


class _EvenlyDistributed(torch.autograd.Function):
    """``MaxBackward1`` / ``MinBackward1`` / ``MedianBackward0`` / ``NanmedianBackward0``: saves
    ``self`` and ``result``."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, op: Any) -> torch.Tensor:
        with torch._C._AutoDispatchBelowAutograd():
            result = op(input)
        ctx.save_for_backward(input, result)
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        input, value = ctx.saved_tensors
        return evenly_distribute_backward(grad, input, value), None


def _autograd_kernel(op: Any) -> Any:
    def kernel(input: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and input.requires_grad:
            return _EvenlyDistributed.apply(input, op)
        with torch._C._AutoDispatchBelowAutograd():
            return op(input)
    return kernel


def register(lib: Any) -> None:
    """Register the CUDA-branch formulas' ops at ``AutogradPrivateUse1`` on `lib` (aten IMPL)."""
    for name in EVENLY_DISTRIBUTED:
        lib.impl(name, _autograd_kernel(getattr(torch.ops.aten, name).default), "AutogradPrivateUse1")
