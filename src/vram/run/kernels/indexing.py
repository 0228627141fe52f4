"""Advanced indexing on CUDA (layer 4; needs torch): ``x[idx]`` / ``x[mask]`` (`index_plan`) and
``x[idx] = v`` (`put_plan`) through ``make_info``, and ``index_put_(..., accumulate=True)``, the
backward of every ``x[idx]`` and a user's accumulating put (`index_put_plan`), described here.

Read from ``aten/src/ATen/native/TensorAdvancedIndexing.cpp`` ``_index_put_impl_`` (on CUDA an
accumulating put goes to ``index_put_with_sort_stub``) and ``native/cuda/Indexing.cu``
``index_put_with_sort_kernel``. Autograd's ``index_backward`` calls it as
``_index_put_impl_(zeros_like(self), indices, grad, true, /*unsafe=*/true)`` (FunctionsManual.cpp);
``Tensor.index_put_(..., accumulate=True)`` as ``unsafe=false``. In order:

* ``self_ = self.contiguous()`` when ``self`` is not (copied back and freed at the end);
* ``makeLinearIndex``: ``expandTensors`` replaces a boolean (or uint8) mask by its ``nonzero()``
  (``Nonzero.cu``: [nnz, mask dims] int64, one column per dim), then each int32 index is made
  int64 (``i.to(kLong)``); these live until ``makeLinearIndex`` returns. Indices on non-adjacent
  dims are moved to the front with ``self`` (``transposeToFrontAndInvPerm``: views);
* ``computeLinearIndex``, per index: with the range check (``!unsafe``) ``wrapIndexOnce`` takes
  ``at::aminmax(index)`` (a reduction: `vram.run.kernels.reductions`) and two 1-byte comparisons
  for ``_assert_async``, each dying with its statement, the two extrema at the end of the check;
  then ``index.remainder(dim_size)`` (N int64) times its linear stride (N int64), the remainder
  dying at the end of the expression; the first product is ``linearIndex``, later ones are added
  into it and die with the loop's local;
* ``expandedValue = value.expand(vals_shape).contiguous()``: a copy when the expanded value is not
  contiguous (a gradient expanded from a sum);
* with indices and a non-empty slice: ``src.contiguous()`` of the transposed ``self`` (indices on
  non-adjacent dims), ``sorted_indices``, ``orig_indices`` (``empty_like(linearIndex)``) and
  ``range`` (``arange(num_indices)``), cub's ``radix_sort_pairs`` (its temporary storage named);
  they die at the end of their block (range, orig, sorted, the transposed copy), then
  ``expandedValue``, ``linearIndex`` and ``self_`` when the function returns.

The number of entries of a mask is the run's count where its values are known (`mask_counts`),
else it comes from the value it puts (``x[mask]``'s gradient has them); a mask counted by neither
is named, not charged (`vram.run.kernels.sorting`).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .reductions import reduction_plan
from .scratch import _Plan

_INT64 = 8
_MASKS = (torch.bool, torch.uint8)

Steps = list[tuple[str, Any]]


def _meta(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor with `t`'s sizes, strides, offset and dtype (no op runs on `t`)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _mask_count(self: torch.Tensor, indices: list[Any], value: torch.Tensor) -> int | None:
    """The entries of the one boolean mask in `indices` (the only index), read from the value it
    puts: ``vals_shape`` has them in the mask's place; None when the value does not say."""
    masks = [i for i, t in enumerate(indices) if t is not None]
    if len(masks) != 1 or indices[masks[0]].dtype not in _MASKS:
        return None
    pos, k = masks[0], indices[masks[0]].dim()
    if value.dim() != self.dim() - k + 1 or value.shape[pos] == 1:
        return None
    return int(value.shape[pos])


def mask_counts(self: torch.Tensor, indices: list[Any], value: torch.Tensor | None,
                known: dict[int, int] | None) -> dict[int, int] | None:
    """The entries of each boolean mask in `indices`, by position: the run's known count
    (`known`: the mask's values are known), else the one `value` gives (`_mask_count`); None when
    a mask's count is neither."""
    counts: dict[int, int] = {}
    for j, t in enumerate(indices):
        if t is not None and t.dtype in _MASKS:
            n = (known or {}).get(j)
            if n is None and value is not None:
                n = _mask_count(self, indices, value)
            if n is None:
                return None
            counts[j] = n
    return counts


