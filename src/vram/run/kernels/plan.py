"""What CUDA kernels allocate beyond their outputs, for `vram.run.runtime` (layer 4; needs torch).

A simulated run executes every op on the ``meta`` device and charges the op's *outputs* to the
simulated caching allocator. This module holds the CUDA-specific knowledge on top of that, each
rule taken from PyTorch's CUDA sources (paths relative to ``aten/src/ATen``):

* **cuBLAS workspaces** (``cuda/CublasHandlePool.cpp``). The first cuBLAS call of a (handle,
  stream) pair allocates ``getChosenWorkspaceSize()`` bytes through the caching allocator and
  keeps them for the life of the process (``torch.cuda.empty_cache()`` does not release them).
  Default: 32 MiB (``4096 * 8 * 1024``) on sm90, else ``:4096:2:16:8`` = 8,519,680 bytes;
  ``CUBLAS_WORKSPACE_CONFIG=:SIZE:COUNT[...]`` overrides (sum of SIZE KiB × COUNT). Handles are
  per thread, and the autograd engine runs CUDA backward ops on its own device thread, so the
  first matmul of the first backward pass allocates a *second* workspace — visible in real
  recordings (``shared/traces/cs336-s-mem.pickle``: two 8,519,680-byte ``getNewWorkspace``
  allocations, one in forward, one in backward). The addmm cuBLASLt path (a 1-D contiguous bias,
  beta == 1, 2-D contiguous result, all matrix dims > 1, float/half/bfloat16/double:
  ``native/cuda/Blas.cpp`` ``isInputCompliesAddmmCudaLt``) also allocates the cuBLASLt workspace
  (``CUBLASLT_WORKSPACE_SIZE`` KiB, default 1024, capped at the cuBLAS workspace) unless
  ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1`` makes it share the cuBLAS one. Allocation order within
  the op: outputs, cuBLAS workspace, cuBLASLt workspace (``preallocate_cublas_workspaces``'s order).
* **Reductions** (``native/cuda/Reduce.cuh``): the global staging buffer and semaphores of
  multi-block launches, 32-bit splits, accumulation buffers and input dtype conversions live in
  `vram.run.kernels.reductions`; `op_plan` asks it after SDPA.
* **pow(scalar, tensor)** materialises its base as a 0-dim CUDA tensor (`scalar_base_bytes`).
* **bmm / baddbmm / mm / addmm** copy operands cuBLAS cannot read in place (an expanded
  gradient) before the cuBLAS call and free them on return (``native/cuda/Blas.cpp``,
  ``cuBlasCommonArgs.h``; `bmm_plan`, `mm_plan`).
* **cuDNN convolutions and batch norm in training**: their output layout and workspaces (sized by
  cuDNN at run time: measured on sm90 in `vram.run.kernels.cudnn_sm90`, other calls estimated at 0 B
  and named at the end of a run), and the survivable OOM of a workspace, in
  `vram.run.kernels.cudnn_conv` (`cudnn_plan`; `CUDA_META` restrides convolution outputs).
* **torch.fft** (cuFFT): operand copies and clones in ``SpectralOps.cpp``'s order; the plan
  workspace cuFFT sizes is named, not charged (`vram.run.kernels.cufft`); half precision as CUDA
  runs it (`vram.run.kernels.cufft_half`), its refusals (non-power-of-two sizes) CUDA's.
* **x[idx], x[mask], x[idx] = v** (``index.Tensor``, ``index_put_``): ``make_info``'s nonzero of a
  mask, host indices copied over, int32 indices made int64, broadcast indices made contiguous
  (`vram.run.kernels.indexing`, via `sorting`).
* **index_put_(accumulate=True)** (``x[idx]``'s backward, a user's put): a boolean mask's nonzero,
  int64 copies of int32 indices, the range check, linear indices, the value made contiguous, the
  transposed copy of indices on non-adjacent dims, the sort's key and index buffers
  (`vram.run.kernels.indexing`, via `sorting`).
* **CTC loss** (``LossCTC.cu``): the lengths and offsets copied to the GPU, ``log_alpha`` before the
  loss, the backward's ``log_beta`` and, for large problems, the blanks' ``logsumexp``; a call that
  takes cuDNN's kernel is refused (`vram.run.kernels.ctc`).
* **bincount / histc** (``SummaryOps.cu``): the minimum and maximum read to the host, a weights
  conversion (`vram.run.kernels.histograms`).
* **cummax / cummin**: the helpers' meta kernel (none in torch) and the copy of a non-contiguous
  input (`vram.run.kernels.scans`).
* **torch.linalg** (cuSOLVER, MAGMA): outputs charged; the library's workspaces and working
  copies, sized at run time, named (`vram.run.kernels.linalg`).
* **Sparse tensors** (COO/CSR/BSR): their kernels run on their components' dense ops;
  ``_coalesce`` and sparse ``addmm`` follow ``sparse/cuda`` step by step, Thrust's and cuSPARSE's
  buffers named, not charged (`vram.run.kernels.sparse`, registered by ``engine.sparse_layouts``).
* **sort, topk, cumsum/cumprod, multinomial, nonzero, scatter_reduce(mean)**: index ranges, dim-last
  copies, the segmented radix sort's key and index buffers, multinomial's exponential noise and
  checks (``Sort.cpp``, ``SortStable.cu``, ``TensorTopK.cpp``, ``ScanUtils.cuh``,
  ``Distributions.cpp``, ``Nonzero.cu``) in `vram.run.kernels.sorting`; cub's temporary storage,
  and ops whose scratch is not modelled (``index_reduce``…), named per call.
* **median, kthvalue, mode, multinomial with replacement**: contiguous copies, ``median()``'s
  sort, the sampling buffers (``Sorting.cpp``, ``TensorModeKernel.cpp``, ``MultinomialKernel.cu``)
  in `vram.run.kernels.selection`.
* **torch.unique / unique_consecutive**: worst-case outputs shrunk by ``resize_`` keep their storage
  (`cuda_outputs`), and the sort and scan buffers of ``UniqueCub.cu``; along a dim, the row
  copy, index and range buffers of ``Unique.cu`` (Thrust's own storage named)
  (`vram.run.kernels.unique`).
* **_foreach_norm / _foreach_powsum** (``clip_grad_norm_``) take a per-chunk partials buffer
  before their outputs and free it on return (``ForeachReduceOp.cu``; `foreach_norm_plan`).
* **_grouped_mm** (mixture-of-experts layers): the CUDA kernel's output layout and dtypes, which
  torch 2.13's meta kernel does not follow (`CUDA_META`), and its kernel choice, in
  `vram.run.kernels.grouped_mm`.
* **scaled_dot_product_attention**: backend choice (flash / memory-efficient / cuDNN / math, by the
  simulated compute capability) and what each kernel allocates, forward and backward, live in
  `vram.run.kernels.sdpa` (re-exported here); `op_plan` asks it first.
* **embedding_bag**: the forward's output order, the backward's copies, sort and segment buffers
  (``EmbeddingBag.cu``; `vram.run.kernels.embedding_bag`).
* **embedding / layer-norm / RMS-norm backward**: sort buffers, segment tables and partial
  gradients (``Embedding.cu``, ``EmbeddingBackwardKernel.cu``, ``layer_norm_kernel.cu``) live in
  `vram.run.kernels.scratch`; cub's own temporary storage there is named, not charged.

The rules follow the newest PyTorch sources read (2026); older releases differ in places (before
the shared cuBLASLt workspace, each Lt matmul allocated and freed its own 1 MiB).

Not modelled (documented limitations) — mostly transient scratch that raises a peak without
changing steady state: cuDNN workspaces outside the measured table; cub and Thrust temporary
storage; cuFFT plan workspaces; ``torch.mode`` over slices of more than 2,048 elements and
``nanmedian()`` without a dim; embedding_bag's sparse backward; masks whose values the run does
not know; NCCL buffers; CUDA graphs. Refused instead
(`RNN_OPS`: not scratch, the saved state differs): cuDNN's recurrent layers.
"""
from __future__ import annotations

