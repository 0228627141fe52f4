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
* **cuDNN's scratch** (convolution workspaces, batch-norm workspace and reserve) is sized by cuDNN
  at run time: not charged, counted per call and named at the end of a run (`uncharged_scratch`).
* **_foreach_norm / _foreach_powsum** (``clip_grad_norm_``) take a per-chunk partials buffer
  before their outputs and free it on return (``ForeachReduceOp.cu``; `foreach_norm_plan`).
* **_grouped_mm** (mixture-of-experts layers): the CUDA kernel's output layout and dtypes, which
  torch 2.13's meta kernel does not follow (`CUDA_META`), and its kernel choice, in
  `vram.run.kernels.grouped_mm`.
* **scaled_dot_product_attention**: backend choice (flash / memory-efficient / cuDNN / math, by the
  simulated compute capability) and what each kernel allocates, forward and backward, live in
  `vram.run.kernels.sdpa` (re-exported here); `op_plan` asks it first.
* **embedding / layer-norm / RMS-norm backward**: sort buffers, segment tables and partial
  gradients (``Embedding.cu``, ``EmbeddingBackwardKernel.cu``, ``layer_norm_kernel.cu``) live in
  `vram.run.kernels.scratch`; cub's own temporary storage there is named, not charged.

The rules follow the newest PyTorch sources read (2026); older releases differ in places (before
the shared cuBLASLt workspace, each Lt matmul allocated and freed its own 1 MiB).