def _long_indices(p: _Plan, self: torch.Tensor, indices: list[Any], counts: dict[int, int],
                  nonzero: Callable[..., Steps | None]) -> list[torch.Tensor | None] | None:
    """``expandTensors`` then the int32 -> int64 copies: the int64 index per dim of ``self`` (meta),
    each charged where the source allocates it (`counts`: each mask's entries); None for host
    indices."""
    out: list[torch.Tensor | None] = []
    for j, t in enumerate(indices):
        if t is None:
            out.append(None)
        elif t.device.type == "cpu":  # computeLinearIndex's products made on the host, then copied
            return None
        elif t.dtype in _MASKS:
            n = counts[j]
            cols = torch.empty((t.dim(), n), dtype=torch.int64, device="meta").t()
            p.splice(nonzero((t,), [cols]), [(f"nonzero{j}", n * t.dim() * _INT64)], f"nz{j}")
            out += [cols.select(1, c) for c in range(t.dim())]
        elif t.dtype in (torch.int64, torch.int32):
            out.append(torch.empty(t.shape, dtype=torch.int64, device="meta") if t.dtype == torch.int32
                       else _meta(t))
        else:
            return None
    for j, t in enumerate(indices):
        if t is not None and t.dtype == torch.int32:
            p.tmp(f"long{j}", t.numel() * _INT64)
    return out


def _linear_index(p: _Plan, indices: list[Any], check_range: bool, sms: int, max_threads_sm: int) -> None:
    """``computeLinearIndex`` (module doc): leaves ``linear`` allocated."""
    for k, t in enumerate(t for t in indices if t is not None):
        n = t.numel()
        if check_range and n:
            extrema = [torch.empty((), dtype=torch.int64, device="meta")] * 2
            p.splice(reduction_plan("aminmax", (t,), extrema, sms, max_threads_sm),
                     [(f"min{k}", _INT64), (f"max{k}", _INT64)], f"aminmax{k}")
            for cmp in ("lt", "ge"):  # _assert_async(index_max < size), (index_min >= -size)
                p.tmp(f"{cmp}{k}", 1)
                p.free(f"{cmp}{k}")
            p.free(f"min{k}", f"max{k}")
        p.tmp(f"rem{k}", _INT64 * n)
        p.tmp("linear" if k == 0 else f"index{k}", _INT64 * n)
        p.free(f"rem{k}")
        p.free(f"index{k}")


def _front(x: torch.Tensor, indices: list[Any]) -> tuple[torch.Tensor, list[Any]]:
    """``transposeToFrontAndInvPerm`` when the indexed dims are not adjacent (views only)."""
    defined = [i for i, t in enumerate(indices) if t is not None]
    if defined == list(range(defined[0], defined[-1] + 1)):
        return x, indices
    order = defined + [i for i, t in enumerate(indices) if t is None]
    return x.permute(order), [indices[i] for i in order]


