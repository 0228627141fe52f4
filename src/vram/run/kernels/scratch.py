"""Scratch that CUDA kernels of ops that run whole take from the caching allocator (layer 4; needs torch).

`vram.run.kernels.plan.op_plan` asks `scratch_plan` for the allocation order of these ops (steps as in
`op_plan`: ("out", i), ("tmp", nbytes), ("free", j), ("note", text)). Each rule is read from the
CUDA host code (paths under ``aten/src/ATen/native/cuda``; the newest copies the source index held,
2025-2026, carrying the changes of the 2.13 era: worst-case-sized embedding segments, the
fused atomic embedding path, the two-pass layer-norm gamma/beta reduction for large M):

* ``embedding_dense_backward`` (``Embedding.cu`` ``embedding_dense_backward_cuda`` and
  ``EmbeddingBackwardKernel.cu`` ``embedding_backward_cuda_kernel``): `embedding_backward_plan`.
* ``native_layer_norm_backward`` / ``_fused_rms_norm_backward`` (``layer_norm_kernel.cu``
  ``layer_norm_backward_cuda``, ``LayerNormBackwardKernelImplInternal``,
  ``LaunchGammaBetaBackwardCUDAKernel``): `norm_backward_plan`.
* ``_softmax_backward_data`` (``SoftMax.cu`` ``softmax_backward_cuda_out``): the product
  ``grad * output`` before the kernel: `softmax_backward_plan`.

cub's own temporary storage (``ATen/cuda/cub.cuh`` ``CUB_WRAPPER``: ``func(nullptr, bytes, ...)``
then ``caching_allocator.allocate(bytes)``, freed when the call returns) is sized by cub's
dispatch from the tuning policy of the GPU's architecture and the CCCL release PyTorch was
built with (onesweep/tile sizes, spine lengths): not derivable here, so not charged; the op
carries a note instead (`vram.run.kernels.cudnn.uncharged_note`).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from . import reductions as _reductions

#: ``EmbeddingBackwardKernel.cu``: rows each partial segment sums
NROWS_PER_THREAD = 10
#: ``EmbeddingBackwardKernel.cu``: the fused atomic path needs fewer blocks than SMs times this
MAX_ATOMIC_ACCUM_BLOCKS_PER_SM = 4
#: ``SortingCommon.cuh`` (CUDA)
MAX_BLOCK_SIZE = 1024
#: ``Embedding.cu``: at most this many indices (and no ``scale_grad_by_freq``) take the
#: one-kernel path that allocates only ``grad_weight``
EMBEDDING_FEATURE_KERNEL_MAX = 3072
WARP = 32
CUB_NOTE = ("cub temporary storage in embedding_dense_backward (radix sort, unique_by_key, scans: "
            "sized by cub's tuning policy for the GPU architecture and CCCL release, ATen/cuda/cub.cuh "
            "CUB_WRAPPER), freed within the call")
LN_MULTI_DIM_NOTE = ("layer-norm backward partial gamma/beta buffers for M > 65,536 with a multi-dimensional "
                     "normalized_shape or a bias gradient without a weight gradient (layer_norm_kernel.cu "
                     "LaunchGammaBetaBackwardCUDAKernel sizes them by gamma.size(-1))")


class _Plan:
    """Steps with named temporaries: `free` finds the index `op_plan`'s ("free", j) needs."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, Any]] = []
        self.index: dict[str, int] = {}
        self.count = 0

    def tmp(self, key: str, nbytes: int) -> None:
        if nbytes > 0:  # a 0-byte at::empty takes nothing from the allocator
            self.index[key] = self.count
            self.count += 1
            self.steps.append(("tmp", nbytes))

    def free(self, *keys: str) -> None:
        for key in keys:
            if key in self.index:
                self.steps.append(("free", self.index.pop(key)))

    def splice(self, steps: list[tuple[str, Any]] | None, outs: list[tuple[str, int]], prefix: str) -> None:
        """Another op's plan run inside this one: its ("out", i) become temporaries named by
        `outs` (key, bytes), its own temporaries are named ``prefix.k``."""
        count = 0
        for step, arg in steps or []:
            if step == "out":
                self.tmp(*outs[arg])
            elif step == "tmp":
                self.tmp(f"{prefix}.{count}", arg)
                count += 1
            elif step == "free":
                self.free(f"{prefix}.{arg}")
            else:
                self.steps.append((step, arg))

    def inner(self, steps: list[tuple[str, Any]], out: int) -> None:
        """Splice another op's plan (a ``sum``) whose output is return `out` of this op."""
        base = self.count
        for step, arg in steps:
            if step == "out":
                self.steps.append(("out", out))
            elif step == "tmp":
                self.steps.append((step, arg))
                self.count += 1
            elif step == "free":
                self.steps.append((step, arg + base))
            else:
                self.steps.append((step, arg))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _int32(v: int) -> int:
    """A value assigned to an ``int32_t`` (two's complement wrap, as the C++ does)."""
    return (v + 2**31) % 2**32 - 2**31


