"""Sparse COO kernels CUDA has of its own beyond coalesce and matmul (layer 4; needs torch): what
each allocates, in order, step by step in the ATen ops it calls (see `vram.run.kernels.sparse`).

* ``add`` of a dense and a sparse tensor (`add_dense_sparse`; ``add_out_dense_sparse_cuda``), which
  ``to_dense`` reaches, and of two sparse tensors (`add_sparse_sparse`; ``add_out_sparse_cuda``),
  autograd's sum of sparse gradients.
* ``index_select`` (`index_select`; ``index_select_sparse_cuda``).
* ``sparse_mask`` of a sparse tensor (`sparse_mask_sparse`; the intersection kernel), the gradient
  of a sparse tensor's values.
* ``torch.sparse.sum``'s backward (`sparse_sum_backward`; ``_sparse_sum_backward_cuda``,
  SparseCUDATensorMath.cu).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .sparse import flatten_indices, same_tensor


def add_dense_sparse(out: torch.Tensor, dense: torch.Tensor, sparse: torch.Tensor, alpha: Any) -> torch.Tensor:
    """``add_out_dense_sparse_cuda`` (SparseCUDATensorMath.cu), ``out = dense + alpha * sparse``
    (``sparse_to_dense``: ``zeros(sizes).add_(self)``): no entries: ``out`` resized and copied
    from ``dense``; else the result in the common dtype (``out`` itself, or ``empty_like(dense)``),
    ``dense`` and the values cast to it (copies only when the dtype changes), ``dense`` copied into
    the result unless it is the same tensor; coalesced: values made contiguous when they have dense
    dims, one kernel; uncoalesced: the flattened indices (`flatten_indices`), the values reshaped to
    ``[nnz, columns]`` (a copy when that is not a view), ``index_add_``; the result copied into ``out``."""
    if sparse._nnz() == 0:
        out.resize_as_(dense)
        return out.copy_(dense)
    common = torch.result_type(dense, sparse)
    r = out if out.dtype == common else torch.empty_like(dense, dtype=common)
    dense_buffer = dense.to(common)
    values = sparse._values().to(common)
    if not same_tensor(r, dense_buffer):
        r.resize_as_(dense)
        r.copy_(dense_buffer)
    if values.numel() == 0:
        return out
    if sparse.is_coalesced():
        if sparse.dense_dim() > 0:
            values = values.contiguous()
    else:
        sparse_dim = sparse.sparse_dim()
        flat = flatten_indices(sparse._indices(), list(sparse.shape), False)
        rows = math.prod(r.shape[:sparse_dim])
        columns = math.prod(r.shape[sparse_dim:])
        r.view(rows, columns).index_add_(0, flat, values.reshape(sparse._nnz(), columns), alpha=alpha)
    if r is not out:
        out.copy_(r)
    return out


def index_select(self: torch.Tensor, dim: int, index: torch.Tensor, host: tuple[torch.Tensor, torch.Tensor] | None,
                 written: Callable[[torch.Tensor, torch.Tensor | None], None]) -> torch.Tensor:
    """``index_select_sparse_cuda`` (sparse/cuda/SparseCUDATensorMath.cu). A dense dim: the values'
    ``index_select``, the indices shared. A sparse dim: ``nneg_index`` (``empty_like(index)``), the
    dim's indices made contiguous, ``arange(len(index))``, ``arange(nnz)``, a ``sort`` of the dim's
    indices (not for dim 0 of a coalesced tensor), ``zeros_like(nneg_index)`` twice (match counts,
    first matches), their ``sum`` (read on the host: the result's entry count), then
    ``empty(res_len)`` twice (result rows, selected entries), the counts' ``cumsum`` less the
    counts, a one-element dummy output; the result's indices and values are ``index_select``s of
    the input's, its row written in place. `host`: the CPU values of ``nneg_index`` and of the
    counts (None: unknown, when the run cannot know the entry count); `written` tells the engine
    what a CUDA kernel wrote into a tensor (None: unknown)."""
    dim = dim % self.dim()
    sparse_dim, dense_dim = self.sparse_dim(), self.dense_dim()
    indices, values = self._indices(), self._values()
    sizes = list(self.shape)
    sizes[dim] = index.size(0)

    def make_output(selected: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        res_indices = indices.index_select(1, selected)
        res_indices[dim] = rows
        res_values = values.index_select(0, selected)
        return torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors(
            sparse_dim, dense_dim, sizes, res_indices, res_values, dtype=values.dtype, layout=torch.sparse_coo,
            device=values.device)
    if dim >= sparse_dim:
        res_values = values.index_select(dim - sparse_dim + 1, index)
        return torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors(
            sparse_dim, dense_dim, sizes, indices, res_values, dtype=values.dtype, layout=torch.sparse_coo,
            device=values.device)
    if index.size(0) == 0:
        return make_output(index, index)
    assert host is not None
    nneg_index = torch.empty_like(index, memory_format=torch.contiguous_format)
    written(nneg_index, host[0])
    dim_indices = indices[dim].contiguous()
    idx_nneg = torch.arange(index.size(0), dtype=index.dtype, device=index.device)
    idx_dim = torch.arange(values.size(0), dtype=dim_indices.dtype, device=dim_indices.device)
    ordered, argsort = (dim_indices, idx_dim) if dim == 0 and self.is_coalesced() else dim_indices.sort()
    counts, first = torch.zeros_like(nneg_index), torch.zeros_like(nneg_index)
    written(counts, host[1])
    written(first, None)
    total = counts.sum()  # read on the host (``.item()``): a 0-dim device tensor, dying at once
    del total
    res_len = int(host[1].sum())
    if res_len == 0:
        rows = torch.empty(0, dtype=nneg_index.dtype, device=nneg_index.device)
        out = make_output(rows, rows)
    else:
        rows = torch.empty(res_len, dtype=nneg_index.dtype, device=nneg_index.device)
        selected = torch.empty_like(rows)
        offsets = counts.cumsum(0).sub_(counts)
        dummy = torch.empty(1, dtype=dim_indices.dtype, device=dim_indices.device)
        written(rows, None)
        written(selected, None)
        del dummy, offsets  # the lambda's locals, in C++'s reverse order
        out = make_output(selected, rows)
        del selected
    # the block's locals die in reverse order of construction once the result is made
    del rows, first, counts, argsort, ordered, idx_dim, idx_nneg, dim_indices, nneg_index
    return out


def sparse_mask_sparse(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sparse_mask`` of a sparse ``t`` (SparseTensor.cpp: both with entries; the autograd formula
    of a sparse tensor's values) on CUDA: ``sparse_mask_like_prepare_sparse_inputs`` (an
    uncoalesced ``t`` sorted by its flattened indices: their ``sort``, whose values die at once,
    the indices, values and hashes ``index_select``-ed by it) then
    ``sparse_mask_intersection_out_cuda_kernel`` (SparseBinaryOpIntersectionCommon.h
    ``_sparse_binary_op_intersection_kernel_impl``, where the prepared ``t`` is the coalesced side
    and the mask the searched one): ``arange(max(nnz))``, ``t``'s hashes (``empty(nnz)`` unless
    prepared), the intersection buffer ``empty({2, mask nnz})``, a one-element dummy (dies at
    once), the mask's indices cloned, the result values ``empty`` (the values cast to a common
    dtype first when they differ); the buffer, hashes and arange die on return."""
    def by(order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return t._indices().index_select(1, order), t._values().index_select(0, order)
    if t.is_coalesced():
        lhs_indices, lhs_values, lhs_hash = t._indices(), t._values(), None
    else:
        flat = flatten_indices(t._indices(), list(t.shape), False)
        argsort = flat.sort(0)[1]
        lhs_indices, lhs_values = by(argsort)
        lhs_hash = flat.index_select(0, argsort)
        del flat, argsort
    pc_nnz, src_nnz = lhs_values.size(0), mask._nnz()
    device = mask._indices().device
    nnz_arange = torch.arange(max(pc_nnz, src_nnz), dtype=torch.long, device=device)
    pc_hash = lhs_hash.contiguous() if lhs_hash is not None else torch.empty(pc_nnz, dtype=torch.long, device=device)
    buffer = torch.empty(2, src_nnz, dtype=torch.long, device=device)
    dummy = torch.empty(1, dtype=torch.long, device=device)
    del dummy
    res_indices = mask._indices().clone()
    common = torch.result_type(mask._values(), lhs_values)
    src_values, pc_values = mask._values().to(common), lhs_values.to(common)
    res_values = torch.empty((src_nnz, *torch.broadcast_shapes(src_values.shape[1:], pc_values.shape[1:])),
                             dtype=common, device=device).to(t.dtype)
    del src_values, pc_values, buffer, pc_hash, nnz_arange
    return torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors(
        mask.sparse_dim(), mask.dense_dim(), list(mask.shape), res_indices, res_values, dtype=t.dtype,
        layout=torch.sparse_coo, device=device, is_coalesced=mask.is_coalesced())


def add_sparse_sparse(out: torch.Tensor, t: torch.Tensor, src: torch.Tensor, alpha: Any) -> torch.Tensor:
    """``add_out_sparse_cuda`` (SparseCUDATensorMath.cu) of two sparse tensors, as autograd sums
    two sparse gradients: no entries in ``src``: ``copy_sparse_to_sparse_(out, t)``; none in ``t``:
    ``out = src * alpha``; else the values cast to the common dtype (copies only when it differs),
    ``src``'s scaled by ``alpha`` unless it is 1, then the indices and values concatenated
    (``cat``) and set into ``out``, uncoalesced; when that leaves more entries than elements,
    ``out`` is coalesced and takes the coalesced components. The concatenations are written into
    ``out``'s own components (``cat(..., out=)``: one allocation of the same size each, as the
    tensors ``alias_into_sparse`` hands over)."""
    if src._nnz() == 0:
        return out.copy_(t)
    if t._nnz() == 0:
        return torch.mul(src, alpha, out=out)
    common = torch.result_type(t, src)
    t_values, s_values = t._values().to(common), src._values().to(common)
    if alpha != 1:
        s_values = s_values.mul(alpha)
    out.sparse_resize_(src.shape, src.sparse_dim(), src.dense_dim())
    torch.cat([t._indices(), src._indices()], 1, out=out._indices())
    torch.cat([t_values, s_values], 0, out=out._values())
    del t_values, s_values
    out._coalesced_(out._nnz() < 2)
    if out._nnz() > out.numel():
        c = out.coalesce()
        out._indices().set_(c._indices())
        out._values().set_(c._values())
        out._coalesced_(True)
    return out


def _flatten_by_dims(indices: torch.Tensor, sizes: list[int], dims: list[int]) -> torch.Tensor:
    """``flatten_indices_by_dims`` (SparseTensorUtils.cpp): ``zeros(nnz)``, then in place per dim."""
    flat = torch.zeros(indices.size(1), dtype=indices.dtype, device=indices.device)
    for d in dims:
        flat.mul_(sizes[d])
        flat.add_(indices.select(0, d))
    return flat


def sparse_sum_backward(grad_: torch.Tensor, input_: torch.Tensor, dims: list[int]) -> torch.Tensor:
    """``_sparse_sum_backward_cuda``: an empty gradient: ``zeros_like(input)``; else the input
    coalesced; every sparse dim summed: the (dense) gradient expanded over the entries and cloned,
    then the indices cloned; otherwise the sparse gradient coalesced, its values expanded and
    cloned when dense dims were summed, and when sparse dims were: ``empty_like(values)``, the
    gradient's and the input's indices flattened over the kept dims (`_flatten_by_dims`), the
    lower-bound positions (``empty_like``), then the indices cloned."""
    if ((grad_.layout != torch.strided) and grad_._nnz() == 0) or grad_.numel() == 0:
        return torch.zeros_like(input_)
    inp = input_.coalesce()
    ndim, sparse_dim = inp.dim(), inp.sparse_dim()
    summed = {d % ndim for d in dims}
    keep = [d for d in range(sparse_dim) if d not in summed]
    dense_summed = [d + 1 - sparse_dim for d in range(sparse_dim, ndim) if d in summed]
    indices, values = inp._indices(), inp._values()

    def make(grad_values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors(
            sparse_dim, inp.dense_dim(), list(inp.shape), indices.clone(memory_format=torch.contiguous_format),
            grad_values, dtype=dtype, layout=torch.sparse_coo, device=values.device)
    if not keep:
        g = grad_
        for d in dense_summed:
            g = g.unsqueeze(d - 1)
        g = g.expand(values.shape).clone(memory_format=torch.contiguous_format)
        return make(g, grad_.dtype)
    grad = grad_.coalesce()
    grad_values = grad._values()
    expand = grad_values
    if dense_summed:
        size = list(values.shape)
        if len(keep) < sparse_dim:
            size[0] = grad_values.size(0)
        for d in dense_summed:
            expand = expand.unsqueeze(d)
        expand = expand.expand(size).clone(memory_format=torch.contiguous_format)
    if len(keep) == sparse_dim:
        return make(expand, grad.dtype)
    out_values = torch.empty_like(values, dtype=grad_values.dtype, memory_format=torch.contiguous_format)
    grad_flat = _flatten_by_dims(grad._indices(), list(grad.shape), list(range(grad.sparse_dim())))
    input_flat = _flatten_by_dims(indices, list(inp.shape), keep)
    positions = torch.empty_like(input_flat, memory_format=torch.contiguous_format)
    del positions, input_flat, grad_flat
    return make(out_values, grad.dtype)
