"""Sparse tensors on the simulated GPU: which of PyTorch's sparse kernels are CUDA's own, and what
the CUDA-only ones allocate, in order (layer 4; needs torch).

A CUDA sparse COO tensor (``SparseTensorImpl``) owns two dense storages, ``indices`` (int64,
``[sparse_dim, nnz]``) and ``values`` (``[nnz, *dense_dims]``); a compressed one
(``SparseCsrTensorImpl``: CSR, CSC, BSR, BSC) owns ``crow_indices``/``ccol_indices``,
``col_indices``/``row_indices`` and ``values``. On the simulated GPU they are the same
``TensorImpl`` kinds over simulated dense storages, so a sparse tensor costs what its components
cost on CUDA.

Most sparse kernels are one function for both devices in ``native_functions.yaml``
(``SparseCPU, SparseCUDA: clone_sparse``, ``_sparse_mm``, ``sparse_to_dense``…), written in ATen
ops on the components: the engine runs that kernel, whose dense ops allocate through the simulated
allocator as on CUDA (`SHARED_COO`, `SHARED_COMPRESSED`, `DENSE_TO_SPARSE`: torch 2.13's
``native_functions.yaml``). Where CUDA has a kernel of its own it is modelled here, step by step in
the ATen ops it calls (``aten/src/ATen/native/sparse/cuda``):

* ``_coalesce`` (`coalesce`; ``SparseCUDATensor.cu`` ``_coalesce_sparse_cuda``).
* ``addmm`` with a sparse ``mat1`` (`addmm`; ``SparseCUDATensorMath.cu``
  ``s_addmm_out_sparse_dense_cuda``), which ``mm``/``torch.sparse.mm``/``spmm`` reach through
  ``_sparse_mm``; with a CSR or BSR ``mat1`` (`addmm_compressed`; ``SparseBlas.cpp``
  ``addmm_out_sparse_compressed_cuda``, ``SparseBlasImpl.cpp`` ``spmm``/``block_sparse_mm``).
* CSR <-> CSC (`flip_compressed`; TensorConversions.cpp ``sparse_compressed_to_flipped``, whose
  ``flatten_indices`` is a ``DispatchStub``), autograd's ``t()`` of a CSR matrix before its matmul.
* ``add``, ``index_select``, ``sparse_mask`` of sparse tensors and ``torch.sparse.sum``'s backward
  in `vram.run.kernels.sparse_ops`.

Not charged, and named once per run with the calls that had them: the temporary storage of
Thrust's ``sort_by_key``/``unique_by_key`` in ``_coalesce`` (``ThrustAllocator``: sized by Thrust's
tuning for the architecture, `THRUST_NOTE`), and cuSPARSE's SpMM external buffer
(``SparseCUDABlas.cpp`` ``_csrmm2``, ``SparseBlasImpl.cpp`` ``spmm``:
``allocator.allocate(bufferSize)`` with the size ``cusparseSpMM_bufferSize`` reports at run time,
`SPMM_NOTE`). Every other kernel CUDA has of its own (sparse-sparse matmul, ``mul`` of two sparse
tensors, softmax, ``bmm``, ``hspmm``, BSR <-> BSC…) stops with `sparse_message`.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch

#: aten ops whose ``SparseCPU`` kernel is also the ``SparseCUDA`` one (torch 2.13)
SHARED_COO = frozenset((
    "_coalesced_ _dimI _dimV _indices _nnz _sparse_broadcast_to _sparse_coo_tensor_with_dims "
    "_sparse_coo_tensor_with_dims_and_tensors _sparse_mask_projection _to_dense _to_sparse "
    "_to_sparse.sparse_dim _to_sparse_bsc _to_sparse_bsr _to_sparse_csc _to_sparse_csr _values abs "
    "abs.out abs_ add.Tensor add_.Tensor any asin asin.out asin_ asinh asinh.out asinh_ atan atan.out "
    "atan_ atanh atanh.out atanh_ cat ceil ceil.out ceil_ clone conj_physical.out copy_ "
    "copy_sparse_to_sparse_ deg2rad deg2rad.out deg2rad_ dense_dim div.Tensor div.Tensor_mode div.out "
    "div.out_mode div_.Tensor div_.Tensor_mode empty.memory_format empty_like erf erf.out erf_ erfinv "
    "erfinv.out erfinv_ expm1 expm1.out expm1_ floor floor.out floor_ floor_divide floor_divide.out "
    "floor_divide_.Tensor frac frac.out frac_ indices is_coalesced isinf isnan isneginf isneginf.out "
    "isposinf isposinf.out log1p log1p.out log1p_ mm mm.out mul.Tensor mul_.Tensor mv nan_to_num "
    "nan_to_num.out nan_to_num_ narrow_copy native_norm native_norm.ScalarOpt_dim_dtype neg neg.out neg_ "
    "norm.ScalarOpt_dim norm.ScalarOpt_dim_dtype permute pow.Tensor_Scalar pow.Tensor_Scalar_out rad2deg "
    "rad2deg.out rad2deg_ relu relu_ resize_as_sparse_ round round.out round_ sgn sgn.out sgn_ sign "
    "sign.out sign_ signbit signbit.out sin sin.out sin_ sinh sinh.out sinh_ sparse_dim sparse_mask "
    "sparse_resize_ sparse_resize_and_clear_ sqrt sqrt.out sqrt_ sub.Tensor sub.out sub_.Tensor sum "
    "sum.dim_IntList tan tan.out tan_ tanh tanh.out tanh_ threshold_backward "
    "threshold_backward.grad_input trunc trunc.out trunc_ unsqueeze values view_as_complex view_as_real "
    "zero_ zeros.out").split())
#: aten ops whose ``SparseCsrCPU`` kernel is also the ``SparseCsrCUDA`` one (torch 2.13)
SHARED_COMPRESSED = frozenset((
    "_conj_physical _nnz _to_dense _to_sparse _to_sparse.sparse_dim _to_sparse_bsc _to_sparse_bsr "
    "_to_sparse_csc _to_sparse_csr abs abs.out abs_ add.Tensor add_.Tensor addmm angle angle.out asin "
    "asin.out asin_ asinh asinh.out asinh_ atan atan.out atan_ atanh atanh.out atanh_ ccol_indices ceil "
    "ceil.out ceil_ clone col_indices conj_physical.out conj_physical_ copy_ crow_indices deg2rad "
    "deg2rad.out deg2rad_ dense_dim empty.memory_format empty_like erf erf.out erf_ erfinv erfinv.out "
    "erfinv_ expm1 expm1.out expm1_ fill_.Scalar floor floor.out floor_ frac frac.out frac_ isinf isnan "
    "isneginf isneginf.out isposinf isposinf.out log1p log1p.out log1p_ mm mm.out mul.Scalar mul.Tensor "
    "mul.out mul_.Scalar mul_.Tensor neg neg.out neg_ normal_ rad2deg rad2deg.out rad2deg_ relu relu_ "
    "resize_ resize_as_sparse_ round round.out round_ row_indices select.int select_copy.int "
    "sgn sgn.out sgn_ sign sign.out sign_ signbit signbit.out sin sin.out sin_ sinh sinh.out sinh_ sparse_dim "
    "sparse_mask sqrt sqrt.out sqrt_ sum sum.dim_IntList tan tan.out tan_ tanh tanh.out tanh_ "
    "threshold_backward threshold_backward.grad_input trunc trunc.out trunc_ values zero_").split())
#: dense-to-sparse conversions whose ``CPU`` kernel is also the ``CUDA`` one (``dense_to_sparse``…)
DENSE_TO_SPARSE = frozenset(("_to_sparse _to_sparse.sparse_dim _to_sparse_csr _to_sparse_csc "
                             "_to_sparse_bsr _to_sparse_bsc").split())

#: the sparse layouts (a tensor of one owns no storage but its components')
LAYOUTS = frozenset({torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc})

THRUST_NOTE = ("Thrust temporary storage in sparse coalesce (SparseCUDATensor.cu _coalesce_sparse_cuda: "
               "sort_by_key and unique_by_key through at::cuda::ThrustAllocator, sized by Thrust's tuning "
               "for the GPU architecture), freed within the call")
SPMM_NOTE = ("cuSPARSE SpMM external buffers (sparse @ dense: SparseCUDABlas.cpp _csrmm2 for COO, "
             "SparseBlasImpl.cpp spmm for CSR, allocate cusparseSpMM_bufferSize bytes, a size cuSPARSE "
             "reports at run time), freed within the call")


def sparse_message(what: str, layout: Any = None) -> str:
    """The one-line stop for a sparse op on the simulated GPU that is not modelled."""
    kind = f"sparse ({str(layout).replace('torch.', '')})" if layout is not None else "sparse"
    return (f"vram run: {what} on a {kind} tensor on the simulated GPU is not modelled (CUDA runs a "
            "kernel of its own whose buffers are not known here); keep this op's sparse tensors on the "
            "CPU or use dense ones")


#: what the engine knows of a tensor's values (None: unknown), and how a model tells it what a CUDA
#: kernel wrote into one (None: unknown)
ValueOf = Callable[[torch.Tensor], "torch.Tensor | None"]
Written = Callable[[torch.Tensor, "torch.Tensor | None"], None]


def flatten_indices(indices: torch.Tensor, sizes: list[int], force_clone: bool,
                    values: tuple[ValueOf, Written] | None = None) -> torch.Tensor:
    """``at::sparse::flatten_indices`` (SparseTensorUtils.cpp): one sparse dim: a squeeze (a
    contiguous clone with `force_clone`); no entries: ``zeros(nnz)``; else CUDA's
    ``flatten_indices_cuda_kernel`` (FlattenIndicesCommon.h ``_flatten_indices_impl``): its output
    is ``arange(nnz)`` (int64), overwritten with each entry's row-major offset. The hash
    coefficients live in the kernel's arguments up to ``max_sparse_dims`` (8) sparse dims, else in a
    device copy (``TensorGeometryHolder``), made first and freed on return."""
    sparse_dim, nnz = indices.size(0), indices.size(1)
    if sparse_dim == 1:
        row = indices.squeeze(0)
        return row.clone(memory_format=torch.contiguous_format) if force_clone else row
    if indices.numel() == 0:
        return torch.zeros(nnz, dtype=torch.long, device=indices.device)
    coeffs = None
    if sparse_dim > 8:
        coeffs = torch.empty(sparse_dim, dtype=torch.long, device=indices.device)
    flat = torch.arange(nnz, dtype=torch.long, device=indices.device)
    del coeffs
    if values is not None:  # the offsets the kernel writes, from the indices' known values
        host = values[0](indices)
        strides = torch.tensor([math.prod(sizes[d + 1:sparse_dim]) for d in range(sparse_dim)], dtype=torch.long)
        values[1](flat, None if host is None else (host.long() * strides[:, None]).sum(0))
    return flat


def coalesce(self: torch.Tensor, new_nnz: int, note: Callable[[str], None]) -> torch.Tensor:
    """``_coalesce_sparse_cuda``: fewer than two entries: a clone marked coalesced; else the
    flattened indices (a clone, `flatten_indices`), ``origIndices`` and ``uniqueOffsets`` (int64,
    nnz each), Thrust's sort and unique (`THRUST_NOTE`), the flattened indices shrunk in place to
    `new_nnz`, ``newValues`` (``[new_nnz, *dense]``), a contiguous copy of the values when they
    are not contiguous and ``newValues`` is not empty, then ``newIndices`` (``[sparse_dim,
    new_nnz]``, unless one sparse dim, where it is the flattened indices), filled in place."""
    nnz = self._nnz()
    if nnz < 2:
        dst = self.clone()
        dst._coalesced_(True)
        return dst
    values = self._values()
    sparse_dim = self.sparse_dim()
    indices = self._indices()
    flat = flatten_indices(indices, list(self.shape), True)
    orig = torch.empty(nnz, dtype=indices.dtype, device=indices.device)
    unique_offsets = torch.empty(nnz, dtype=indices.dtype, device=indices.device)
    note(THRUST_NOTE)
    flat.resize_(1, new_nnz)
    new_values = torch.empty((new_nnz, *values.shape[1:]), dtype=values.dtype, device=values.device)
    if new_values.numel() > 0:
        values = values.contiguous()
    if sparse_dim == 1:
        new_indices = flat
    else:
        new_indices = torch.empty((sparse_dim, new_nnz), dtype=orig.dtype, device=orig.device)
    del orig, unique_offsets
    return torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors(
        sparse_dim, self.dense_dim(), list(self.shape), new_indices, new_values, dtype=new_values.dtype,
        layout=torch.sparse_coo, device=new_values.device, is_coalesced=True)


def addmm(t: torch.Tensor, sparse_: torch.Tensor, dense: torch.Tensor, beta: Any, alpha: Any,
          note: Callable[[str], None], out: torch.Tensor | None = None) -> torch.Tensor:
    """``addmm_sparse_dense_cuda`` / ``addmm_out_sparse_dense_cuda`` (SparseCUDATensorMath.cu):
    ``self`` expanded to ``[m, n]`` (a view), the result ``empty({0})`` resized to ``[m, n]``
    (or `out`), ``sparse_.coalesce()``; no entries: ``mul_out(r, t, scalar_tensor(beta))`` (a 0-dim
    device tensor); else `_addmm_worker`."""
    m, n = sparse_.size(0), dense.size(1)
    t = t.expand(m, n)
    r = torch.empty(0, dtype=t.dtype, device=t.device) if out is None else out
    r.resize_(m, n)
    sparse = sparse_.coalesce()
    if sparse._nnz() == 0:
        torch.mul(t, torch.scalar_tensor(beta, dtype=r.dtype, device=r.device), out=r)
        return r
    _addmm_worker(r, t, sparse, dense, beta, note)
    return r


def _addmm_worker(r: torch.Tensor, t: torch.Tensor, sparse: torch.Tensor, dense: torch.Tensor, beta: Any,
                  note: Callable[[str], None]) -> None:
    """``s_addmm_out_sparse_dense_cuda_worker`` then ``s_addmm_out_csr_sparse_dense_cuda_worker``:
    ``_to_csr_int`` (the row pointers ``empty(m + 1)`` int32, the rows as int32 ``empty(nnz)``,
    copied, ``cusparseXcoo2csr``; the int32 rows die on return), the columns as int32
    ``empty(nnz)``, copied; ``r`` zeroed (beta 0) or copied from ``t``; a column-major clone of
    ``r`` unless it is column-major already; ``dense`` as is when column- or row-major, else a
    contiguous copy; cuSPARSE's SpMM (`SPMM_NOTE`); the result copied back into ``r``."""
    m = sparse.size(0)
    indices, nnz = sparse._indices(), sparse._nnz()
    rows, cols = indices.select(0, 0), indices.select(0, 1)
    crow = torch.empty(m + 1, dtype=torch.int32, device=indices.device)
    rows_int = torch.empty(rows.size(0), dtype=torch.int32, device=indices.device)
    rows_int.copy_(rows)
    del rows_int
    col = torch.empty(cols.size(0), dtype=torch.int32, device=indices.device)
    col.copy_(cols)
    values = sparse._values()
    if values.dtype not in _CSRMM2_TYPES:  # AT_DISPATCH_FLOATING_AND_COMPLEX_TYPES (SparseBlasLegacy.cpp)
        del col, crow
        name = _SCALAR_NAMES.get(values.dtype, values.dtype)
        raise RuntimeError(f'"addmm_sparse_cuda" not implemented for \'{name}\'')
    if beta == 0:
        r.zero_()
    elif not same_tensor(t, r):
        r.copy_(t)
    if r.stride(0) == 1 and r.stride(1) == r.size(0):
        r_col = r
    else:
        r_col = r.transpose(0, 1).clone(memory_format=torch.contiguous_format).transpose_(0, 1)
    if (dense.stride(0) == 1 and dense.stride(1) == dense.size(0)) or (
            dense.stride(1) == 1 and dense.stride(0) == dense.size(1)):
        dense_ = dense
    else:
        dense_ = dense.contiguous()
    if nnz and dense_.numel() and r_col.numel():  # _csrmm2 returns early on null pointers
        note(SPMM_NOTE)
    if not same_tensor(r_col, r):
        r.copy_(r_col)
    del dense_, r_col, col, crow


