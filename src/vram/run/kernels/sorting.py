"""Sorting, selection, scans and sampling on CUDA: what they allocate beyond their outputs (layer 4; needs torch).

`vram.run.kernels.plan.op_plan` asks `sorting_plan` for these ops (steps as in `op_plan`: ("out", i),
("tmp", nbytes), ("free", j), ("note", text)). Each rule is read from the CUDA host code (paths under
``aten/src/ATen``); buffers whose size the source fixes are charged, in the source's order:

* ``sort`` (``argsort``, ``msort``, ``sort(stable=True)``): `sort_plan` (``native/Sorting.cpp``
  ``sort_stable_out``, ``native/cuda/Sort.cpp`` ``sort_cuda_kernel``, ``native/cuda/SortStable.cu``
  ``launch_stable_sort_kernel``, ``cuda/cub.cuh`` / ``cub-RadixSortPairs.cuh``).
* ``topk``: `topk_plan` (``native/cuda/TensorTopK.cpp``, ``TensorTopK.cu``).
* ``cumsum`` / ``cumprod``: `scan_plan` (``native/ReduceOps.cpp`` ``impl_func_cum_ops``,
  ``native/cuda/ScanKernels.cpp``, ``ScanUtils.cuh`` ``scan_dim``).
* ``multinomial`` without replacement or with one sample: `multinomial_plan` (``native/Distributions.cpp``
  ``multinomial_out``; with replacement: `vram.run.kernels.selection`).
* ``nonzero``: `nonzero_plan` (``native/cuda/Nonzero.cu`` ``nonzero_cuda_out_impl``).
* ``scatter_reduce(reduce="mean")``: `scatter_reduce_plan` (``native/TensorAdvancedIndexing.cpp``).

``torch.unique`` lives in `vram.run.kernels.unique` (its outputs' storage differs from the meta
kernel's).

cub's own temporary storage (``cuda/cub.cuh`` ``CUB_WRAPPER``: ``func(nullptr, bytes, ...)`` then
``caching_allocator.allocate(bytes)``, freed when the call returns) is sized at run time by cub's
dispatch from the tuning policy of the GPU's architecture and the CCCL release PyTorch was built
with: not derivable here, so each such call carries a note (`cub_note`) instead of a charge. Ops
whose extra buffers are not modelled at all (`UNMODELLED`) are named the same way, never silently
charged their outputs only.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from . import reductions as _reductions
from .blas import non_overlapping_and_dense
from .indexing import index_plan, index_put_plan, put_plan
from .scratch import _Plan

#: ``native/cuda/Sort.h`` ``should_use_small_sort``: slices up to this size sort in place
SMALL_SORT = 4096
#: ``SortStable.cu``: one sort per segment from this slice size (or with one segment)
LARGE_SEGMENT = 1_000_000
#: ``SortStable.cu``: fewer segments than this sort by one full sort plus a segment-id sort
FULL_SORT_SEGMENTS = 128
INT_MAX = 2**31 - 1

#: ``TensorTopK.cu`` ``mbtopk``: threads per block, radix digits, items per thread (clamped), and
#: the occupancy ``get_items_per_thread`` assumes: 40 registers a thread of the 65,536 every CUDA
#: GPU since sm 5.0 has per SM (``regsPerMultiprocessor``), so min(65536 / (40 * 256), the 16-32
#: ``maxBlocksPerMultiProcessor``) = 6 blocks per SM
MB_BLOCK_THREADS, MB_RADIX_DIGITS, MB_MIN_ITEMS, MB_MAX_ITEMS = 256, 256, 4, 64
MB_BLOCKS_PER_SM = 65536 // (40 * MB_BLOCK_THREADS)

#: ops with buffers beyond their outputs that no plan models yet: named, not charged
UNMODELLED = {
    "index_reduce": "index_reduce (Indexing.cu): buffers beyond its outputs",
    "_index_put_impl_": "index_put_(accumulate=True) with a boolean mask whose values the run does not know "
                        "and whose number of entries its value does not give, or host indices (Indexing.cu "
                        "index_put_with_sort_kernel: the mask's nonzero, linear indices, their sorted copy and "
                        "original positions, expanded values)",
    "index": "x[mask, idx] with a mask beside other indices whose values the run does not know "
             "(TensorAdvancedIndexingUtils.h make_info: the mask's nonzero, index copies)",
    "index_put_": "x[mask] = v with a mask whose values the run does not know and whose number of entries v "
                  "does not give (TensorAdvancedIndexing.cpp make_info: the mask's nonzero, index copies)",
}


def cub_note(op: str) -> str:
    """The note a call to cub inside `op` carries (its temporary storage is not charged)."""
    return (f"cub temporary storage in {op} (sized by cub's tuning policy for the GPU architecture "
            "and CCCL release, ATen/cuda/cub.cuh CUB_WRAPPER), freed within the call")


def once(steps: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """`steps` with each note kept at its first place only: a run counts op calls, not cub calls."""
    seen: set[Any] = set()
    kept: list[tuple[str, Any]] = []
    for step, arg in steps:
        if step == "note":
            if arg in seen:
                continue
            seen.add(arg)
        kept.append((step, arg))
    return kept


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else default


def dense_strides_dim_last(x: torch.Tensor, dim: int) -> list[int]:
    """``native/cuda/SortImpl.cu`` ``infer_dense_strides_dim_last``: dense strides in the order of
    `x`'s strides (a stable sort, largest first) with `dim` innermost."""
    keys = list(x.stride())
    keys[dim] = -1
    order = sorted(range(x.dim()), key=lambda i: -keys[i])  # sorted() is stable, like thrust's
    strides = [0] * x.dim()
    step = 1
    for i in reversed(order):
        strides[i] = step
        step *= x.size(i)
    return strides