Not modelled (documented limitations) — mostly transient scratch that raises a peak without
changing steady state: cuDNN convolution workspaces; cub temporary storage; NCCL buffers;
CUDA graphs. Refused instead
(`RNN_OPS`: not scratch, the saved state differs): cuDNN's recurrent layers.
"""
from __future__ import annotations

import os
import re
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves

from . import reductions as _reductions
from . import scratch as _scratch
from . import sdpa as _sdpa
from .grouped_mm import CUDA_META as CUDA_META
from .grouped_mm import grouped_mm_plan
from .sdpa import convert_boolean_attn_mask as convert_boolean_attn_mask
from .sdpa import sdpa_args as sdpa_args
from .sdpa import sdpa_cuda as sdpa_cuda
from .sdpa import select_sdpa_backend as select_sdpa_backend

# -- cuBLAS ---------------------------------------------------------------------------------------
CUBLAS_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot",
                        "_addmm_activation"})
_TRUE = frozenset({"1", "ON", "YES", "TRUE", "Y"})
_FALSE = frozenset({"0", "OFF", "NO", "FALSE", "N"})


def cublas_workspace_size(major: int, minor: int) -> int:
    """``getChosenWorkspaceSize()``: bytes of one cuBLAS workspace on a device of this capability."""
    default = 4096 * 8 * 1024 if (major, minor) == (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config is None:
        return default
    total, found = 0, False
    for size, count in re.findall(r":([0-9]+):([0-9]+)", config):
        total += int(size) * 1024 * int(count)
        found = True
    return total if found else default


def cublaslt_workspace_size(cublas_size: int) -> int | None:
    """Bytes of the separate cuBLASLt workspace, or None when it shares the cuBLAS one."""
    unified = os.environ.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE")
    if unified is not None and unified.upper() in _TRUE:
        return None
    try:
        size = int(os.environ.get("CUBLASLT_WORKSPACE_SIZE", "1024")) * 1024
    except ValueError:
        size = 1024 * 1024
    if unified is None or unified.upper() not in _FALSE:
        size = min(size, cublas_size)  # getCUDABlasLtWorkspaceSize caps it unless explicitly off
    return size


def uses_cublaslt(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> bool:
    """Whether this addmm takes the cuBLASLt ``gemm_and_bias`` path (``isInputCompliesAddmmCudaLt``)."""
    if name not in ("addmm", "_addmm_activation") or len(args) < 3 or not isinstance(out, torch.Tensor):
        return False
    bias, mat1, mat2 = args[0], args[1], args[2]
    beta = kwargs.get("beta", args[3] if len(args) > 3 else 1)
    return (beta == 1 and bias.dim() == 1 and bias.is_contiguous() and bias.size(0) == mat2.size(1)
            and out.dim() == 2 and out.is_contiguous()
            and mat1.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
            and min(mat1.size(0), mat1.size(1), mat2.size(0), mat2.size(1)) > 1)


def op_plan(name: str, args: tuple[Any, ...], outs: list[Any], sms: int,
            max_threads_sm: int = 2048, cc: tuple[int, int] = (9, 0)) -> list[tuple[str, Any]]:
    """The order in which a CUDA kernel allocates: ("out", i), ("tmp", nbytes) or ("free", j).

    ``("free", j)`` frees the j-th "tmp" of the plan. SDPA kernels follow `vram.run.kernels.sdpa.op_plan`,
    reductions `vram.run.kernels.reductions.reduction_plan` (staging buffers of multi-block launches, on a
    device of `sms` SMs of `max_threads_sm` threads), ``_grouped_mm`` `vram.run.kernels.grouped_mm` (by
    the capability `cc`); ops without special knowledge allocate their outputs in output order.
    """
    plan = _sdpa.op_plan(name, args, outs, sms)
    if plan is None:
        plan = grouped_mm_plan(name, args, outs, cc)
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
        plan = [("out", i) for i in range(len(outs))]
        base = scalar_base_bytes(name, args)
        if base:
            plan += [("tmp", base), ("free", 0)]
    note = uncharged_scratch(name, args)
    return plan if note is None else [*plan, ("note", note)]


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


def _batch_operand_copy(t: Any, transpose_result: bool, m: int, n: int) -> int:
    """Bytes ``prepare_batch_matrix_for_cublas`` (``native/cuda/Blas.cpp``) allocates for a bmm
    operand: a contiguous clone when neither of its last two dims has stride 1 with a leading
    stride cuBLAS accepts (an expanded gradient: strides 0), unless it is contiguous with
    non-zero strides; ``resolve_conj_if_indicated`` copies a conjugate view where it resolves."""
    fast, lead = (2, 1) if transpose_result else (1, 2)
    s = t.stride()
    nbytes = t.numel() * t.element_size()
    if s[fast] == 1 and s[lead] >= max(1, m):
        return nbytes if t.is_conj() else 0
    if s[lead] == 1 and s[fast] >= max(1, n):
        return 0
    if t.is_contiguous() and s[1] != 0 and s[2] != 0:
        return nbytes if t.is_conj() and transpose_result else 0
    return nbytes


def bmm_plan(name: str, args: tuple[Any, ...], outs: list[Any]) -> list[tuple[str, Any]] | None:
    """``baddbmm_out_cuda_impl`` (``native/cuda/Blas.cpp``, bmm and baddbmm): after the output,
    a column-major copy of a result cuBLAS cannot write, then copies of the two operands
    (`_batch_operand_copy`), the cuBLAS call (``("blas", None)``: its workspace), and the copies
    freed in reverse order when the function returns. None for other ops."""
    if name not in ("bmm", "baddbmm") or not outs or not isinstance(outs[0], torch.Tensor):
        return None
    b1, b2 = (args[0], args[1]) if name == "bmm" else (args[1], args[2])
    res = outs[0]
    plan: list[tuple[str, Any]] = [("out", 0)]
    if res.numel() == 0 or b1.size(2) == 0 or res.dim() != 3:
        return plan + [("blas", None)]
    rs, rz = res.stride(), res.size()
    transpose_result = False
    copies = []
    if rs[1] == 1 and (rz[2] == 1 or rs[2] >= max(1, rz[1])):
        copies.append(res.numel() * res.element_size() if res.is_conj() else 0)
    elif rs[2] == 1 and (rz[1] == 1 or rs[1] >= max(1, rz[2])):
        transpose_result = True
        copies.append(res.numel() * res.element_size() if res.is_conj() else 0)
    else:
        copies.append(res.numel() * res.element_size())
    lead = 1 if transpose_result else 2
    m, n = rz[2 if transpose_result else 1], rz[lead]
    k = (b2 if transpose_result else b1).size(lead)
    first, second = (b2, b1) if transpose_result else (b1, b2)
    copies.append(_batch_operand_copy(first, transpose_result, m, k))
    copies.append(_batch_operand_copy(second, transpose_result, k, n))
    made = [c for c in copies if c]
    plan += [("tmp", c) for c in made] + [("blas", None)]
    return plan + [("free", j) for j in reversed(range(len(made)))]


def non_overlapping_and_dense(t: Any) -> bool:
    """``TensorImpl::compute_non_overlapping_and_dense`` (``c10/core/TensorImpl.cpp``): sorted by
    stride (dims of size < 2 last), each stride is the product of the sizes before it."""
    sizes, strides = t.shape, t.stride()
    if len(sizes) == 1:
        return sizes[0] < 2 or strides[0] == 1
    need = 1
    for d in sorted(range(len(sizes)), key=lambda d: (sizes[d] < 2, strides[d] if sizes[d] >= 2 else 0)):
        if sizes[d] < 2:
            return True
        if strides[d] != need:
            return False
        need *= sizes[d]
    return True


def _matrix_layout(t: Any, transpose_result: bool | None) -> tuple[int, bool]:
    """``prepare_matrix_for_cublas`` (``native/cuda/cuBlasCommonArgs.h``) for an operand
    (`transpose_result`) or the result (None): (bytes it copies, its transpose flag). A dense
    matrix, or one with a unit stride and a leading stride cuBLAS accepts, is read in place (a
    conjugate view is resolved, i.e. copied, where cuBLAS cannot conjugate it); any other — an
    expanded gradient — is cloned contiguous."""
    nbytes = t.numel() * t.element_size()
    s, z = t.stride(), t.shape
    if non_overlapping_and_dense(t):
        transpose = t.is_contiguous()
        resolve = transpose_result is None or transpose == transpose_result
    elif s[0] == 1 and s[1] >= max(1, z[0]):
        transpose, resolve = False, transpose_result is None or not transpose_result
    elif s[1] == 1 and s[0] >= max(1, z[1]):
        transpose, resolve = True, transpose_result is None or transpose_result
    else:
        return nbytes, True
    return (nbytes if resolve and t.is_conj() else 0), transpose


def mm_plan(name: str, args: tuple[Any, ...], outs: list[Any]) -> list[tuple[str, Any]] | None:
    """``addmm_out_cuda_impl`` (``native/cuda/Blas.cpp``: mm, addmm, _addmm_activation): after the
    output, ``cublasCommonArgs`` prepares the result, then the two operands (`_matrix_layout`); the
    GEMM call (``("blas", None)``: workspaces); its members die in reverse declaration order
    (result, matb, mata). None for other ops."""
    if name not in ("mm", "addmm", "_addmm_activation") or not outs or not isinstance(outs[0], torch.Tensor):
        return None
    mat1, mat2 = (args[0], args[1]) if name == "mm" else (args[1], args[2])
    res = outs[0]
    plan: list[tuple[str, Any]] = [("out", 0)]
    if res.numel() == 0 or res.dim() != 2 or mat1.dim() != 2 or mat2.dim() != 2 or mat1.size(1) == 0:
        return plan + [("blas", None)]
    result, transpose_result = _matrix_layout(res, None)
    mata = _matrix_layout(mat2 if transpose_result else mat1, transpose_result)[0]
    matb = _matrix_layout(mat1 if transpose_result else mat2, transpose_result)[0]
    copies = [(k, c) for k, c in (("result", result), ("mata", mata), ("matb", matb)) if c]
    index = {k: i for i, (k, _) in enumerate(copies)}
    plan += [("tmp", c) for _, c in copies] + [("blas", None)]
    return plan + [("free", index[k]) for k in ("result", "matb", "mata") if k in index]


_CONV = ("cuDNN convolution workspaces: cuDNN picks each at run time, up to max(free device memory, the "
         "largest cached free block) (Conv_v8.cpp get_available_workspace, CUDACachingAllocator cacheInfo), "
         "and PyTorch frees it when the call returns")
_BN = ("cuDNN batch-norm workspaces and reserve space (training): sized by cuDNN "
       "(cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize / ...TrainingExReserveSpaceSize, "
       "cudnn/BatchNorm.cpp), which a CPU machine cannot ask")
#: batch-norm ops on a CPU build of torch -> the indices of their ``training``/``train`` flag (None:
#: always training) and of ``eps``; backward ops take ``grad_out`` first
_BN_ARGS = {"native_batch_norm": (5, 7), "_batch_norm_with_update": (None, 6),
            "native_batch_norm_backward": (7, 8), "batch_norm_backward": (7, 8)}


def cudnn_batch_norm(x: torch.Tensor, weight: Any, training: bool, eps: float) -> bool:
    """Normalization.cpp ``_select_batch_norm_backend`` on a CUDA build with cuDNN: no bfloat16
    input or weight, a half input only with a float weight, a weight, 3 or more dims, a batch of at
    most 880,801 (training) or 65,535 (inference), eps ≥ 1e-5 (CUDNN_BN_MIN_EPSILON)."""
    if not isinstance(weight, torch.Tensor) or torch.bfloat16 in (x.dtype, weight.dtype):
        return False
    if x.dtype == torch.float16 and weight.dtype != torch.float32:
        return False
    return x.dim() >= 3 and x.shape[0] <= (880801 if training else 65535) and eps >= 1e-5


def uncharged_scratch(name: str, args: tuple[Any, ...]) -> str | None:
    """What a CUDA kernel takes from the caching allocator in a size only the GPU's library knows
    (or vram does not model yet), or None: every convolution (cuDNN), batch norm in training when
    cuDNN runs it (`cudnn_batch_norm`; inference has no workspace); cub's temporary storage is named
    by the plans of `vram.run.kernels.scratch`. `vram run` counts such calls and says so at the end
    (`uncharged_note`), charging nothing."""
    if name in ("convolution", "_convolution", "convolution_backward"):
        return _CONV
    if name not in _BN_ARGS:
        return None
    flag, eps = _BN_ARGS[name]
    first = 1 if name.endswith("backward") else 0
    if len(args) <= eps or not isinstance(args[first], torch.Tensor):
        return None
    training = flag is None or args[flag] is True
    return _BN if training and cudnn_batch_norm(args[first], args[first + 1], True, args[eps]) else None


def uncharged_note(calls: dict[str, int]) -> str:
    """The end-of-run note for the calls `uncharged_scratch` named ("" when none ran)."""
    if not calls:
        return ""
    lines = ["vram run: kernel scratch not charged (a GPU's peak can exceed these figures by the largest "
             "such buffer live at that moment):"]
    lines += [f"  {n:,} call(s) with {what}" for what, n in calls.items()]
    return "\n".join(lines)


def cudnn_batch_norm_outputs(name: str, args: tuple[Any, ...], out: Any) -> Any:
    """``native_batch_norm`` in inference returns what CUDA's does: ``_batch_norm_impl_index``
    (Normalization.cpp) hands it to ``cudnn_batch_norm`` when `cudnn_batch_norm` (with bias and
    running statistics given) says so, and in inference that returns ``save_mean``/``save_var`` as
    ``empty({0})`` (cudnn/BatchNorm.cpp): only the output is allocated. Other ops and cases: `out`
    as it is."""
    flag, eps = _BN_ARGS["native_batch_norm"]
    if name != "native_batch_norm" or len(args) <= eps or args[flag] is not False or not isinstance(out, tuple):
        return out
    x, w, b, rm, rv = args[:5]
    if not all(isinstance(t, torch.Tensor) for t in (x, w, b, rm, rv)) or not cudnn_batch_norm(x, w, False, args[eps]):
        return out
    return (out[0], *(o.new_empty((0,)) for o in out[1:]))


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


# -- autocast ("cuda") ------------------------------------------------------------------------------
#: ops autocast runs in the autocast dtype (``autocast_mode.cpp``'s lower_precision_fp list)
AUTOCAST_LOWER = frozenset({
    "linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "baddbmm", "addmm", "addbmm",
    "addmv", "addr", "mv", "einsum", "chain_matmul", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "prelu", "scaled_dot_product_attention",
    "linalg_vecdot", "linalg_multi_dot", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell"})
#: recurrent ops whose CUDA memory is not modelled (refused: a wrong figure is worse than a stop).
#: On CUDA, ``aten/src/ATen/native/RNN.cpp`` sends ``lstm``/``gru``/``rnn_*`` to cuDNN
#: (``_cudnn_rnn``: a flat weight buffer, workspace and reserve space sized by cuDNN's own
#: ``cudnnGetRNNTempSpaceSizes``) and, without cuDNN, the cells to fused kernels
#: (``_thnn_fused_lstm_cell``: gates without bias, a saved workspace); on meta the CPU
#: decomposition runs instead (biased gates, chunk, pointwise ops), which allocates differently.
RNN_OPS = frozenset({"lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell", "rnn_tanh_cell",
                     "rnn_relu_cell"})


def rnn_refusal(name: str) -> str:
    """The one-line stop for `RNN_OPS` on the simulated GPU."""
    return (f"vram run: torch.{name} on the simulated GPU is not modelled (nn.LSTM/GRU/RNN and their "
            "cells: CUDA runs cuDNN's RNN kernels, whose workspace and reserve sizes come from cuDNN, "
            "or fused cell kernels; the CPU decomposition allocates differently), so memory figures "
            "would be wrong")


#: ops autocast runs in float32
AUTOCAST_FP32 = frozenset({
    "layer_norm", "group_norm", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss",
    "huber_loss", "kl_div", "binary_cross_entropy_with_logits", "cosine_similarity",
    "cosine_embedding_loss", "margin_ranking_loss", "soft_margin_loss", "multi_margin_loss",
    "triplet_margin_loss", "poisson_nll_loss", "hinge_embedding_loss", "logsumexp", "exp", "log",
    "log10", "log2", "log1p", "expm1", "rsqrt", "reciprocal", "pow", "acos", "asin", "cosh", "sinh",
    "tan", "erfinv", "softplus", "dist", "cdist", "pdist", "renorm", "__pow__", "__rpow__",
    "nll_loss2d", "multilabel_margin_loss", "frobenius_norm", "nuclear_norm"})
#: ops autocast gives ``dtype=torch.float32`` when no dtype is passed (fp32_set_opt_dtype; and
#: ``norm``'s fp32_append_dtype, which has the same effect: computed and returned in float32)
AUTOCAST_FP32_OPT_DTYPE = frozenset({"softmax", "log_softmax", "cumsum", "cumprod", "prod", "sum",
                                     "linalg_vector_norm", "linalg_matrix_norm", "norm"})
#: ops autocast refuses on CUDA tensors, whatever their dtypes: their error (``autocast_mode.cpp``)
AUTOCAST_BANNED = {"binary_cross_entropy": (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast.")}
#: ops autocast runs in the widest floating type among their arguments (promote)
AUTOCAST_PROMOTE = frozenset({"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler",
                              "grid_sample", "index_put", "index_put_", "tensordot", "scatter_add"})


def autocast_args(name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                  eligible: Callable[[torch.Tensor], bool],
                  cast: Callable[[torch.Tensor, torch.dtype], torch.Tensor]) -> tuple[Any, Any]:
    """Apply CUDA autocast's policy for op `name` to its arguments (``autocast_mode.cpp``).

    Lower-precision and float32 ops get their eligible (CUDA, floating, not float64) tensors cast;
    the C++ wrapper's argument pack is evaluated right to left (GCC builds), so casts are made in
    that order; inside a tensor list (``einsum``'s operands) they go left to right.
    fp32_set_opt_dtype ops get ``dtype=torch.float32`` when none is given.
    """
    if name in AUTOCAST_LOWER:
        to = torch.get_autocast_dtype("cuda")
    elif name in AUTOCAST_FP32:
        to = torch.float32
    elif name in AUTOCAST_PROMOTE:
        floats = [t.dtype for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and eligible(t)]
        if not floats:
            return args, kwargs
        to = floats[0]
        for d in floats[1:]:
            to = torch.promote_types(to, d)
    else:
        if name in AUTOCAST_FP32_OPT_DTYPE and kwargs.get("dtype") is None:
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if first is not None and eligible(first):
                kwargs = dict(kwargs, dtype=torch.float32)
        return args, kwargs

    def one(a: Any) -> Any:
        if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            # a TensorList is cast element by element, left to right (autocast_mode.h's
            # cached_cast overload for TensorList: a plain for loop)
            return type(a)([one(x) for x in a])
        return cast(a, to) if isinstance(a, torch.Tensor) else a

    kw = {k: one(v) for k, v in reversed(list(kwargs.items()))}
    if name == "einsum" and len(args) > 1 and isinstance(args[1], torch.Tensor):
        # torch.einsum(eq, a, b) passes its operands to aten::einsum as one Tensor[]
        return (args[0], *[one(a) for a in args[1:]]), {k: kw[k] for k in kwargs}
    new = [one(a) for a in reversed(args)][::-1]
    return tuple(new), {k: kw[k] for k in kwargs}


def simple_cross_entropy(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Class-index targets, no label smoothing: ``nll_loss(log_softmax(x, dtype=x.dtype))``."""
    names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction",
             "label_smoothing")
    p = dict(zip(names, args), **kwargs)
    x, t = p.get("input"), p.get("target")
    return (isinstance(x, torch.Tensor) and isinstance(t, torch.Tensor) and x.shape != t.shape
            and not p.get("label_smoothing") and p.get("size_average") is None and p.get("reduce") is None)