#: the value types ``s_addmm_out_csr_sparse_dense_cuda_worker`` dispatches on, and c10's names of others
_CSRMM2_TYPES = frozenset({torch.float32, torch.float64, torch.complex64, torch.complex128})
_SCALAR_NAMES = {torch.float16: "Half", torch.bfloat16: "BFloat16", torch.int64: "Long", torch.int32: "Int",
                 torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte", torch.bool: "Bool"}


def _blas_row_major(t: torch.Tensor) -> bool:
    """``is_blas_compatible_row_major_order`` (LinearAlgebraUtils.h), for a matrix."""
    return t.stride(1) == 1 and t.stride(0) >= max(1, t.size(1))


def _blas_column_major(t: torch.Tensor) -> bool:
    """``is_blas_compatible_column_major_order`` (LinearAlgebraUtils.h), for a matrix."""
    return t.stride(0) == 1 and t.stride(1) >= max(1, t.size(0))


def addmm_compressed(out: torch.Tensor, t: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, beta: Any,
                     alpha: Any, note: Callable[[str], None]) -> torch.Tensor:
    """``addmm_out_sparse_compressed_cuda`` (sparse/cuda/SparseBlas.cpp) for a CSR or BSR ``mat1``
    and strided ``mat2`` and ``out``: ``self`` expanded to [m, n], ``out`` resized (a new storage
    when it grows) and copied from it; no entries: zeroed (beta 0) or scaled; else
    ``addmm_out_sparse_csr`` (SparseBlasImpl.cpp): BSR with blocks over 1: `_block_sparse_mm`; CSR:
    ``spmm``: ``out`` and ``mat2`` as they are when BLAS-compatible in row- or column-major order,
    else contiguous clones (``prepare_dense_matrix_for_cusparse``), cuSPARSE's SpMM (`SPMM_NOTE`),
    the clone of ``out`` copied back; the clones die on return."""
    m, n = mat1.size(0), mat2.size(1)
    if out is not t:
        out.resize_(m, n)
        out.copy_(t.expand(m, n))
    if out.numel() == 0:
        return out
    if mat1._nnz() == 0:
        return out.zero_() if beta == 0 else out.mul_(beta)
    values = mat1.values()
    if values.dim() == 3 and values.size(-1) > 1:
        _block_sparse_mm(out, mat1, mat2)
        return out
    out_ = out if _blas_row_major(out) or _blas_column_major(out) else out.clone(memory_format=torch.contiguous_format)
    mat2_ = mat2 if _blas_row_major(mat2) or _blas_column_major(mat2) else mat2.clone(
        memory_format=torch.contiguous_format)
    note(SPMM_NOTE)
    if out_ is not out:
        out.copy_(out_)
    del out_, mat2_
    return out


def _block_sparse_mm(out: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor) -> None:
    """``block_sparse_mm`` (SparseBlasImpl.cpp): ``mat2`` as it is or a contiguous clone, ``out``
    as it is when column-major or a column-major clone (``cloneBatchedColumnMajor``), the row
    pointers and columns as int32 (``.to(kInt)``: copies unless already int32) for ``bsrmm``, which
    takes no buffer; the int32 copies die, the clone is copied back, then the clones die."""
    mat2_ = mat2 if _blas_row_major(mat2) or _blas_column_major(mat2) else mat2.clone(
        memory_format=torch.contiguous_format)
    out_ = out if _blas_column_major(out) else out.mT.clone(memory_format=torch.contiguous_format).transpose_(-2, -1)
    crow = mat1.crow_indices().to(torch.int32)
    col = mat1.col_indices().to(torch.int32)
    del col, crow
    if out_ is not out:
        out.copy_(out_)
    del out_, mat2_


def flip_compressed(self: torch.Tensor, values: tuple[ValueOf, Written]) -> torch.Tensor:
    """``sparse_compressed_to_flipped`` (TensorConversions.cpp) for a 2-D CSR or CSC tensor (its
    transpose's layout; autograd's ``t()`` of a CSR matrix is CSC): the batch offsets
    (``at::tensor({nnz})`` on the GPU, its ``cumsum``, the first dying), the compressed indices
    plus offsets (a copy) written into ``empty(n + 1)``, the COO indices
    (``_convert_indices_from_csr_to_coo``, transposed), the batch of each entry (``div``) and its
    scaled copy (``b * size``, dying at once), their hashes (`flatten_indices`), ``sort``'s indices
    (its values die at once), the COO indices and the values ``index_select``-ed by them, the new
    compressed indices (``_convert_indices_from_coo_to_csr``) spread by
    ``compressed_to_batched_compressed_indices`` (``zeros`` and a difference, dying at once); the
    plain indices stay a view of the sorted COO indices."""
    csc = self.layout == torch.sparse_csc
    compressed, plain = (self.ccol_indices(), self.row_indices()) if csc else (self.crow_indices(), self.col_indices())
    compressed, plain, vals = compressed.unsqueeze(0), plain.unsqueeze(0), self.values().unsqueeze(0)
    nnz, (rows, cols), dev = plain.size(-1), self.shape, compressed.device
    wrapped = torch.tensor([nnz], dtype=compressed.dtype, device=dev)
    offset = wrapped.expand(1).cumsum(-1).sub_(wrapped).reshape(1)
    del wrapped
    offsets_2d = compressed[..., :-1].add(offset.unsqueeze(-1).expand_as(compressed[..., :-1])).reshape(-1)
    compressed_2d = torch.empty(offsets_2d.numel() + 1, dtype=compressed.dtype, device=dev)
    compressed_2d[:-1].copy_(offsets_2d)
    compressed_2d[-1:].fill_(nnz)
    host = values[0](offsets_2d)  # written whole, in two pieces
    values[1](compressed_2d, None if host is None else torch.cat([host, host.new_tensor([nnz])]))
    del offsets_2d
    int32 = compressed.dtype == torch.int32
    coo = torch._convert_indices_from_csr_to_coo(compressed_2d, plain.flatten(0, 1), out_int32=int32, transpose=True)
    i, j = coo.select(0, 1), coo.select(0, 0)
    b = i.div(cols if csc else rows, rounding_mode="trunc")
    i.fmod_(cols if csc else rows)
    j.add_(b * (rows if csc else cols))
    del b, i, j
    hashed = flatten_indices(coo, [rows, cols] if csc else [cols, rows], False, values)
    argsort = hashed.sort()[1]
    sorted_coo = coo.index_select(1, argsort)
    new_values = vals.flatten(0, 1).index_select(0, argsort)
    size = rows if csc else cols
    csr_of = torch._convert_indices_from_coo_to_csr(sorted_coo.select(0, 0), size, out_int32=int32)
    batched = torch.zeros(1, size + 1, dtype=csr_of.dtype, device=dev)
    if size > 0:
        batched.narrow(-1, 1, size).copy_(csr_of[1:].reshape(1, -1) - csr_of[0:-1:size].reshape(1, -1))
    del csr_of
    out = torch.ops.aten._sparse_compressed_tensor_unsafe(
        batched.squeeze(0), sorted_coo.select(0, 1), new_values, list(self.shape), dtype=new_values.dtype,
        layout=torch.sparse_csr if csc else torch.sparse_csc, device=dev)
    del argsort, hashed, coo, compressed_2d, offset  # the locals that die on return, in C++'s reverse order
    return out


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``at::sparse::is_same_tensor``: the same impl, or the same data, sizes and strides."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride())


def sparse_layout(tensors: list[object]) -> bool:
    """Whether an op's meta outputs include a sparse tensor (an op with no sparse kernel here that
    made one on meta: stopped with `sparse_message`)."""
    return any(isinstance(t, torch.Tensor) and t.layout != torch.strided for t in tensors)


_SPARSE_BACKEND = re.compile(r"with arguments from the '(Sparse\w*)' backend")


def sparse_refusal(error: BaseException, what: str) -> str | None:
    """The one-line stop for PyTorch's own "could not run … with arguments from the 'Sparse…'
    backend" on a simulated sparse tensor (None when `error` is another one)."""
    m = _SPARSE_BACKEND.search(str(error))
    if m is None or m.group(1) in ("SparseCPU", "SparseCsrCPU"):
        return None
    return sparse_message(what)
