"""``nn.EmbeddingBag`` / ``F.embedding_bag`` on CUDA: the forward's output order and what the
backward allocates (layer 4; needs torch).

Read from ``aten/src/ATen/native/EmbeddingBag.cpp`` and ``native/cuda/EmbeddingBag.cu``:

* forward, ``_embedding_bag_cuda`` (``_embedding_bag``, ``_embedding_bag_forward_only``):
  ``promoteIndicesAndOffsets`` (indices and offsets of different index dtypes: the int32 one
  made int64), then ``bag_size``, ``offset2bag``, ``output``, ``max_indices`` (``empty({0})``
  unless ``mode='max'``) in that order; the promoted copy dies on return: `forward_plan`.
* backward, ``_embedding_bag_backward`` (the same promotion; the forward's ``offset2bag``;
  ``_embedding_bag_dense_backward``) and ``_embedding_bag_dense_backward_cuda``: ``grad.contiguous()``;
  ``mode='max'``: ``embedding_bag_backward_cuda_max``'s ``grad_weight = zeros`` alone; ``sum`` /
  ``mean``: ``embedding_bag_backward_cuda_sum_avg``: ``indices.contiguous()``, the sort of the
  indices and ``embedding_backward_cuda_kernel`` as for ``nn.Embedding``
  (`vram.run.kernels.scratch`), never its fused atomic path (bags have ``offset2bag``); the
  copies die in reverse: `backward_plan`.

Named, not charged (`UNMODELLED`): sparse gradients (``_embedding_bag_sparse_backward``) and a
backward without the forward's ``offset2bag`` (``make_offset2bag``'s ``index_add_`` and ``cumsum``).
"""
from __future__ import annotations

from typing import Any

import torch

from .scratch import CUB_NOTE, _nbytes, _Plan, _segments, _sort_indices

#: ``EmbeddingBagMode`` (EmbeddingBag.h)
SUM, MEAN, MAX = 0, 1, 2
UNMODELLED = ("embedding_bag backward with sparse=True, or without the forward's offset2bag (EmbeddingBag.cpp "
              "_embedding_bag_sparse_backward, make_offset2bag): buffers beyond its output")
CUB_BAG_NOTE = CUB_NOTE.replace("embedding_dense_backward", "embedding_bag backward")
FORWARD_OPS = ("_embedding_bag", "_embedding_bag_forward_only")
BACKWARD_OPS = ("_embedding_bag_backward", "_embedding_bag_dense_backward")


def _promote(p: _Plan, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``promoteIndicesAndOffsets``: the int64 copy of whichever of the two is int32 when their
    dtypes differ (charged as ``promoted``); the indices the kernels read."""
    if indices.dtype == offsets.dtype:
        return indices
    if indices.dtype == torch.int32:
        p.tmp("promoted", indices.numel() * 8)
        return torch.empty(indices.shape, dtype=torch.int64, device="meta")
    p.tmp("promoted", offsets.numel() * 8)
    return indices


def forward_plan(args: tuple[Any, ...], outs: list[Any]) -> list[tuple[str, Any]] | None:
    """``_embedding_bag_cuda`` (module doc): outputs (output, offset2bag, bag_size, max_indices)
    made in the order bag_size, offset2bag, output, max_indices."""
    if len(args) < 3 or len(outs) != 4 or not all(isinstance(t, torch.Tensor) for t in args[1:3]):
        return None
    p = _Plan()
    _promote(p, args[1], args[2])
    p.steps += [("out", 2), ("out", 1), ("out", 0), ("out", 3)]
    p.free("promoted")
    return p.steps


def backward_plan(name: str, args: tuple[Any, ...], outs: list[Any], sms: int) -> list[tuple[str, Any]] | None:
    """``_embedding_bag_backward`` / ``_embedding_bag_dense_backward`` (module doc)."""
    if name == "_embedding_bag_backward" and len(args) >= 10:
        grad, indices, offsets, offset2bag, _bag_size, _max_indices, num_weights, scale, mode, sparse = args[:10]
    elif name == "_embedding_bag_dense_backward" and len(args) >= 8:
        grad, indices, offset2bag, _bag_size, _max_indices, num_weights, scale, mode = args[:8]
        offsets, sparse = None, False
    else:
        return None
    if len(outs) != 1 or not all(isinstance(t, torch.Tensor) for t in (grad, indices, offset2bag)):
        return None
    p = _Plan()
    if isinstance(offsets, torch.Tensor):
        indices = _promote(p, indices, offsets)
    if sparse or (indices.numel() and not offset2bag.numel()):
        return [("out", 0), ("note", UNMODELLED)]
    if not grad.is_contiguous():
        p.tmp("grad", _nbytes(grad))
    n, isz = indices.numel(), indices.element_size()
    if int(mode) == MAX or n == 0:
        p.steps.append(("out", 0))  # zeros({num_weights, grad.size(1)})
    else:
        if not indices.is_contiguous():
            p.tmp("indices", n * isz)
        _sort_indices(p, n, isz, bool(scale), CUB_BAG_NOTE)
        _segments(p, grad, n, isz, int(num_weights), sms, bags=True)
        p.free("count", "orig", "sorted", "indices")
    p.free("grad", "promoted")
    return p.steps


def embedding_bag_plan(name: str, args: tuple[Any, ...], outs: list[Any], sms: int) -> list[tuple[str, Any]] | None:
    """The allocation order of an op this module knows (module doc), None for others."""
    if name in FORWARD_OPS:
        return forward_plan(args, outs)
    if name in BACKWARD_OPS:
        return backward_plan(name, args, outs, sms)
    return None