def cross_entropy_autocast(args: tuple[Any, ...], kwargs: dict[str, Any],
                           cast: Callable[[torch.Tensor, torch.dtype], torch.Tensor]) -> torch.Tensor:
    """``cross_entropy_loss`` under CUDA autocast: it has no autocast kernel of its own, so its
    decomposition runs through autocast — ``log_softmax(x, dim, x.scalar_type())`` keeps the input
    dtype (an explicit dtype is never overridden) and ``nll_loss`` (fp32 policy) casts those
    log-probabilities to float32: a lower-precision and a float32 copy of the logits' size."""
    names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction")
    p = dict(zip(names, args), **kwargs)
    x = p["input"]
    logp = torch.log_softmax(x, 0 if x.dim() == 1 else 1, dtype=x.dtype)
    weight = p.get("weight")
    return torch.nn.functional.nll_loss(
        cast(logp, torch.float32), p["target"],
        cast(weight, torch.float32) if isinstance(weight, torch.Tensor) else None,
        ignore_index=p.get("ignore_index", -100), reduction=p.get("reduction", "mean"))


# -- Python-level torch functions ------------------------------------------------------------------
#: Python-level torch functions whose own torch calls must meet the function mode (autocast's casts,
#: SDPA routing): a torch function mode runs with itself popped, so these run as a copy whose entry
#: check (``has_torch_function*``) is False, with the mode pushed again (nn.MultiheadAttention,
#: and so nn.Transformer*Layer in training, go through the first; F.normalize's ``norm`` is float32
#: under autocast)
TRANSPARENT = frozenset({F.multi_head_attention_forward, F.normalize})
_CLONES: dict[Any, Any] = {}