def index_put_plan(args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[Any], cub_note: str,
                   nonzero: Callable[..., Steps | None], sms: int, max_threads_sm: int,
                   known: dict[int, int] | None = None) -> Steps | None:
    """The steps of ``index_put_with_sort_kernel`` (module doc), None outside the modelled case;
    `nonzero` is the plan of ``nonzero`` (a mask's expansion), `known` the masks' counts the run
    knows (`mask_counts`)."""
    self = args[0] if args else kwargs.get("self")
    indices = args[1] if len(args) > 1 else kwargs.get("indices")
    value = args[2] if len(args) > 2 else kwargs.get("values")
    unsafe = args[4] if len(args) > 4 else kwargs.get("unsafe", False)
    if not (isinstance(self, torch.Tensor) and isinstance(value, torch.Tensor)
            and isinstance(indices, (list, tuple)) and len(indices) <= self.dim()
            and any(t is not None for t in indices)):
        return None
    p = _Plan()
    p.steps.append(("out", 0))
    if not self.is_contiguous():
        p.tmp("self_", self.numel() * self.element_size())
    counts = mask_counts(self, list(indices), value, known)
    longs = None if counts is None else _long_indices(p, self, list(indices), counts, nonzero)
    if longs is None or len(longs) > self.dim():
        return None
    longs += [None] * (self.dim() - len(longs))
    try:
        shape = torch.broadcast_shapes(*(t.shape for t in longs if t is not None))
        longs = [None if t is None else t.expand(shape) for t in longs]
        src, longs = _front(torch.empty(self.shape, dtype=self.dtype, device="meta"), longs)
        _linear_index(p, longs, unsafe is not True, sms, max_threads_sm)
        for j in range(len(indices)):  # makeLinearIndex returns: its index vector dies in order
            p.free(f"nonzero{j}", f"long{j}")
        defined = [i for i, t in enumerate(longs) if t is not None]
        first, last = defined[0], defined[-1] + 1
        vals_shape = [*src.shape[:first], *shape, *src.shape[last:]]
        if not _meta(value).expand(vals_shape).is_contiguous():
            p.tmp("expanded", math.prod(vals_shape) * value.element_size())
    except RuntimeError:
        return None
    n, slice_size = math.prod(shape), math.prod(src.shape[last:])
    if n > 0 and slice_size > 0:
        if not src.is_contiguous():
            p.tmp("src_", self.numel() * self.element_size())
        for key in ("sorted", "orig", "range"):
            p.tmp(key, _INT64 * n)
        p.steps.append(("note", cub_note))
        p.free("range", "orig", "sorted", "src_")
    p.free("expanded", "linear", "self_")
    return p.steps


def _make_info(p: _Plan, self: torch.Tensor, indices: list[Any], counts: dict[int, int],
               nonzero: Callable[..., Steps | None]) -> list[tuple[str | None, Any]]:
    """``make_info`` + ``AdvancedIndex`` (module doc of `index_plan`): the index tensors the kernel
    reads, each with the key of a storage this op made (None: the caller's); the temporaries it
    drops are freed where ``make_info`` returns. `counts`: a mask's entries, by its position."""
    refs: list[tuple[str | None, Any]] = []
    for j, t in enumerate(indices):
        if t is None:
            refs.append((None, None))
        elif t.dtype in _MASKS:
            n, k = counts[j], t.dim()
            cols = torch.empty((k, n), dtype=torch.int64, device="meta").t()
            if t.device.type == "cpu":  # the host's nonzero, copied over whole
                p.tmp(f"nz{j}", n * k * _INT64)
            else:
                p.splice(nonzero((t,), [cols]), [(f"nz{j}", n * k * _INT64)], f"nonzero{j}")
            refs += [(f"nz{j}", cols.select(1, c)) for c in range(k)]
        elif t.device.type == "cpu":
            p.tmp(f"dev{j}", t.numel() * t.element_size())
            refs.append((f"dev{j}", torch.empty_like(t, device="meta")))
        else:
            refs.append((None, _meta(t)))
    shape = torch.broadcast_shapes(*(t.shape for _, t in refs if t is not None))
    refs = [(key, None if t is None else t.expand(shape)) for key, t in refs][:self.dim()]
    refs += [(None, None)] * (self.dim() - len(refs))
    order = [i for i, (_, t) in enumerate(refs) if t is not None]
    refs = [refs[i] for i in order]  # transposeToFront: the indexed dims first, in order
    for i, (key, t) in enumerate(refs):
        if t.dtype == torch.int32:
            p.tmp(f"long{i}", math.prod(shape) * _INT64)
            p.free(key or "")  # the vector held the only reference to a copy made above
            refs[i] = (f"long{i}", torch.empty_like(t, dtype=torch.int64))
    final = list(refs)
    if len(refs) >= 2 and len({t.stride() for _, t in refs}) > 1:  # all_strides_match, else .contiguous()
        for i, (_, t) in enumerate(refs):
            if not t.is_contiguous():
                p.tmp(f"cont{i}", math.prod(shape) * _INT64)
                final[i] = (f"cont{i}", t.contiguous())
    kept = {key for key, _ in final}
    for key, _ in refs:  # make_info's vector dies in order
        if key not in kept:
            p.free(key or "")
    return final