def _splice(p: _Plan, steps: list[tuple[str, Any]], outs: list[tuple[str, int] | None], tag: str) -> None:
    """Another op's plan inside this one: its outputs become named temporaries (None: an output that
    already exists, not allocated again), its temporaries and frees keep their order."""
    inner: list[str] = []
    for step, arg in steps:
        if step == "out":
            target = outs[arg] if arg < len(outs) else None
            if target is not None:
                p.tmp(*target)
        elif step == "tmp":
            inner.append(f"{tag}{len(inner)}")
            p.tmp(inner[-1], arg)
        elif step == "free":
            p.free(inner[arg])
        else:
            p.steps.append((step, arg))


def _reduction(p: _Plan, name: str, args: tuple[Any, ...], outs: list[torch.Tensor],
               keys: list[str | None], sms: int, max_threads_sm: int) -> None:
    """A reduction called from C++ (``self.sum(1)``, ``aminmax``, ``argmax_out``): its staging as
    `reduction_plan` has it, its outputs as temporaries named `keys` (None: already allocated)."""
    steps = _reductions.reduction_plan(name, args, outs, sms, max_threads_sm)
    if steps is None:
        steps = [("out", i) for i in range(len(outs))]
    _splice(p, steps, [(k, _nbytes(o)) if k is not None else None for k, o in zip(keys, outs)], name)


