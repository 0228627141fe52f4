"""``torch._grouped_mm`` (mixture-of-experts layers: transformers' ``grouped_mm`` experts,
torchtitan) as the CUDA kernel runs it, for `vram.run.kernels.plan` (paths under ``aten/src/ATen``).

torch 2.13's meta kernel (``torch/_meta_registrations.py`` ``_meta_grouped_mm_common``) accepts
bfloat16 only, and on a CPU build lays the output out contiguously. The CUDA kernel
(``native/cuda/GroupedBlas.cpp`` ``_grouped_mm_cuda``, helpers in ``native/GroupedMMUtils.h``)
takes float32, float16 and bfloat16 (``_grouped_mm_validate_inputs``) and allocates its output
with TMA-aligned strides (``create_grouped_gemm_output_tensor``: the last dim's stride padded to
16 bytes). On the simulated GPU the op's output therefore comes from `cuda_output`.

Which kernel: bfloat16 inputs and output on sm90 or sm100 (``_scaled_mm_allowed_device(sm90_only,
sm100_only)``) run CUTLASS's ``bf16bf16_grouped_mm`` (``native/cuda/GroupMM.cu``), which takes an
argument buffer and a CUTLASS workspace from the caching allocator and frees both on return: the
workspace's size is CUTLASS's (``Gemm::get_workspace_size``), so they are left uncharged and named
at the end of the run. Every other case runs ``_grouped_mm_fallback``: ``offs`` copied to the host,
then one cuBLAS ``mm_out`` per group into slices of the output (the thread's cuBLAS workspace).
"""
from __future__ import annotations

from typing import Any

import torch

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
CUTLASS = ("CUTLASS grouped GEMM argument buffers and workspaces (bfloat16 torch._grouped_mm on sm90/sm100: "
           "GroupMM.cu bf16bf16_grouped_mm; the workspace size is CUTLASS's Gemm::get_workspace_size), "
           "freed when the call returns")


def _scalar_type(dtype: torch.dtype) -> str:
    """c10's ``ScalarType`` name, as TORCH_CHECK prints it ("Long", "BFloat16")."""
    return torch.empty(0, dtype=dtype).type()[len("torch."):-len("Tensor")]  # a CPU tensor of no bytes


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise RuntimeError(message)


def _check_strides(mat: torch.Tensor) -> None:
    """``check_valid_strides_and_return_transposed``: a 16-byte aligned start, one unit stride in the
    last two dims and the other a multiple of 16 bytes (simulated storages start 512-aligned)."""
    sizes, strides, end = mat.shape, mat.stride(), mat.dim() - 1
    alignment = 16 // mat.element_size()
    _check(mat.storage_offset() * mat.element_size() % 16 == 0, "expected data_ptr to be aligned to 16 bytes")
    if strides[end - 1] == 1 and strides[end] >= max(1, sizes[end - 1]):
        _check(strides[end] % alignment == 0, "strides should be multiple of 16 bytes")
    elif strides[end] == 1 and strides[end - 1] >= max(1, sizes[end]):
        _check(strides[end - 1] % alignment == 0, "strides should be multiple of 16 bytes")
    else:
        _check(False, f"Invalid strides/sizes, got {list(strides)} for strides and {list(sizes)} for sizes")


def cuda_output(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``_grouped_mm_cuda``'s checks and its output (``create_grouped_gemm_output_tensor``), on meta."""
    for name, mat in (("mat_a", mat_a), ("mat_b", mat_b)):
        _check(mat.dtype in _FLOATS,
               f"Expected {name} to be Float32, BFloat16 or Float16 matrix, got {_scalar_type(mat.dtype)}")
    _check(mat_a.dim() in (2, 3), "mat_a has to be 2 or 3d")
    _check(mat_b.dim() in (2, 3), "mat_b has to be 2 or 3d")
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    if not a_2d or not b_2d:
        _check(mat_a.size(-1) == mat_b.size(-2), "contraction dimension of mat_a and mat_b must match")
    _check_strides(mat_a)
    _check_strides(mat_b)
    _check((offs is not None) == (a_2d or b_2d),
           "Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d")
    if offs is not None:
        _check(offs.dim() == 1, "offs has to be 1D")
        _check(offs.dtype == torch.int32, "Offsets have to be int32")
    _check(bias is None, "Bias not supported yet")
    dtype = out_dtype or mat_a.dtype
    _check(dtype == mat_a.dtype, "Grouped gemm output dtype must match `mat_a` dtype")
    if a_2d and b_2d:
        assert offs is not None
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif a_2d:
        assert offs is not None
        _check(offs.size(0) == mat_b.size(0), "matrix batch sizes have to match")
        size = [mat_a.size(0), mat_b.size(-1)]
    elif b_2d:
        assert offs is not None
        _check(offs.size(0) == mat_a.size(0), "matrix batch sizes have to match")
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        _check(mat_a.size(0) == mat_b.size(0), "batched dimension has to match")
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    alignment = 16 // dtype.itemsize
    padded = -(-size[-1] // alignment) * alignment
    stride = [padded, 1] if a_2d != b_2d else [size[1] * padded, padded, 1]
    return torch.empty_strided(size, stride, dtype=dtype, device=mat_a.device)


#: ops whose meta kernel is not what the CUDA kernel does -> the CUDA kernel's output, on meta
CUDA_META = {torch.ops.aten._grouped_mm.default: cuda_output}


def grouped_mm_plan(name: str, args: tuple[Any, ...], outs: list[Any],
                    cc: tuple[int, int]) -> list[tuple[str, Any]] | None:
    """The output, then CUTLASS's uncharged scratch (bfloat16 on sm90/sm100) or the fallback's
    per-group cuBLAS calls (``("blas", None)``); None for other ops."""
    if name != "_grouped_mm" or len(args) < 2:
        return None
    bf16 = args[0].dtype == args[1].dtype == outs[0].dtype == torch.bfloat16
    if bf16 and cc[0] in (9, 10):
        return [("out", 0), ("note", CUTLASS)]
    return [("out", 0), ("blas", None)]