def index_plan(args: tuple[Any, ...], outs: list[Any], nonzero: Callable[..., Steps | None],
               known: dict[int, int] | None = None) -> Steps | None:
    """``index.Tensor`` (``x[idx]``, ``x[mask]``) on CUDA: its structured meta function runs
    ``make_info`` (TensorAdvancedIndexingUtils.h; ``expandTensors(.., ensure_same_device)``: a mask's
    ``nonzero()`` [nnz, dims] int64, or the host's nonzero copied over for a mask on the CPU, a host
    index ``.to(device)``; after broadcasting and moving the indexed dims to the front, int32
    indices ``.to(kLong)``; ``AdvancedIndex``: with two or more indices whose strides differ, each
    non-contiguous one ``.contiguous()``), then allocates the output (``build_index_op``). The
    index tensors the kernel reads are the op's operands, freed when it ends (last operand
    first); copies it dropped die when ``make_info`` returns. A lone mask's entries are read from
    the output's shape, a mask beside other indices from `known` (`mask_counts`); None without."""
    self, indices = (args[0], args[1]) if len(args) > 1 else (None, None)
    if not (isinstance(self, torch.Tensor) and isinstance(indices, (list, tuple)) and len(outs) == 1
            and isinstance(outs[0], torch.Tensor)) or len(indices) > self.dim():
        return None
    defined = [j for j, t in enumerate(indices) if t is not None]
    masks = [j for j in defined if indices[j].dtype in _MASKS]
    if not defined:
        return None
    lone = masks and len(defined) == 1
    counts = {masks[0]: int(outs[0].shape[masks[0]])} if lone else mask_counts(self, list(indices), None, known)
    if counts is None:
        return None
    p = _Plan()
    try:
        final = _make_info(p, self, list(indices), counts, nonzero)
    except RuntimeError:
        return None
    p.steps.append(("out", 0))
    for i in reversed(range(len(final))):  # the operands die last first; a storage with its last view
        key = final[i][0]
        if key is not None and key not in [k for k, _ in final[:i]]:
            p.free(key)
    return p.steps


def put_plan(args: tuple[Any, ...], kwargs: dict[str, Any], nonzero: Callable[..., Steps | None],
             known: dict[int, int] | None = None) -> Steps | None:
    """``index_put_`` without accumulating (``x[idx] = v``; ``_index_put_impl_``,
    TensorAdvancedIndexing.cpp): a one-element host value with masks alone on ``self``'s device
    is ``masked_fill_`` (nothing allocated); otherwise a one-element 0-dim host value is copied
    over (``value.to(device)``), ``make_info`` (see `index_plan`) makes the index tensors and
    ``index_put_stub`` writes through them; they die when it returns (the iterator, then the
    ``AdvancedIndex``'s vector in order), the copied value last. A mask's entries are the run's
    known count (`known`), else read from the value; a mask counted by neither is not modelled
    (None)."""
    self = args[0] if args else kwargs.get("self")
    indices = args[1] if len(args) > 1 else kwargs.get("indices")
    value = args[2] if len(args) > 2 else kwargs.get("values")
    if not (isinstance(self, torch.Tensor) and isinstance(value, torch.Tensor) and isinstance(indices, (list, tuple))
            and 0 < len(indices) <= self.dim() and any(t is not None for t in indices)):
        return None
    defined = [j for j, t in enumerate(indices) if t is not None]
    masks = [j for j in defined if indices[j].dtype in _MASKS]
    host_value = value.numel() == 1 and value.device.type == "cpu"
    if host_value and len(masks) == len(defined) == 1 and indices[masks[0]].device.type != "cpu":
        return [("out", 0)]  # canDispatchToMaskedFill
    counts = mask_counts(self, list(indices), value, known)
    if counts is None:
        return None
    p = _Plan()
    p.steps.append(("out", 0))
    if host_value and value.dim() == 0:
        p.tmp("value", value.element_size())
    try:
        final = _make_info(p, self, list(indices), counts, nonzero)
    except RuntimeError:
        return None
    for i in range(len(final)):
        key = final[i][0]
        if key is not None and key not in [k for k, _ in final[i + 1:]]:
            p.free(key)
    p.free("value")
    return p.steps
