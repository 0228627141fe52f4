"""cuBLAS and cuBLASLt on the simulated GPU: the per-handle workspaces and the operand copies of
matrix products (paths under ``aten/src/ATen``).

* **Workspaces** (``cuda/CublasHandlePool.cpp``). The first cuBLAS call of a (handle, stream) pair
  allocates ``getChosenWorkspaceSize()`` bytes through the caching allocator and keeps them for the
  life of the process (``torch.cuda.empty_cache()`` does not release them). Default: 32 MiB
  (``4096 * 8 * 1024``) on sm90, else ``:4096:2:16:8`` = 8,519,680 bytes;
  ``CUBLAS_WORKSPACE_CONFIG=:SIZE:COUNT[...]`` overrides (sum of SIZE KiB × COUNT). Handles are per
  thread, and the autograd engine runs CUDA backward ops on its own device thread, so the first
  matmul of the first backward pass allocates a *second* workspace — visible in real recordings
  (``shared/traces/cs336-s-mem.pickle``: two 8,519,680-byte ``getNewWorkspace`` allocations, one in
  forward, one in backward). The addmm cuBLASLt path (a 1-D contiguous bias, beta == 1, 2-D
  contiguous result, all matrix dims > 1, float/half/bfloat16/double: ``native/cuda/Blas.cpp``
  ``isInputCompliesAddmmCudaLt``) also allocates the cuBLASLt workspace (``CUBLASLT_WORKSPACE_SIZE``
  KiB, default 1024, capped at the cuBLAS workspace) unless ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1``
  makes it share the cuBLAS one. Allocation order within the op: outputs, cuBLAS workspace,
  cuBLASLt workspace (``preallocate_cublas_workspaces``'s order).
* **Operand copies**: bmm / baddbmm / mm / addmm copy operands cuBLAS cannot read in place (an
  expanded gradient) before the cuBLAS call and free them on return (``native/cuda/Blas.cpp``,
  ``cuBlasCommonArgs.h``; `bmm_plan`, `mm_plan`).
"""
from __future__ import annotations

import os
import re
from typing import Any

import torch

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
