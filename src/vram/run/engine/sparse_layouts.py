"""Sparse tensors on the simulated GPU: their dispatch keys' kernels (see `vram.run.kernels.sparse`).

A sparse tensor on PrivateUse1 dispatches to ``SparsePrivateUse1`` (COO) or
``SparseCsrPrivateUse1`` (CSR, CSC, BSR, BSC), where torch registers nothing. Here, for every
aten op with a ``SparseCPU``/``SparseCsrCPU`` kernel: where that kernel is CUDA's too (`SHARED_*`)
the ``SparseCPU`` one runs (a device-generic function of ATen ops on the components, which reach
the engine's fallback as dense ops); where CUDA has its own, the model in `vram.run.kernels.sparse`
or `vram.run.kernels.sparse_ops` runs (``_coalesce``; ``addmm`` of COO, CSR and BSR; CSR <-> CSC;
``add`` of dense and sparse and of two sparse tensors; ``mul`` with a dense or 0-dim operand;
``index_select``; ``sparse_mask`` of a sparse tensor; ``_sparse_sum_backward``), or the op stops
in one line; a boxed fallback at both keys stops every other op the same way. The dense
``_to_sparse*`` conversions run their CPU kernel, which is CUDA's. A shared kernel that reaches a
``DispatchStub`` with no PrivateUse1 kernel stops in one line too.

Values: a data-dependent entry count (``_coalesce``, ``index_select``) comes from the indices'
known values (a run that does not know them runs again with real values); what CUDA's own kernels
write is computed on the CPU when every input's values are known, else unknown.
"""
from __future__ import annotations

from typing import Any

import torch

from vram.run.kernels import sparse as _rules
from vram.run.kernels import sparse_ops as _ops
from vram.run.values import known
from vram.run.values.placeholders import value_error

_DK = torch._C.DispatchKey
#: stops a shared kernel can meet on PrivateUse1 (a stub or an op with no PrivateUse1 kernel)
_UNSUPPORTED = ("DispatchStub", "Could not run", "privateuse1", "PrivateUse1")


def _op(qualified: str) -> Any:
    name, _, overload = qualified.partition(".")
    return getattr(getattr(torch.ops.aten, name), overload or "default")


def _layout_of(args: Any) -> Any:
    for a in args:
        if isinstance(a, torch.Tensor) and a.layout != torch.strided:
            return a.layout
    return None


def _refuse(op: Any, args: Any) -> NotImplementedError:
    return NotImplementedError(_rules.sparse_message(f"aten::{op._schema.name.split('::')[-1]}", _layout_of(args)))


def _shared(op: Any, key: Any) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        try:
            with torch._C.DisableTorchFunction():
                return op._op_dk(key, *args, **kwargs)
        except (RuntimeError, NotImplementedError) as e:
            text = str(e)
            if text.startswith("vram") or not any(s in text for s in _UNSUPPORTED):
                raise
            raise _refuse(op, args) from None
    return kernel


def _refusing(op: Any) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise _refuse(op, args)
    return kernel


def _boxed_refusal(op: Any, *args: Any, **kwargs: Any) -> Any:
    raise _refuse(op, args)