from typing import Any

import torch

from . import reductions as _reductions
from . import scratch as _scratch
from . import sdpa as _sdpa
from .blas import bmm_plan, mm_plan, non_overlapping_and_dense
from .ctc import CUDA_META as _CTC_META
from .ctc import ctc_plan
from .cudnn import cudnn_plan
from .cudnn_conv import CUDA_META as _CONV_META
from .cufft import fft_plan
from .embedding_bag import embedding_bag_plan
from .grouped_mm import CUDA_META as _GROUPED_MM_META
from .grouped_mm import grouped_mm_plan
from .histograms import histogram_plan
from .linalg import linalg_plan
from .scans import CUDA_META as _SCAN_META
from .scans import cummaxmin_plan
from .selection import selection_plan
from .sorting import sorting_plan
from .unique import UNIQUE_OPS, unique_outputs, unique_plan
from .vision import nms_plan

#: ops whose meta kernel is not what the CUDA kernel does -> the CUDA kernel's output, on meta
CUDA_META = {**_GROUPED_MM_META, **_CONV_META, **_CTC_META, **_SCAN_META}
#: ops whose outputs CUDA allocates for the worst case and shrinks with ``resize_`` (`cuda_outputs`)
SHRUNK_BY_RESIZE = UNIQUE_OPS