def _never(*args: Any) -> bool:
    return False


def clone_with_globals(func: Any, **names: Any) -> Any:
    """A copy of the Python function `func` that sees `names` in place of its module's globals."""
    clone = types.FunctionType(func.__code__, dict(func.__globals__, **names), func.__name__, func.__defaults__,
                               func.__closure__)
    clone.__kwdefaults__ = func.__kwdefaults__
    clone.__qualname__, clone.__doc__, clone.__module__ = func.__qualname__, func.__doc__, func.__module__
    return clone


def transparent(func: Any) -> Any:
    """`func` (one of `TRANSPARENT`) as a copy that does not hand itself to torch-function modes."""
    clone = _CLONES.get(func)
    if clone is None:
        clone = _CLONES[func] = clone_with_globals(func, has_torch_function=_never, has_torch_function_unary=_never,
                                                   has_torch_function_variadic=_never)
    return clone


#: softmax-family entry points, and where their (input, dim, dtype) arguments sit
_SOFTMAX_KERNELS = {"softmax": torch.ops.aten._softmax.default, "log_softmax": torch.ops.aten._log_softmax.default}
_FUNCTIONAL_SOFTMAX = frozenset({F.softmax, F.log_softmax})


def half_to_float_softmax(func: Any, name: str, args: Any, kwargs: dict[str, Any]) -> Callable[[], Any] | None:
    """CUDA's ``softmax(half, dim, dtype=float32)``: one ``_softmax(x, dim, half_to_float=True)``
    launch, no float copy of the input (SoftMax.cpp: ``input_.is_cuda() && Half && dtype ==
    Float``; every other device casts first). Autocast's fp32_set_opt_dtype makes this the usual
    fp16 attention softmax. None when the call is not that case."""
    kernel = _SOFTMAX_KERNELS.get(name)
    if kernel is None or not args or not isinstance(args[0], torch.Tensor) or args[0].dtype != torch.float16:
        return None
    names = ("input", "dim", "_stacklevel", "dtype") if func in _FUNCTIONAL_SOFTMAX else ("input", "dim", "dtype")
    given = dict(zip(names, args), **kwargs)
    dim = given.get("dim")
    if given.get("dtype") != torch.float32 or not isinstance(dim, int):
        return None
    x = given["input"]
    return lambda: kernel(x, dim, True)
