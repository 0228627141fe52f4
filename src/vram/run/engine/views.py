"""Views and copies of the PrivateUse1 engine that PyTorch's CPU kernels cannot make as they are:
views that change the element type, and copies of tensors carrying a conjugate or negative bit.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_CPU = torch._C.DispatchKey.CPU
_AS_STRIDED = torch.ops.aten.as_strided.default
_VIEW_DTYPE = torch.ops.aten.view.dtype  # a CompositeExplicitAutograd kernel only (none for CPU)
_EXPLICIT = torch._C.DispatchKey.CompositeExplicitAutograd
#: ``_fast.cpp``'s ``view_of`` once the engine has built it (`vram.run.engine.privateuse1.register`)
COMPILED: list[Any] = [None]


def view_of(src: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """`view_of_reference`, made by its compiled form where that is in use and can read both."""
    compiled = COMPILED[0]
    if compiled is not None:
        view = compiled(src, meta)
        if view is not NotImplemented:
            return view  # type: ignore[no-any-return]
    return view_of_reference(src, meta)


def view_of_reference(src: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """A view of `src`'s storage with `meta`'s geometry and dtype. A view that changes the element
    type (``view_as_real``, ``view_as_complex``, ``view(dtype)``) goes through the whole storage
    seen as bytes, then the new dtype: ``as_strided`` alone keeps `src`'s element size."""
    if meta.dtype != src.dtype:
        nbytes = src.untyped_storage().nbytes()
        flat = _AS_STRIDED._op_dk(_CPU, src, (nbytes // src.element_size(),), (1,), 0)
        whole = nbytes // meta.element_size() * meta.element_size()
        as_bytes = _AS_STRIDED._op_dk(_CPU, _VIEW_DTYPE._op_dk(_EXPLICIT, flat, torch.uint8), (whole,), (1,), 0)
        src = _VIEW_DTYPE._op_dk(_EXPLICIT, as_bytes, meta.dtype)
    return _AS_STRIDED._op_dk(_CPU, src, meta.shape, meta.stride(), meta.storage_offset())


def math_bit_copies(fallback: Callable[..., Any]) -> Any:
    """``_copy_from`` kernels at the Conjugate and Negative keys. ``copy_impl`` sends a copy that
    involves a backend other than CPU/CUDA to ``_copy_from``, whose ``MathOpFallback`` resolves the
    bit with ``clone``, whose ``copy_`` comes back to ``_copy_from`` with the bit still set: an
    endless recursion (a segfault). These copy between bit-free aliases, then apply the bit's
    operation to the destination in place (through the engine's `fallback`, on meta) when the two
    bits differ, as CUDA's copy kernel does."""

    def copy(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool, conj: bool) -> torch.Tensor:
        def clear(t: torch.Tensor) -> torch.Tensor:
            if conj:
                return t.conj() if t.is_conj() else t
            return t._neg_view() if t.is_neg() else t

        flip = (src.is_conj() != dst.is_conj()) if conj else (src.is_neg() != dst.is_neg())
        plain = clear(dst)
        torch.ops.aten._copy_from.default(clear(src), plain, non_blocking)
        if flip:
            fallback(torch.ops.aten.conj_physical_.default if conj else torch.ops.aten.neg_.default, plain)
        return dst

    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901
    lib.impl("_copy_from", lambda src, dst, non_blocking=False: copy(src, dst, non_blocking, True), "Conjugate")
    lib.impl("_copy_from", lambda src, dst, non_blocking=False: copy(src, dst, non_blocking, False), "Negative")
    return lib