def register(states: list[Any]) -> list[Any]:
    """Register the sparse kernels on PrivateUse1 (`module docstring`); `states` holds the running
    simulations, innermost last. Returns the libraries to keep alive."""
    def state() -> Any:
        if not states:
            raise RuntimeError("vram: a sparse vramsim tensor outside a simulated run")
        return states[-1]
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901
    models = {"_coalesce": _coalesce(state), "addmm": _addmm(state), "addmm.out": _addmm(state),
              "add.out": _add_out(state), "mul.out": _mul_out(), "index_select": _index_select(state),
              "sparse_mask": _sparse_mask(state), "_sparse_sum_backward": _sum_backward(state)}
    for key, cpu, shared in (("SparsePrivateUse1", _DK.SparseCPU, _rules.SHARED_COO),
                             ("SparseCsrPrivateUse1", _DK.SparseCsrCPU, _rules.SHARED_COMPRESSED)):
        for qualified in torch._C._dispatch_get_registrations_for_dispatch_key(cpu.name):
            if not qualified.startswith("aten::"):
                continue
            name = qualified[len("aten::"):]
            op = _op(name)
            if key == "SparsePrivateUse1" and name in models:
                kernel = models[name]
            elif key == "SparseCsrPrivateUse1" and name == "addmm.out":
                kernel = _addmm_compressed(state)
            elif key == "SparseCsrPrivateUse1" and name in ("_to_sparse_csr", "_to_sparse_csc"):
                kernel = _flip(state, op, cpu)
            elif name in shared:
                kernel = _shared(op, cpu)
            else:
                kernel = _refusing(op)
            lib.impl(name, kernel, key)
    for name in _rules.DENSE_TO_SPARSE:
        lib.impl(name, _shared(_op(name), _DK.CPU), "PrivateUse1")
    fallback = torch.library.Library("_", "IMPL")  # noqa: TOR901 - every other op on a sparse tensor
    fallback.fallback(_boxed_refusal, "SparsePrivateUse1")
    fallback.fallback(_boxed_refusal, "SparseCsrPrivateUse1")
    return [lib, fallback]


def _note(sim: Any) -> Any:
    def note(text: str) -> None:
        sim.uncharged[text] = sim.uncharged.get(text, 0) + 1
    return note


def cpu_sparse(sim: Any, s: torch.Tensor) -> torch.Tensor | None:
    """A simulated COO tensor's CPU copy from its components' known values (None when unknown)."""
    with torch._C.DisableTorchFunction():
        indices, values = s._indices(), s._values()
        i, v = known.cpu_value(sim, indices), known.cpu_value(sim, values)
        if i is None or v is None:
            return None
        return torch.sparse_coo_tensor(i.clone(), v.clone(), s.shape, is_coalesced=s.is_coalesced())


def _coalesce(state: Any) -> Any:
    def kernel(self: torch.Tensor) -> torch.Tensor:
        sim = state()
        with torch._C.DisableTorchFunction():
            indices = self._indices()
            host = known.cpu_value(sim, indices)
            if host is None:
                raise value_error("torch.Tensor.coalesce()", "the number of distinct indices of a sparse tensor")
            flat = torch.sparse_coo_tensor(host, torch.zeros(host.size(1), dtype=torch.int8), self.shape)
            new_nnz = flat.coalesce()._nnz()
            out = _rules.coalesce(self, new_nnz, _note(sim))
            _define_coalesced(sim, self, out)
            return out
    return kernel


def _define_coalesced(sim: Any, self: torch.Tensor, out: torch.Tensor) -> None:
    host = cpu_sparse(sim, self)
    indices, values = out._indices(), out._values()
    if host is None:
        host_i = known.cpu_value(sim, self._indices())
        assert host_i is not None
        host = torch.sparse_coo_tensor(host_i, torch.zeros(host_i.size(1), dtype=torch.int8), self.shape)
        known.define(sim, indices, host.coalesce()._indices(), known.assumed(sim, self._indices()))
        _forget(sim, values)
        return
    c = host.coalesce()
    assumed = known.assumed(sim, self._indices()) or known.assumed(sim, self._values())
    known.define(sim, indices, c._indices(), assumed)
    known.define(sim, values, c._values(), assumed)


def _forget(sim: Any, t: torch.Tensor) -> None:
    b = sim.block_of(t)
    if b is not None:
        b.forget()