def embedding_backward_plan(args: tuple[Any, ...], outs: list[Any], sms: int) -> list[tuple[str, Any]] | None:
    """``embedding_dense_backward_cuda`` (Embedding.cu): ``indices_.contiguous()`` and
    ``grad_.contiguous()`` copies of strided inputs; with at most 3,072 indices and no
    ``scale_grad_by_freq``, only ``grad_weight = zeros``. Otherwise the sort (`_sort_indices`) and
    ``embedding_backward_cuda_kernel`` (`_segments`). Locals die in reverse declaration order.
    Index tensors have the indices' dtype."""
    if len(args) < 5 or len(outs) != 1:
        return None
    grad, indices, num_weights, _padding, scale = args[:5]
    if not isinstance(grad, torch.Tensor) or not isinstance(indices, torch.Tensor) or grad.dim() == 0:
        return None
    n, isz = indices.numel(), indices.element_size()
    p = _Plan()
    if not indices.is_contiguous():
        p.tmp("indices", n * isz)
    if not grad.is_contiguous():
        p.tmp("grad", _nbytes(grad))
    if n <= EMBEDDING_FEATURE_KERNEL_MAX and not scale:
        p.steps.append(("out", 0))
        p.free("grad", "indices")
        return p.steps
    _sort_indices(p, n, isz, bool(scale))
    _segments(p, grad, n, isz, int(num_weights), sms, bags=False)
    p.free("count", "orig", "sorted", "grad", "indices")
    return p.steps


def _sort_indices(p: _Plan, n: int, isz: int, scale: bool, note: str = CUB_NOTE) -> None:
    """``sorted_indices``, ``orig_indices``, ``range = arange(num_indices)`` (freed after cub's
    radix sort), ``count`` when scaling by frequency (its cub scans named with the sort's)."""
    p.tmp("sorted", n * isz)
    p.tmp("orig", n * isz)
    p.tmp("range", n * isz)
    p.steps.append(("note", note))  # radix_sort_pairs' temp storage (and the later cub calls)
    p.free("range")
    if scale:
        p.tmp("count", n * isz)