def sort_kernel(p: _Plan, x: torch.Tensor, values: torch.Tensor, dim: int, op: str) -> None:
    """``sort_cuda_kernel`` (Sort.cpp) once the outputs exist. Slices of at most 4,096 elements:
    ``fillSliceWithIndex`` makes ``arange(size(dim))`` (int64; freed when it returns) and
    ``sortKeyValueInplace`` sorts in place. Larger: ``self_`` (a dim-last dense copy unless the input
    is dense with ``stride(dim) == 1``), ``values_tmp`` / ``indices_tmp`` where the outputs' strides
    differ from ``self_``'s, then ``launch_stable_sort_kernel`` (SortStable.cu), per batch of at most
    INT_MAX elements: one segment or slices of 1e6+: ``DeviceArray indices(nsort)`` int64 and a cub
    radix sort per segment; fewer than 128 segments: two ``int2`` buffers of ``numel`` and
    ``radix_sort_pairs(keys_out=nullptr)``'s ``keys_out_owner`` (numel keys, cub.cuh), freed after
    that sort, then a cub key sort; else ``reverse_indices`` (numel int64) and a cub segmented sort.
    Locals die in reverse order: the kernel's, then indices_tmp, values_tmp, self_."""
    nsort = x.size(dim)
    if nsort <= SMALL_SORT:
        if x.numel():
            p.tmp("range", nsort * 8)
            p.free("range")
        return
    dense = non_overlapping_and_dense(x) and x.stride(dim) == 1
    strides = list(x.stride()) if dense else dense_strides_dim_last(x, dim)
    if not dense:
        p.tmp("self_", _nbytes(x))
    if list(values.stride()) != strides:  # both outputs share the meta kernel's strides
        p.tmp("values_tmp", _nbytes(x))
        p.tmp("indices_tmp", x.numel() * 8)
    numel, esize = x.numel(), x.element_size()
    nbatch = (min(numel, INT_MAX) // nsort) * nsort
    remaining = numel
    while remaining > 0:
        n = min(remaining, nbatch)
        nsegments = n // nsort
        if nsegments == 1 or nsort >= LARGE_SEGMENT:
            p.tmp("segment_indices", nsort * 8)
            p.steps.append(("note", cub_note(op)))
            p.free("segment_indices")
        elif nsegments < FULL_SORT_SEGMENTS:
            p.tmp("indices_and_segment", n * 8)
            p.tmp("indices_and_segment2", n * 8)
            p.tmp("keys_out_owner", n * esize)
            p.steps.append(("note", cub_note(op)))
            p.free("keys_out_owner")
            p.free("indices_and_segment2", "indices_and_segment")
        else:
            p.tmp("reverse_indices", n * 8)
            p.steps.append(("note", cub_note(op)))
            p.free("reverse_indices")
        remaining -= n
    p.free("indices_tmp", "values_tmp", "self_")


def sort_plan(args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[Any]) -> list[tuple[str, Any]] | None:
    """``sort`` / ``sort.stable`` (structured: values and indices first; ``sort_stable_out``
    copies the input into values, then a 0-dim input zeroes its index, others run
    `sort_kernel`)."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or len(outs) != 2 or not isinstance(outs[0], torch.Tensor):
        return None
    p = _Plan()
    p.steps += [("out", 0), ("out", 1)]
    if x.dim() == 0 or x.numel() == 0:
        return p.steps
    dim = _arg(args, kwargs, 1, "dim", -1)
    if not isinstance(dim, int) or isinstance(dim, bool):  # sort.stable: all keyword-only
        dim = kwargs.get("dim", -1)
    sort_kernel(p, x, outs[0], dim % x.dim(), "sort")
    return p.steps


def multiblock_topk(p: _Plan, slices: int, slice_size: int, dtype: torch.dtype, sms: int) -> None:
    """``mbtopk::launch`` (TensorTopK.cu): ``items_per_thread = clamp(ceil(slice_size * slices /
    (SMs * 6 * 256)), 4, 64)``, ``blocks_per_slice = ceil(slice_size / (items * 256))``; then
    ``kthValues`` (a value per slice), ``semaphores`` (uint32 per slice), ``ks_to_find`` (2 uint32
    per slice), ``desired`` (2 radix words per slice: 8 bytes for double/int64, else 4), ``counts``
    (256 shorts per block), ``withinKCounts`` and ``kthCounts`` (uint32 per block), cub's
    ``inclusive_sum_by_key`` twice (named); all freed in reverse when it returns."""
    items = min(max(-(-slice_size * slices // (sms * MB_BLOCKS_PER_SM * MB_BLOCK_THREADS)), MB_MIN_ITEMS),
                MB_MAX_ITEMS)
    blocks = slices * -(-slice_size // (items * MB_BLOCK_THREADS))
    radix = 8 if dtype in (torch.float64, torch.int64) else 4
    sizes = {"kthValues": slices * dtype.itemsize, "semaphores": slices * 4, "ks_to_find": 2 * slices * 4,
             "desired": 2 * slices * radix, "counts": blocks * MB_RADIX_DIGITS * 2,
             "withinKCounts": blocks * 4, "kthCounts": blocks * 4}
    for key, nbytes in sizes.items():
        p.tmp(key, nbytes)
    p.steps.append(("note", cub_note("topk")))
    p.free(*reversed(sizes))


def topk_plan(args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[Any], sms: int,
              existing: bool = False) -> list[tuple[str, Any]] | None:
    """``topk_out_cuda`` (TensorTopK.cpp; structured: values and indices first, unless `existing`:
    ``topk_out`` into tensors a caller made). ``k == 0``: nothing. ``launch_gather_topk_kernel``
    (TensorTopK.cu) takes ``self.contiguous()``; the multi-block radix select
    (``should_use_multiblock``) allocates `multiblock_topk`'s buffers. Sorted results of more than
    4,096 per slice: ``sortedIndices`` and ``sortedValues`` (``empty_like``), ``sort_out_cuda``
    (`sort_kernel` on the values), then ``indices.gather(dim, sortedIndices)`` (a new int64
    tensor, freed after the copy)."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or len(outs) != 2 or not isinstance(outs[0], torch.Tensor):
        return None
    k = int(_arg(args, kwargs, 1, "k", 0))
    dim = int(_arg(args, kwargs, 2, "dim", -1)) % max(x.dim(), 1)
    is_sorted = bool(_arg(args, kwargs, 4, "sorted", True))
    values, indices = outs
    p = _Plan()
    if not existing:
        p.steps += [("out", 0), ("out", 1)]
    if k == 0:
        return p.steps
    slice_size = x.size(dim) if x.dim() else 1
    if x.numel() > 0:
        if not x.is_contiguous():
            p.tmp("input", _nbytes(x))
        slices = x.numel() // slice_size
        if _multiblock(slices, slice_size):
            multiblock_topk(p, slices, slice_size, x.dtype, sms)
        p.free("input")
    if is_sorted and values.numel() > 1 and values.dim() and values.size(dim) > SMALL_SORT:
        p.tmp("sortedIndices", _nbytes(indices))
        p.tmp("sortedValues", _nbytes(values))
        sort_kernel(p, values, values, dim, "topk")
        p.tmp("gathered", _nbytes(indices))
        p.free("gathered", "sortedValues", "sortedIndices")
    return p.steps


def _multiblock(num_slices: int, slice_size: int) -> bool:
    """``TensorTopK.cu`` ``should_use_multiblock`` (CUB with scan-by-key: every CUDA 12 build)."""
    if num_slices > 2**32 - 1 or slice_size > 2**32 - 1:
        return False
    return ((num_slices <= 20 and slice_size >= 20000) or (20 < num_slices <= 40 and slice_size >= 10000)
            or (40 < num_slices <= 80 and slice_size >= 8000) or (80 < num_slices < 200 and slice_size >= 5000)
            or (200 <= num_slices < 800 and slice_size >= 3000) or (800 <= num_slices <= 4000 and slice_size >= 800)
            or (num_slices > 4000 and slice_size >= 400))


def scan_plan(name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
              outs: list[Any]) -> list[tuple[str, Any]] | None:
    """``cumsum`` / ``cumprod`` (structured: the output first). ``impl_func_cum_ops``
    (ReduceOps.cpp): a 0-dim or empty input fills the output; else the stub gets
    ``self.to(result.scalar_type())`` (a copy keeping dense strides when the dtype differs);
    ``scan_dim`` (ScanUtils.cuh) takes ``self.expect_contiguous()`` (a copy of a strided one) and,
    when ``numel == size(dim)``, scans with cub (``inclusive_scan``: named); other shapes run
    ATen's own scan kernels (no scratch). Both copies die when the op returns."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or len(outs) != 1 or not isinstance(outs[0], torch.Tensor):
        return None
    out = outs[0]
    p = _Plan()
    p.steps.append(("out", 0))
    if x.dim() == 0 or x.numel() == 0:
        return p.steps
    dim = int(_arg(args, kwargs, 1, "dim", 0)) % x.dim()
    conv = x
    if x.dtype != out.dtype:
        conv = torch.empty_like(x, dtype=out.dtype, device="meta")  # preserve_format, as `to` copies
        p.tmp("converted", _nbytes(conv))
    if not conv.is_contiguous():
        p.tmp("contiguous", _nbytes(conv))
    if x.numel() == x.size(dim):
        p.steps.append(("note", cub_note(name)))
    p.free("contiguous", "converted")
    return p.steps


def multinomial_plan(args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[Any], sms: int,
                     max_threads_sm: int) -> list[tuple[str, Any]] | None:
    """``multinomial_out`` (Distributions.cpp), without replacement or with one sample: the result
    (``resize_``), then ``auto [self_min, self_max] = self.aminmax()``, ``is_valid = ((self_max <
    INFINITY) & (self_min >= 0))`` (0-dim bools; the comparisons die after the ``&``),
    ``zero_prob_condition = (self.sum(1) == 0).any()`` (1-D: ``self.sum() == 0``), ``~`` of it for
    ``_assert_async``, ``q = empty_like(self)`` (``exponential_`` and ``div_out`` write it in place),
    then ``argmax_out(result, q, -1, true)`` (or ``vals = empty(result.sizes())`` and ``topk_out``).
    Locals die in reverse: vals, q, zero_prob_condition, is_valid, self_min, self_max. With
    replacement and more samples the stub runs (`vram.run.kernels.selection`)."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or len(outs) != 1 or not isinstance(outs[0], torch.Tensor):
        return None
    n = int(_arg(args, kwargs, 1, "num_samples", 1))
    p = _Plan()
    p.steps.append(("out", 0))
    if outs[0].numel() == 0:
        return p.steps
    scalar = torch.empty((), dtype=x.dtype, device="meta")
    flag = torch.empty((), dtype=torch.bool, device="meta")
    _reduction(p, "aminmax", (x,), [scalar, scalar], ["self_min", "self_max"], sms, max_threads_sm)
    p.tmp("ge", 1)  # self_min >= 0 (evaluated first, as the CPU build's profile shows)
    p.tmp("lt", 1)
    p.tmp("is_valid", 1)
    p.free("lt", "ge")
    if x.dim() == 1:
        _reduction(p, "sum", (x,), [scalar], ["sum"], sms, max_threads_sm)
        p.tmp("zero_prob_condition", 1)
        p.free("sum")
    else:
        rows = torch.empty((x.size(0),), dtype=x.dtype, device="meta")
        _reduction(p, "sum", (x, [1]), [rows], ["sum"], sms, max_threads_sm)
        p.tmp("eq", x.size(0))
        eq = torch.empty((x.size(0),), dtype=torch.bool, device="meta")
        _reduction(p, "any", (eq,), [flag], ["zero_prob_condition"], sms, max_threads_sm)
        p.free("eq", "sum")
    p.tmp("not", 1)
    p.free("not")
    q = torch.empty_like(x, device="meta")
    p.tmp("q", _nbytes(q))
    if n == 1:
        _reduction(p, "argmax", (q, -1, True), [outs[0]], [None], sms, max_threads_sm)
    else:
        vals = torch.empty(outs[0].shape, dtype=x.dtype, device="meta")
        p.tmp("vals", _nbytes(vals))
        inner = topk_plan((q, n), {}, [vals, outs[0]], sms, existing=True)
        _splice(p, inner or [], [], "topk")
        p.free("vals")
    p.free("q", "zero_prob_condition", "is_valid", "self_min", "self_max")
    return p.steps


def scatter_reduce_plan(args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[Any]) -> list[tuple[str, Any]] | None:
    """``scatter_reduce.two`` (TensorAdvancedIndexing.cpp ``scatter_reduce_two``; structured: the
    output first, ``out.copy_(self)``, the scatter kernels allocate nothing). ``reduce="mean"``
    then makes ``ones = ones_like(src)``, ``count = ones_like(out)`` (``zeros_like`` without
    ``include_self``), ``count.scatter_add_(dim, index, ones)``, ``count.masked_fill_(count == 0,
    1)`` (the bool mask dies after that statement) and ``out.div_(count)``; count and ones die
    when it returns. Other reductions: the output only."""
    if len(args) < 5 or len(outs) != 1 or not isinstance(args[3], torch.Tensor):
        return None
    src, out = args[3], outs[0]
    p = _Plan()
    p.steps.append(("out", 0))
    if args[4] == "mean":
        p.tmp("ones", _nbytes(src))
        p.tmp("count", _nbytes(out))
        p.tmp("mask", out.numel())
        p.free("mask", "count", "ones")
    return p.steps


def nonzero_plan(args: tuple[Any, ...], outs: list[Any]) -> list[tuple[str, Any]] | None:
    """``nonzero_cuda_out_impl`` (Nonzero.cu): ``self.contiguous()``; ``num_nonzeros`` (an int per
    chunk of 2**30 elements when numel >= INT_MAX, else one); per chunk a cub ``DeviceReduce::Sum``
    (named); the count read back; the output ``resize_({dim, nnz})``; per chunk a cub
    ``DeviceSelect::Flagged`` (named); locals die in reverse (num_nonzeros, then the copy)."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or len(outs) != 1:
        return None
    p = _Plan()
    if not x.is_contiguous():
        p.tmp("self_", _nbytes(x))
    chunks = 1 if x.numel() < INT_MAX else math.ceil(x.numel() / 2**30)
    p.tmp("num_nonzeros", 4 * chunks)
    p.steps.append(("note", cub_note("nonzero")))
    p.steps.append(("out", 0))
    if x.dim() > 0:
        p.steps.append(("note", cub_note("nonzero")))
    p.free("num_nonzeros", "self_")
    return once(p.steps)


def sorting_plan(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[Any], sms: int,
                 max_threads_sm: int, known: dict[int, int] | None = None) -> list[tuple[str, Any]] | None:
    """The allocation order of an op this module knows (see the module doc), None for others;
    `known`: the entries of the boolean masks among an indexing op's indices whose values the run
    knows, by position (`vram.run.kernels.indexing.mask_counts`)."""
    if name == "sort":
        return sort_plan(args, kwargs, outs)
    if name == "topk":
        return topk_plan(args, kwargs, outs, sms)
    if name in ("cumsum", "cumprod"):
        return scan_plan(name, args, kwargs, outs)
    if name == "multinomial":
        return multinomial_plan(args, kwargs, outs, sms, max_threads_sm)
    if name == "nonzero":
        return nonzero_plan(args, outs)
    if name == "scatter_reduce":
        return scatter_reduce_plan(args, kwargs, outs)
    if name == "index":
        got = index_plan(args, outs, nonzero_plan, known)
        return got if got is not None else [("out", 0), ("note", UNMODELLED["index"])] if len(outs) == 1 else None
    if name == "_index_put_impl_" and not _arg(args, kwargs, 3, "accumulate", False):
        put = put_plan(args, kwargs, nonzero_plan, known)
        return put if put is not None else [("out", 0), ("note", UNMODELLED["index_put_"])]
    if name == "_index_put_impl_":
        modelled = index_put_plan(args, kwargs, outs, cub_note("index_put_(accumulate=True)"), nonzero_plan,
                                  sms, max_threads_sm, known)
        if modelled is not None:
            return modelled
    if name == "aminmax" and args and isinstance(args[0], torch.Tensor):
        dim = kwargs.get("dim")
        return _reductions.reduction_plan(name, (args[0],) if dim is None else (args[0], dim), outs,
                                          sms, max_threads_sm)
    if name in UNMODELLED:
        return [*(("out", i) for i in range(len(outs))), ("note", UNMODELLED[name])]
    return None