def cuda_outputs(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
    """The meta outputs with the storage the CUDA kernel gives them (`unique_outputs`: worst-case
    buffers shrunk by ``resize_``); other ops' `out` as it is."""
    return unique_outputs(name, args, kwargs, out)


def op_plan(name: str, args: tuple[Any, ...], outs: list[Any], sms: int,
            max_threads_sm: int = 2048, cc: tuple[int, int] = (9, 0),
            kwargs: dict[str, Any] | None = None, mask_counts: dict[int, int] | None = None) -> list[tuple[str, Any]]:
    """The order in which a CUDA kernel allocates: ("out", i), ("tmp", nbytes) or ("free", j).

    ``("free", j)`` frees the j-th "tmp" of the plan. SDPA kernels follow `vram.run.kernels.sdpa.op_plan`,
    cuDNN convolutions and batch norm `vram.run.kernels.cudnn.cudnn_plan` (a ``("cudnn", (key, nbytes))``
    step is a workspace allocation that survives an OOM), reductions
    `vram.run.kernels.reductions.reduction_plan` (staging buffers of multi-block launches, on a
    device of `sms` SMs of `max_threads_sm` threads), ``_grouped_mm`` `vram.run.kernels.grouped_mm` (by
    the capability `cc`), sorting, top-k, scans, sampling and ``nonzero`` `vram.run.kernels.sorting`
    (which reads keyword-only arguments from `kwargs`, and the entries of an indexing op's boolean
    masks whose values the run knows from `mask_counts`, by position); ops without special knowledge
    allocate their outputs in output order.
    """
    plan = _sdpa.op_plan(name, args, outs, sms, cc)
    if plan is None:
        plan = cudnn_plan(name, args, outs, cc)
    if plan is None:
        plan = fft_plan(name, args, outs, cc)
    if plan is None:
        plan = ctc_plan(name, args, outs, sms, max_threads_sm)
    if plan is None:
        plan = cummaxmin_plan(name, args)
    if plan is None:
        plan = histogram_plan(name, args, kwargs or {}, outs, sms, max_threads_sm)
    if plan is None:
        plan = grouped_mm_plan(name, args, outs, cc)
    if plan is None:
        plan = linalg_plan(name, outs)
    if plan is None:
        plan = unique_plan(name, args, kwargs or {}, outs)
    if plan is None:
        plan = embedding_bag_plan(name, args, outs, sms)
    if plan is None:
        plan = selection_plan(name, args, kwargs or {}, outs)
    if plan is None:
        plan = sorting_plan(name, args, kwargs or {}, outs, sms, max_threads_sm, mask_counts)
    if plan is None:
        plan = _reductions.reduction_plan(name, args, outs, sms, max_threads_sm)
    if plan is None:
        plan = loss_plan(name, args, outs, sms, max_threads_sm)
    if plan is None:
        plan = bmm_plan(name, args, outs)
    if plan is None:
        plan = mm_plan(name, args, outs)
    if plan is None:
        plan = foreach_norm_plan(name, args, outs)
    if plan is None:
        plan = _scratch.scratch_plan(name, args, outs, sms, max_threads_sm)
    if plan is None:
        plan = nms_plan(name, args, outs)
    if plan is None:
        plan = [("out", i) for i in range(len(outs))]
        base = scalar_base_bytes(name, args)
        if base:
            plan += [("tmp", base), ("free", 0)]
    return plan


#: pointwise losses whose reduced forms compute the unreduced loss into a temporary first
#: (``native/Loss.cpp``): structured ones allocate their output before it, huber_loss after
_LOSSES = {"mse_loss": True, "smooth_l1_loss": True, "huber_loss": False}


def loss_plan(name: str, args: tuple[Any, ...], outs: list[Any], sms: int,
              max_threads_sm: int) -> list[tuple[str, Any]] | None:
    """A reduced pointwise loss (``native/Loss.cpp``). ``mse_loss_out``/``smooth_l1_loss_out``
    (structured: the output first) build the unreduced loss as a ``TensorIterator`` output
    (``Tensor loss; borrowing_binary_op(loss, input, target)``; smooth_l1 with ``beta == 0``:
    ``l1_loss_out``'s ``at::sub``) and ``mean_out``/``sum_out`` it into the output;
    ``huber_loss`` makes ``loss = at::empty_like(input)`` and returns ``loss.mean()``/``.sum()``
    (the output after it). The reduction's own staging follows `reduction_plan`; the
    temporary is freed when the function returns. None for other ops and for ``reduction=none``."""
    if name not in _LOSSES or len(args) < 2 or len(outs) != 1:
        return None
    x, target = args[0], args[1]
    reduction = args[2] if len(args) > 2 else 1  # at::Reduction::Mean
    if not isinstance(x, torch.Tensor) or not isinstance(target, torch.Tensor) or reduction == 0:
        return None
    if _LOSSES[name]:
        shape = torch.broadcast_shapes(x.shape, target.shape)
        dtype = torch.result_type(x, target)
    else:
        shape, dtype = x.shape, x.dtype
    loss = torch.empty(shape, dtype=dtype, device="meta")
    inner = _reductions.reduction_plan("mean" if reduction == 1 else "sum", (loss,), outs, sms, max_threads_sm)
    if inner is None:
        inner = [("out", 0)]
    shifted = [(step, arg + 1 if step == "free" else arg) for step, arg in inner]
    if _LOSSES[name]:  # the output exists before the reduction runs into it
        shifted = [s for s in shifted if s != ("out", 0)]
        return [("out", 0), ("tmp", loss.numel() * loss.element_size()), *shifted, ("free", 0)]
    return [("tmp", loss.numel() * loss.element_size()), *shifted, ("free", 0)]



#: ``MultiTensorApply.cuh``: each tensor is cut into chunks of this many elements
FOREACH_CHUNK = 65536
_FOREACH_NORMS = {"_foreach_norm": (1.0, 2.0, float("inf")), "_foreach_powsum": (1.0, 2.0)}


def foreach_norm_plan(name: str, args: tuple[Any, ...], outs: list[Any]) -> list[tuple[str, Any]] | None:
    """``_foreach_norm`` / ``_foreach_powsum`` on their fast path (``ForeachReduceOp.cu``,
    ``foreach_tensor_norm_cuda_internal``; what ``clip_grad_norm_`` calls): first
    ``output_per_tensor = at::zeros({ntensors * max_chunks_per_tensor}, opmath)``, one partial
    result per chunk of `FOREACH_CHUNK` elements; then a 0-dim output per tensor; the partials
    are freed when the function returns. The slow path (integer or complex tensors, another
    ``ord``, tensors that are not all of one dtype or not dense: ``can_use_fast_route``) runs
    ``linalg_vector_norm`` per tensor: None here. None too when a tensor is empty: its result
    is a ``zeros({})`` made after every other output."""
    ords = _FOREACH_NORMS.get(name)
    if ords is None or not args or not isinstance(args[0], (list, tuple)) or not args[0]:
        return None
    tensors = args[0]
    if len(outs) not in (1, len(tensors)):  # the list as one return (PrivateUse1), or its items (meta)
        return None
    ord_ = float(args[1]) if len(args) > 1 and isinstance(args[1], (int, float)) else 2.0
    dtype = args[2] if len(args) > 2 and isinstance(args[2], torch.dtype) else tensors[0].dtype
    first = tensors[0]
    if ord_ not in ords or not all(
            isinstance(t, torch.Tensor) and t.dtype == first.dtype and t.numel() > 0
            and non_overlapping_and_dense(t) for t in tensors) or not first.is_floating_point():
        return None
    chunks = max(-(-t.numel() // FOREACH_CHUNK) for t in tensors)
    opmath = 8 if dtype == torch.float64 else 4
    return [("tmp", len(tensors) * chunks * opmath), *(("out", i) for i in range(len(outs))), ("free", 0)]


def scalar_base_bytes(name: str, args: tuple[Any, ...]) -> int:
    """Bytes of the CUDA tensor ``pow(scalar, tensor)`` makes of its base, 0 if none.

    ``pow_Scalar_out`` (``native/Pow.cpp``) fills the output when the base is 1, else calls
    ``pow_out(out, wrapped_scalar_tensor(base, exp.device()), exp)``; ``scalar_to_tensor``
    (``ScalarOps.h``) makes a 0-dim tensor on that device in the Scalar's own type (double, int64,
    complex double or bool), freed when the op returns (after the output was allocated).
    """
    if name != "pow" or len(args) < 2 or isinstance(args[0], torch.Tensor) or not isinstance(args[1], torch.Tensor):
        return 0
    base = args[0]
    if isinstance(base, bool):
        return 0 if base else 1  # True == 1: filled
    if not isinstance(base, (int, float, complex)) or base == 1:
        return 0
    return 16 if isinstance(base, complex) else 8