def _add_out(state: Any) -> Any:
    """``add_out_sparse_cuda``: dense + sparse modelled (`vram.run.kernels.sparse_ops.add_dense_sparse`);
    sparse + sparse (concatenated indices and values, set into ``out``) stops in one line."""
    op = torch.ops.aten.add.out

    def kernel(self: torch.Tensor, other: torch.Tensor, *, alpha: Any = 1, out: torch.Tensor) -> torch.Tensor:
        sim = state()
        with torch._C.DisableTorchFunction():
            if self.layout == other.layout == out.layout == torch.sparse_coo and out.dtype == torch.result_type(
                    self, other):
                r = _ops.add_sparse_sparse(out, self, other, alpha)
                _define_sum(sim, self, other, alpha, r)
                return r
            if self.layout != torch.strided or other.layout != torch.sparse_coo or out.layout != torch.strided:
                raise _refuse(op, (self, other))
            host, dense = cpu_sparse(sim, other), known.cpu_value(sim, self)
            dense = None if dense is None else dense.clone()  # `out` may be `self`
            r = _ops.add_dense_sparse(out, self, other, alpha)
            if host is None or dense is None:
                _forget(sim, r)
            else:
                known.define(sim, r, torch.add(dense, host, alpha=alpha).to(r.dtype), known.assumed(sim, self))
            return r
    return kernel


def _define_sum(sim: Any, a: torch.Tensor, b: torch.Tensor, alpha: Any, r: torch.Tensor) -> None:
    """The values of a sparse sum (`vram.run.kernels.sparse_ops.add_sparse_sparse`): the inputs'
    indices and values concatenated as CUDA does (coalesced when it coalesces), else unknown."""
    ha, hb = cpu_sparse(sim, a), cpu_sparse(sim, b)
    if ha is None or hb is None:
        _forget(sim, r._indices())
        _forget(sim, r._values())
        return
    if hb._nnz() == 0 or ha._nnz() == 0 or r.is_coalesced():
        host = (ha + hb * alpha).coalesce() if r.is_coalesced() else (ha if hb._nnz() == 0 else hb * alpha)
    else:
        host = torch.sparse_coo_tensor(torch.cat([ha._indices(), hb._indices()], 1),
                                       torch.cat([ha._values(), hb._values() * alpha]), ha.shape)
    known.define(sim, r._indices(), host._indices(), False)
    known.define(sim, r._values(), host._values().to(r.dtype), False)


