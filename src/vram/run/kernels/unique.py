"""``torch.unique`` / ``unique_consecutive`` on CUDA: their outputs' real storage and scratch (layer 4; needs torch).

``_unique2`` and ``unique_consecutive`` without ``dim`` run ``internal::unique_cuda_template``
(``aten/src/ATen/native/cuda/Unique.cu``, ``UniqueCub.cu``). Its outputs are allocated for the worst
case and shrunk with ``resize_``, which keeps the storage: ``data_out = at::empty({num_inp})`` and
``counts.resize_(num_inp)`` hold ``numel`` elements whatever the number of unique values
(`unique_outputs` gives the meta outputs that storage); a bool input that is not consecutive
reduces instead of sorting and makes ``output = empty({2})`` and ``counts = empty({2}, kLong)``
always. The scratch in order is `unique_plan`'s; cub's temporary storage is named
(`vram.run.kernels.sorting.cub_note`).

``unique(dim=...)`` / ``unique_consecutive(dim=...)`` run ``unique_dim_cuda_template`` (Unique.cu):
exact outputs, the scratch of `unique_dim_plan`; Thrust's own temporary storage (its sort with a
row comparator, scans, unique; ``at::cuda::ThrustAllocator`` through the caching allocator, sized
by Thrust's CUDA backend) is named (`THRUST_NOTE`).
"""
from __future__ import annotations

from typing import Any

import torch

from .scratch import _Plan
from .sorting import cub_note, once

UNIQUE_OPS = ("_unique2", "unique_consecutive")
THRUST_NOTE = ("Thrust temporary storage in unique(dim=...) (its row sort, scans and unique, allocated through "
               "at::cuda::ThrustAllocator and sized by Thrust's CUDA backend), freed within the call")


def _flags(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, bool, bool] | None:
    """(consecutive, return_inverse, return_counts), or None for a call this module does not model."""
    def arg(i: int, key: str) -> Any:
        return kwargs[key] if key in kwargs else (args[i] if len(args) > i else None)
    if name == "_unique2":
        return False, bool(arg(2, "return_inverse")), bool(arg(3, "return_counts"))
    if name == "unique_consecutive" and arg(3, "dim") is None:
        return True, bool(arg(1, "return_inverse")), bool(arg(2, "return_counts"))
    return None