def _segments(p: _Plan, grad: torch.Tensor, n: int, isz: int, num_weights: int, sms: int, bags: bool) -> None:
    """``embedding_backward_cuda_kernel`` (EmbeddingBackwardKernel.cu): ``grad_weight`` (the
    output), ``segment_offsets[numel]``, a 0-dim int64 segment count, with ``max_segments =
    min(numel, num_weights)``: ``partials_per_segment`` and its offsets ``[max_segments]``, a 0-dim
    int64, ``partial_segment_offset[numel/10 + max_segments]``; then either the fused atomic path
    (no ``offset2bag``: not for bags; ``sum_scatter_grid < SMs*4``, ``max_partial_segment >
    4*sum_scatter_grid``, not deterministic: ``partial_to_segment_idx`` and, for half/bfloat16, a
    float ``grad_weight_acc`` of the weight's shape) or ``grad_weight_per_segment
    [max_partial_segment, stride]`` in opmath; its locals die in reverse declaration order."""
    p.steps.append(("out", 0))
    p.tmp("segment_offsets", n * isz)
    p.tmp("num_of_segments", 8)
    max_segments = min(n, num_weights)
    p.tmp("partials_per_segment", max_segments * isz)
    p.tmp("partials_per_segment_offset", max_segments * isz)
    p.tmp("num_of_partial_segments", 8)
    max_partial = n // NROWS_PER_THREAD + max_segments
    p.tmp("partial_segment_offset", max_partial * isz)
    stride = grad.size(-1)
    stride_warped = -(-stride // WARP) * WARP
    block = min(stride_warped, MAX_BLOCK_SIZE)
    grid = _int32(-(-(max_segments * stride_warped) // block)) if block else 0
    fused = (not bags and grid < sms * MAX_ATOMIC_ACCUM_BLOCKS_PER_SM and max_partial > grid * 4
             and not torch.are_deterministic_algorithms_enabled())
    opmath = 8 if grad.dtype == torch.float64 else 4
    if fused:
        p.tmp("partial_to_segment_idx", max_partial * isz)
        if grad.dtype in (torch.float16, torch.bfloat16):
            p.tmp("grad_weight_acc", num_weights * stride * 4)
            p.free("grad_weight_acc")
        p.free("partial_to_segment_idx")
    else:
        p.tmp("grad_weight_per_segment", max_partial * stride * opmath)
        p.free("grad_weight_per_segment")
    p.free("partial_segment_offset", "num_of_partial_segments", "partials_per_segment_offset",
           "partials_per_segment", "num_of_segments", "segment_offsets")


def norm_backward_plan(name: str, args: tuple[Any, ...], outs: list[Any], sms: int,
                       max_threads_sm: int) -> list[tuple[str, Any]] | None:
    """``layer_norm_backward_cuda`` / ``_fused_rms_norm_backward_cuda`` (layer_norm_kernel.cu):
    ``input.expect_contiguous()`` and ``weight``/``bias`` likewise (copies of strided ones);
    ``dX``, ``dgamma``, ``dbeta`` (``empty_like``; ``zeros_like`` when M is 0); when M and N > 0,
    ``dY.contiguous()`` for the kernel call. ``LaunchGammaBetaBackwardCUDAKernel``: when
    ``M > 64*1024`` and ``N / 32 < SMs / 2``, partial buffers ``[blocks.y, gamma.size(-1)]`` in
    the input dtype (``blocks.x = ceil(N/32)``, ``blocks.y = min(32768 / blocks.x, ceil(M/32))``;
    beta's only for layer norm), then ``*dgamma = dgamma_blocks.sum(0)``: the ``sum`` allocates
    the returned gradient and the first ``dgamma`` is released; the same for ``dbeta``. Other M:
    one kernel writes the outputs, nothing else. Temporaries die in reverse order."""
    rms = name == "_fused_rms_norm_backward"
    need = 6 if rms else 8
    if len(args) < need or not isinstance(args[0], torch.Tensor) or not isinstance(args[1], torch.Tensor):
        return None
    dy, x, shape = args[0], args[1], args[2]
    weight = args[4] if rms else args[5]
    bias = None if rms else args[6]
    n = math.prod(shape)
    m = x.numel() // n if n else math.prod(x.shape[:x.dim() - len(shape)])
    p = _Plan()
    if not x.is_contiguous():
        p.tmp("X", _nbytes(x))
    for key, t in (("gamma", weight), ("beta", bias)):
        if isinstance(t, torch.Tensor) and not t.is_contiguous():
            p.tmp(key, _nbytes(t))
    grads = [o if isinstance(o, torch.Tensor) else None for o in outs]
    two_pass = m > 64 * 1024 and n // WARP < sms // 2 and m > 0 and n > 0
    dgamma = grads[1] if len(grads) > 1 else None
    dbeta = grads[2] if len(grads) > 2 and not rms else None
    if two_pass and (dgamma is None and dbeta is not None or dgamma is not None and dgamma.dim() != 1):
        p.steps += [("out", i) for i in range(len(outs))] + [("note", LN_MULTI_DIM_NOTE)]
        p.free("beta", "gamma", "X")
        return p.steps
    two_pass = two_pass and dgamma is not None
    p.steps.append(("out", 0))
    if two_pass:
        p.tmp("dgamma", _nbytes(dgamma))  # type: ignore[arg-type]
        if dbeta is not None:
            p.tmp("dbeta", _nbytes(dbeta))
    else:
        p.steps += [("out", i) for i in range(1, len(outs))]
    if m > 0 and n > 0 and not dy.is_contiguous():
        p.tmp("dY", _nbytes(dy))
    if two_pass:
        assert dgamma is not None
        bx = -(-n // WARP)
        by = min((64 * 1024 // 2) // bx, -(-m // WARP))
        blocks = torch.empty((by, dgamma.size(-1)), dtype=dgamma.dtype, device="meta")
        p.tmp("dgamma_blocks", _nbytes(blocks))
        if dbeta is not None:
            p.tmp("dbeta_blocks", _nbytes(blocks))
        for key, i in (("dgamma", 1), ("dbeta", 2)):
            if key in p.index:
                inner = _reductions.reduction_plan("sum", (blocks, [0]), [outs[i]], sms, max_threads_sm)
                p.inner(inner if inner is not None else [("out", 0)], i)
                p.free(key)  # the assignment drops the first gradient tensor
        p.free("dbeta_blocks", "dgamma_blocks")
    p.free("dY", "beta", "gamma", "X")
    return p.steps


def softmax_backward_plan(args: tuple[Any, ...]) -> list[tuple[str, Any]] | None:
    """``softmax_backward_cuda_out`` (SoftMax.cu): after the structured output ``grad_input``,
    ``Tensor tmp = grad * output`` (a TensorIterator product, its layout following the inputs'),
    then ``host_softmax_backward(tmp, output, ...)`` takes ``tmp.contiguous()`` and
    ``output.contiguous()``; all freed on return. (``_log_softmax_backward_data`` has no product.)"""
    grad, output = args[0], args[1]
    if not isinstance(grad, torch.Tensor) or not isinstance(output, torch.Tensor):
        return None
    tmp = torch.mul(grad.to("meta"), output.to("meta"))
    p = _Plan()
    p.steps.append(("out", 0))
    p.tmp("tmp", _nbytes(tmp))
    if tmp.numel() and tmp.dim():  # host_softmax_backward returns at once on an empty grad
        p.tmp("grad", 0 if tmp.is_contiguous() else _nbytes(tmp))
        p.tmp("output", 0 if output.is_contiguous() else _nbytes(output))
    p.free("output", "grad", "tmp")
    return p.steps


def scratch_plan(name: str, args: tuple[Any, ...], outs: list[Any], sms: int,
                 max_threads_sm: int) -> list[tuple[str, Any]] | None:
    """The allocation order of an op this module knows (see the module doc), None for others."""
    if name == "embedding_dense_backward":
        return embedding_backward_plan(args, outs, sms)
    if name in ("native_layer_norm_backward", "_fused_rms_norm_backward"):
        return norm_backward_plan(name, args, outs, sms, max_threads_sm)
    if name == "_softmax_backward_data":
        return softmax_backward_plan(args)
    return None
