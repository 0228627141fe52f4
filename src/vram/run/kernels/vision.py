"""torchvision's CUDA kernels that allocate more than their outputs (``torchvision/csrc/ops/cuda``).

``nms`` (``nms_kernel.cu``, ``nms_kernel``): for ``n`` boxes, ``scores.sort(0, descending)``
makes the sorted scores and their order (the scores are dropped at once: only ``std::get<1>`` is
kept), ``dets.index_select(0, order_t)`` the sorted boxes, then the suppression bit mask,
``n * ceil(n / 64)`` int64 words (``threadsPerBlock`` is 64, the bits of an ``unsigned long
long``). The mask is copied to the host, the boxes kept are chosen there, and their positions
are copied back to the device (``keep.narrow(0, 0, num_to_keep).to(order_t.device())``) to index
``order_t``: the output. The temporaries die as the function returns, the copied positions first
(the return expression's temporary), then the locals in reverse order. With no boxes, the output
alone. The sort's own cub scratch (radix sort beyond 4096 elements) is not charged, as elsewhere.
"""
from __future__ import annotations

from typing import Any

import torch

#: bits per word of the suppression mask (``nms_kernel.cu``: ``sizeof(unsigned long long) * 8``)
THREADS_PER_BLOCK = 64


def nms_plan(name: str, args: tuple[Any, ...], outs: list[Any]) -> list[tuple[str, Any]] | None:
    """``torchvision::nms``'s allocations in order; None for other ops."""
    if name != "nms" or len(args) < 2 or len(outs) != 1:
        return None
    dets, scores = args[0], args[1]
    if not isinstance(dets, torch.Tensor) or not isinstance(scores, torch.Tensor) or dets.dim() != 2:
        return None
    n = dets.size(0)
    if dets.numel() == 0:
        return [("out", 0)]
    kept = outs[0].numel()
    col_blocks = -(-n // THREADS_PER_BLOCK)
    plan: list[tuple[str, Any]] = [("tmp", n * scores.element_size()), ("tmp", n * 8), ("free", 0),  # sort
                                   ("tmp", n * 4 * dets.element_size()), ("tmp", n * col_blocks * 8)]
    if kept:  # the kept positions on the device (none kept: an empty tensor, no block)
        plan += [("tmp", kept * 8), ("out", 0), ("free", 4)]
    else:
        plan.append(("out", 0))
    return [*plan, ("free", 3), ("free", 2), ("free", 1)]  # mask, dets_sorted, order_t