def _mul_out() -> Any:
    """``mul_out_sparse_cuda``: with a dense or 0-dim operand it calls the helpers CPU's kernel calls
    first (``_mul_dense_sparse_out``, ``_mul_sparse_sparse_zero_dim_out``: SparseTensorMath.cpp),
    so that kernel runs; sparse * sparse stops in one line."""
    op = torch.ops.aten.mul.out
    shared = _shared(op, _DK.SparseCPU)

    def kernel(self: torch.Tensor, other: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        if all(isinstance(t, torch.Tensor) and t.is_sparse and t.dim() for t in (self, other)):
            raise _refuse(op, (self, other))
        return shared(self, other, out=out)
    return kernel


def _sparse_mask(state: Any) -> Any:
    """``sparse_mask``: a sparse ``self`` with entries, under a mask with entries, as CUDA's
    intersection kernel runs it (`vram.run.kernels.sparse_ops.sparse_mask_sparse`); every other case
    runs the shared kernel (a dense ``self``: ``self.mul(mask_template)``)."""
    shared = _shared(torch.ops.aten.sparse_mask.default, _DK.SparseCPU)

    def kernel(self: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with torch._C.DisableTorchFunction():
            if not (self.is_sparse and mask.is_sparse and self._nnz() and mask._nnz() and mask.numel()) or \
                    self.shape != mask.shape or self is mask:
                return shared(self, mask)
            sim = state()
            out = _ops.sparse_mask_sparse(self, mask)
            host, host_mask = cpu_sparse(sim, self), cpu_sparse(sim, mask)
            if host is None or host_mask is None:
                _forget(sim, out._values())
            else:
                known.define(sim, out._values(), host.sparse_mask(host_mask)._values(), False)
            return out
    return kernel


def _sum_backward(state: Any) -> Any:
    """``_sparse_sum_backward`` (`vram.run.kernels.sparse_ops.sparse_sum_backward`); the gradient's
    values, written by CUDA's kernel, computed on the CPU when the inputs' values are known."""
    def kernel(grad: torch.Tensor, self: torch.Tensor, dim: list[int]) -> torch.Tensor:
        sim = state()
        with torch._C.DisableTorchFunction():
            out = _ops.sparse_sum_backward(grad, self, list(dim))
            if not out.is_sparse:
                return out
            host = cpu_sparse(sim, self)
            g = cpu_sparse(sim, grad) if grad.is_sparse else known.cpu_value(sim, grad)
            if host is None or g is None:
                _forget(sim, out._values())
            else:
                value = torch.ops.aten._sparse_sum_backward(g, host, list(dim))
                known.define(sim, out._values(), value.coalesce()._values(), False)
            return out
    return kernel


def _index_select(state: Any) -> Any:
    """``index_select_sparse_cuda`` (`vram.run.kernels.sparse_ops.index_select`); along a sparse dim the
    entry count comes from the index's and the indices' known values (a run that does not know them
    runs again with real values), and what CUDA's kernels write is computed on the CPU: for each
    index in turn, the matching entries in the sorted order of that dim's indices (a stable sort
    here; CUDA's sort may order equal indices otherwise, which changes no size)."""
    def kernel(self: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
        sim = state()
        with torch._C.DisableTorchFunction():
            d = dim % max(self.dim(), 1)
            host = known.cpu_value(sim, self._indices()) if d < self.sparse_dim() else None
            idx = known.cpu_value(sim, index) if d < self.sparse_dim() else None
            if d < self.sparse_dim() and index.numel() and (host is None or idx is None):
                raise value_error("Tensor.index_select()", "the entries a sparse tensor's index_select keeps")
            plan = None if host is None or idx is None else _selection(host[d], idx, self.size(d),
                                                                       d == 0 and self.is_coalesced())

            def written(t: torch.Tensor, value: torch.Tensor | None) -> None:
                if value is None:
                    _forget(sim, t)
                else:
                    known.define(sim, t, value, False)
            out = _ops.index_select(self, d, index, None if plan is None else plan[:2], written)
            if plan is not None:
                _define_selected(sim, self, out, d, plan)
            return out
    return kernel


def _selection(dim_indices: torch.Tensor, index: torch.Tensor, size: int, in_order: bool) -> tuple[Any, ...]:
    """On the CPU: the index made non-negative, each index's match count, the selected entries and
    the result row of each, in CUDA's order (`_index_select`)."""
    nneg = torch.where(index < 0, index + size, index)
    order = torch.arange(dim_indices.numel()) if in_order else torch.sort(dim_indices, stable=True)[1]
    ordered = dim_indices[order]
    lower = torch.searchsorted(ordered, nneg, right=False)
    upper = torch.searchsorted(ordered, nneg, right=True)
    counts = upper - lower
    starts = torch.repeat_interleave(lower - (counts.cumsum(0) - counts), counts)
    selected = order[starts + torch.arange(int(counts.sum()))]
    rows = torch.repeat_interleave(torch.arange(len(nneg)), counts)
    return nneg, counts, selected, rows


def _define_selected(sim: Any, self: torch.Tensor, out: torch.Tensor, dim: int, plan: tuple[Any, ...]) -> None:
    _, _, selected, rows = plan
    host_i = known.cpu_value(sim, self._indices())
    assert host_i is not None
    res_i = host_i[:, selected].clone()
    res_i[dim] = rows
    assumed = known.assumed(sim, self._indices())
    known.define(sim, out._indices(), res_i, assumed)
    host_v = known.cpu_value(sim, self._values())
    if host_v is None:
        _forget(sim, out._values())
    else:
        known.define(sim, out._values(), host_v[selected], assumed or known.assumed(sim, self._values()))


def _flip(state: Any, op: Any, cpu: Any) -> Any:
    """``_to_sparse_csr`` of a 2-D CSC tensor and ``_to_sparse_csc`` of a 2-D CSR one
    (`vram.run.kernels.sparse.flip_compressed`; the shared kernel's ``flatten_indices`` is a
    ``DispatchStub``); every other conversion runs the shared kernel or stops in one line."""
    shared = _shared(op, cpu)
    target = torch.sparse_csr if op._schema.name.endswith("csr") else torch.sparse_csc

    def kernel(self: torch.Tensor, dense_dim: Any = None) -> torch.Tensor:
        flips = {torch.sparse_csc: torch.sparse_csr, torch.sparse_csr: torch.sparse_csc}
        if flips.get(self.layout) != target or self.dim() != 2 or self.values().dim() != 1:
            return shared(self, dense_dim)
        sim = state()

        def written(t: torch.Tensor, value: torch.Tensor | None) -> None:
            if value is None:
                _forget(sim, t)
            else:
                known.define(sim, t, value, False)
        with torch._C.DisableTorchFunction():
            return _rules.flip_compressed(self, (lambda t: known.cpu_value(sim, t), written))
    return kernel


def _cpu_compressed(sim: Any, s: torch.Tensor) -> torch.Tensor | None:
    """A simulated CSR/BSR tensor's CPU copy from its components' known values (None when unknown)."""
    parts = [known.cpu_value(sim, p) for p in (s.crow_indices(), s.col_indices(), s.values())]
    if any(p is None for p in parts):
        return None
    crow, col, values = (p.clone() for p in parts)  # type: ignore[union-attr]
    return torch.sparse_compressed_tensor(crow, col, values, s.shape, layout=s.layout)


def _addmm_compressed(state: Any) -> Any:
    """``addmm.out`` with a CSR or BSR ``mat1`` and strided ``mat2`` and ``out``
    (`vram.run.kernels.sparse.addmm_compressed`); other layouts stop in one line."""
    op = torch.ops.aten.addmm.out

    def kernel(self: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *, beta: Any = 1, alpha: Any = 1,
               out: torch.Tensor) -> torch.Tensor:
        sim = state()
        with torch._C.DisableTorchFunction():
            if mat1.layout not in (torch.sparse_csr, torch.sparse_bsr) or mat1.dim() != 2 or torch.strided not in (
                    mat2.layout, out.layout, self.layout) or len({mat2.layout, out.layout, self.layout}) != 1:
                raise _refuse(op, (self, mat1, mat2))
            host, dense, base = _cpu_compressed(sim, mat1), known.cpu_value(sim, mat2), known.cpu_value(sim, self)
            base = None if base is None else base.clone()  # `out` may be `self`
            r = _rules.addmm_compressed(out, self, mat1, mat2, beta, alpha, _note(sim))
            if host is None or dense is None or base is None:
                _forget(sim, r)
            else:
                known.define(sim, r, torch.addmm(base, host, dense, beta=beta, alpha=alpha), False)
            return r
    return kernel


def _addmm(state: Any) -> Any:
    def kernel(self: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *, beta: Any = 1, alpha: Any = 1,
               **kwargs: Any) -> torch.Tensor:
        sim = state()
        with torch._C.DisableTorchFunction():
            if not mat1.is_sparse or mat2.layout != torch.strided or self.layout != torch.strided:
                raise _refuse(torch.ops.aten.addmm.default, (self, mat1, mat2))
            host = cpu_sparse(sim, mat1)
            dense, base = known.cpu_value(sim, mat2), known.cpu_value(sim, self)
            base = None if base is None else base.clone()  # `out` may be `self`
            r = _rules.addmm(self, mat1, mat2, beta, alpha, _note(sim), kwargs.get("out"))
            if host is None or dense is None or base is None:
                _forget(sim, r)
            else:
                known.define(sim, r, torch.addmm(base, host, dense, beta=beta, alpha=alpha), any(
                    known.assumed(sim, t) for t in (mat1._indices(), mat1._values(), mat2, self)))
            return r
    return kernel