def _with_storage(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """`t`'s shape over a meta storage of `nbytes` (what a shrinking ``resize_`` leaves)."""
    out = torch.empty((nbytes // t.element_size(),), dtype=t.dtype, device="meta")
    return out.resize_(t.shape)


def unique_outputs(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
    """The outputs with the storage CUDA gives them; other ops' `out` as it is. Along a dim, an
    inverse or counts not asked for are ``empty({0})`` (``compute_unique``; the CPU kernel, whose
    shapes the run computes, fills both)."""
    along = _dim_flags(name, args, kwargs)
    if along is not None and isinstance(out, tuple) and len(out) == 3:
        values, inverse, count = out
        return (values, inverse if along[2] else torch.empty((0,), dtype=torch.int64, device="meta"),
                count if along[3] else torch.empty((0,), dtype=torch.int64, device="meta"))
    flags = _flags(name, args, kwargs) if name in UNIQUE_OPS else None
    x = args[0] if args else None
    if flags is None or not isinstance(x, torch.Tensor) or not isinstance(out, tuple) or len(out) != 3 or not x.numel():
        return out
    consecutive, _inverse, counts = flags
    values, inverse, count = out
    if x.dtype == torch.bool and not consecutive:
        return _with_storage(values, 2), inverse, _with_storage(count, 16)
    values = _with_storage(values, x.numel() * x.element_size())
    if counts:
        count = _with_storage(count, x.numel() * 8)
    return values, inverse, count


def _dim_flags(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, bool, bool, bool] | None:
    """(dim, consecutive, return_inverse, return_counts) of a call along a dim, else None."""
    def arg(i: int, key: str) -> Any:
        return kwargs[key] if key in kwargs else (args[i] if len(args) > i else None)
    if name == "unique_dim":
        return int(arg(1, "dim")), False, bool(arg(3, "return_inverse")), bool(arg(4, "return_counts"))
    if name == "unique_dim_consecutive":
        return int(arg(1, "dim")), True, bool(arg(2, "return_inverse")), bool(arg(3, "return_counts"))
    if name == "unique_consecutive" and arg(3, "dim") is not None:
        return int(arg(3, "dim")), True, bool(arg(1, "return_inverse")), bool(arg(2, "return_counts"))
    return None


def unique_dim_plan(x: torch.Tensor, flags: tuple[int, bool, bool, bool]) -> list[tuple[str, Any]]:
    """``unique_dim_cuda_template``: an empty slice dim returns its three outputs; otherwise
    ``input_flat = self.moveaxis(dim, 0).contiguous()`` (a copy unless that is contiguous),
    ``indices = arange(num_inp)`` (int64), Thrust's sort of them unless consecutive;
    ``compute_unique``: with the inverse, ``inv_loc`` and the inverse output (``empty({num_inp})``
    int64 each; ``inv_loc`` dies with its block), else ``empty({0})``; with counts, ``range =
    arange(num_inp + 1)``, ``unique_by_key``, ``counts.resize_(num_out)`` (the output), ``range``
    dying with its block; without, Thrust's in-place unique; then ``self.index_select(dim,
    indices)`` (the values output); ``indices`` and ``input_flat`` die on return."""
    dim, consecutive, inverse, counts = flags
    dim %= max(x.dim(), 1)
    n = x.size(dim) if x.dim() else 1
    if n == 0 or x.numel() == 0:
        return [("out", 0), ("out", 1), ("out", 2)]
    p = _Plan()
    if not x.movedim(dim, 0).is_contiguous():
        p.tmp("input_flat", x.numel() * x.element_size())
    p.tmp("indices", n * 8)
    if not consecutive:
        p.steps.append(("note", THRUST_NOTE))
    if inverse:
        p.tmp("inv_loc", n * 8)
    p.steps.append(("out", 1))
    if inverse:
        p.steps.append(("note", THRUST_NOTE))
        p.free("inv_loc")
    if counts:
        p.tmp("range", (n + 1) * 8)
    p.steps += [("note", THRUST_NOTE), ("out", 2)]
    p.free("range")
    p.steps.append(("out", 0))
    p.free("indices", "input_flat")
    return once(p.steps)


def unique_plan(name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                outs: list[Any]) -> list[tuple[str, Any]] | None:
    """``unique_cuda_template``: ``self.expect_contiguous()``; a bool input not consecutive: a
    ``DeviceArray<int>(1)`` count of trues, a cub reduce, output and counts (``empty({2})``), the
    inverse; others: ``sorted`` (``empty(self.sizes())``, or the input itself when consecutive),
    with the inverse ``range = arange(numel)`` (freed after the sort) and ``sorted_indices``
    (int64), a cub radix sort; ``compute_unique``: the inverse output then ``inv_loc_out``
    (int64, sorted) or ``inv_loc`` (int32, consecutive), freed after cub's scan; ``data_out``, an
    8-byte ``length``, counts (``resize_(num_inp)``), cub's unique or run-length encode; locals die
    in reverse (length; sorted_indices, sorted; the contiguous copy)."""
    x = args[0] if args else None
    along = _dim_flags(name, args, kwargs)
    if along is not None and isinstance(x, torch.Tensor) and len(outs) == 3:
        return unique_dim_plan(x, along)
    flags = _flags(name, args, kwargs) if name in UNIQUE_OPS else None
    if flags is None or not isinstance(x, torch.Tensor) or len(outs) != 3:
        return None
    consecutive, inverse, counts = flags
    n = x.numel()
    if n == 0:
        return [("out", 0), ("out", 1), ("out", 2)]
    p = _Plan()
    if not x.is_contiguous():
        p.tmp("self_c", n * x.element_size())
    if x.dtype == torch.bool and not consecutive:
        p.tmp("num_true", 4)
        p.steps += [("note", cub_note("unique")), ("out", 0), ("out", 2), ("out", 1)]
        p.free("num_true", "self_c")
        return p.steps
    if not consecutive:
        p.tmp("sorted", n * x.element_size())
        if inverse:
            p.tmp("range", n * 8)
            p.tmp("sorted_indices", n * 8)
            p.steps.append(("note", cub_note("unique")))
            p.free("range")
        else:
            p.steps.append(("note", cub_note("unique")))
    p.steps.append(("out", 1))  # the inverse (empty({0}) without return_inverse)
    if inverse:
        p.tmp("inv_loc", n * 4 if consecutive else n * 8)
        p.steps.append(("note", cub_note("unique")))
        p.free("inv_loc")
    p.steps.append(("out", 0))
    p.tmp("length", 8)
    p.steps += [("out", 2), ("note", cub_note("unique"))]
    p.free("length", "sorted_indices", "sorted", "self_c")
    return once(p.steps)
