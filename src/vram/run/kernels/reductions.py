"""Scratch that CUDA reduction kernels take from the caching allocator, for `vram.run.kernels.plan`.

Every ``gpu_reduce_kernel`` launch (``aten/src/ATen/native/cuda/Reduce.cuh``: sum, nansum, prod,
mean, amax/amin, aminmax, max/min (all or along a dim), argmax/argmin, any/all, var/std(_mean), norm,
linalg_vector_norm) computes a `ReduceConfig` from the TensorIterator's geometry and the device's
``multiProcessorCount`` and ``maxThreadsPerMultiProcessor`` (``setReduceConfig``). When the
config splits each output's inputs across thread blocks (``should_global_reduce()``), the launch
allocates a global staging ``buffer`` of ``global_memory_size()`` bytes and then ``semaphores``
of ``semaphore_size()`` bytes through ``CUDACachingAllocator::get()->allocate`` and frees them
when ``gpu_reduce_kernel`` returns (two ``at::DataPtr`` locals: semaphores first, then buffer).
A recorded instance: ``shared/traces/cs336-s-mem.pickle`` events 27-32, ``output.sum()`` of
8x4096x16 fp32 on an A100 (108 SMs): 256 + 4 bytes, freed 4 then 256.

Also modelled, from the same sources:

* iterators that cannot use 32-bit indexing are split in halves (``with_32bit_indexing``,
  ``TensorIteratorBase::split``/``get_dim_to_split``) and every piece launches, and allocates,
  on its own; when the result cannot accumulate in the output (a struct accumulator, or a
  half/bfloat16 input reduced into the same type) an ``AccumulationBuffer`` of
  ``sizeof(arg_t)`` per output element is allocated first and freed last;
* ``make_reduction`` converts the input with ``self.to(in_dtype)`` when the op computes in
  another dtype (``ReduceOpsUtils.h``: e.g. ``sum`` of a bool or int32 tensor is computed in
  int64): a copy of the input, allocated after the output and freed when the op returns.

The geometry follows ``TensorIteratorBase`` (``compute_strides``, ``reorder_dimensions``,
``coalesce_dimensions``); `input_vec_size` never decides whether a launch stages globally (a
vectorised launch reduces fewer than 4,096 inputs per output), so the per-version choices of
vt0/input_vec_size (4, or 8 for 16-bit sums) do not change any allocation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

INT32_MAX = 2**31 - 1
MAX_VALUES_PER_THREAD, MIN_VALUES_PER_THREAD = 256, 16  # setReduceConfig (CUDA, not ROCm)
WARP_SIZE = 32

#: ops whose accumulator is ``opmath(scalar)``: float for half/bfloat16 (``func_wrapper`` lambdas,
#: MeanOps, Norm*Ops); ops reducing in the input type (``max_values_kernel_cuda_impl``, and/or
_OPMATH = frozenset({"sum", "nansum", "prod", "mean", "norm", "linalg_vector_norm"})
_SAME = frozenset({"amax", "amin", "any", "all"})
#: ``MinMaxReductionOps``/``ArgReductionOps``: ``pair<acc_t, int64_t>``
_PAIR = frozenset({"argmax", "argmin"})
#: ``MinMaxOps<scalar_t, scalar_t, int32_t>`` (``ReduceAMinMaxKernel.cu``): ``pair<scalar_t, scalar_t>``
_MINMAX = frozenset({"aminmax"})
#: ``WelfordOps``: ``WelfordData<acc_t, int32_t>`` (mean, m2, n, nf)
_WELFORD = frozenset({"var", "std", "var_mean", "std_mean"})
#: ops that convert their input to the computation dtype first (``make_reduction_from_out_ty``)
_CASTS = frozenset({"sum", "nansum", "prod", "mean", "norm", "linalg_vector_norm"})
REDUCTIONS = _OPMATH | _SAME | _PAIR | _MINMAX | _WELFORD | {"max", "min"}


@dataclass
class Iter:
    """A reduction TensorIterator after ``build``: dims fastest first, byte strides per operand
    (outputs first, the input last), byte offsets of each operand's data pointer."""

    shape: list[int]
    strides: list[list[int]]
    offsets: list[int] = field(default_factory=list)

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def num_output_elements(self) -> int:
        n = 1
        for d, s in enumerate(self.shape):
            if self.strides[0][d] != 0 or s == 0:
                n *= s
        return n

    def num_reduce_dims(self) -> int:
        return sum(1 for st in self.strides[0] if st == 0)

    def can_use_32bit_indexing(self) -> bool:
        if self.numel() > INT32_MAX:
            return False
        for st in self.strides:
            if 1 + sum((s - 1) * b for s, b in zip(self.shape, st)) > INT32_MAX:
                return False
        return True

    def dim_to_split(self) -> int:
        best, dim = -1, -1
        for d in range(len(self.shape) - 1, -1, -1):
            if self.shape[d] == 0:
                continue
            for st in self.strides:
                extent = (self.shape[d] - 1) * abs(st[d])
                if extent > best:
                    best, dim = extent, d
        return dim

    def narrow(self, dim: int, start: int, size: int) -> None:
        self.shape[dim] = size
        self.offsets = [o + st[dim] * start for o, st in zip(self.offsets, self.strides)]

    def split(self, dim: int) -> Iter:
        """``TensorIteratorBase::split``: this becomes the upper half, the lower half is returned."""
        copy = Iter(list(self.shape), [list(s) for s in self.strides], list(self.offsets))
        half = self.shape[dim] // 2
        copy.narrow(dim, 0, half)
        self.narrow(dim, half, self.shape[dim] - half)
        return copy


def build_iter(in_shape: list[int], in_strides: list[int], in_size: int, in_offset: int,
               outs: list[tuple[list[int], int]], reduced: set[int]) -> Iter:
    """A reduction iterator (``TensorIterator::reduce_op``) of an input (sizes, element strides,
    element size, byte offset) and outputs given as (element strides, element size) of the
    ``review_reduce_result`` view, whose reduced dims have size 1."""
    nd = len(in_shape)
    strides = []
    for ostrides, osize in outs:  # compute_strides: broadcast (size-1) dims get stride 0
        strides.append([0 if (d in reduced and in_shape[d] != 1) else ostrides[d] * osize for d in range(nd)])
    strides.append([in_strides[d] * in_size for d in range(nd)])
    noutputs = len(outs)
    shape = list(in_shape)

    def should_swap(d0: int, d1: int) -> int:  # reorder_dimensions
        for arg, st in enumerate(strides):
            s0, s1 = st[d0], st[d1]
            if arg < noutputs and (s0 == 0) != (s1 == 0):
                return 1 if s1 == 0 else -1
            if s0 == 0 or s1 == 0:
                continue
            if s0 < s1:
                return -1
            if s0 > s1:
                return 1
            if shape[d0] > shape[d1]:
                return 1
        return 0

    perm = list(range(nd - 1, -1, -1))
    if nd > 1:
        for i in range(1, nd):
            d1 = i
            for d0 in range(i - 1, -1, -1):
                c = should_swap(perm[d0], perm[d1])
                if c > 0:
                    perm[d0], perm[d1] = perm[d1], perm[d0]
                    d1 = d0
                elif c < 0:
                    break
    shape = [shape[p] for p in perm]
    strides = [[st[p] for p in perm] for st in strides]
    if nd > 1:  # coalesce_dimensions
        prev = 0
        for d in range(1, nd):
            s0, s1 = shape[prev], shape[d]
            if s0 == 1 or s1 == 1 or all(s0 * st[prev] == st[d] for st in strides):
                if shape[prev] == 1:
                    for st in strides:
                        st[prev] = st[d]
                shape[prev] *= shape[d]
            else:
                prev += 1
                if prev != d:
                    for st in strides:
                        st[prev] = st[d]
                    shape[prev] = shape[d]
        shape = shape[:prev + 1]
        strides = [st[:prev + 1] for st in strides]
    return Iter(shape, strides, [0] * noutputs + [in_offset])


def _last_pow2(n: int) -> int:
    n = int(n)
    for s in (1, 2, 4, 8, 16):
        n |= n >> s
    return max(1, n - (n >> 1))


def _div_up(a: int, b: int) -> int:
    return (a + b - 1) // b


def _output_vec_size(it: Iter, scalar_size: int) -> int:
    """``get_output_vec_size``: 4, halved until it divides the input's address, the output dim's
    size and every other input stride (in elements)."""
    vec = 4
    nout = len(it.strides) - 1
    values = [it.offsets[nout] // scalar_size, it.shape[it.num_reduce_dims()]]
    values += [s // scalar_size for j, s in enumerate(it.strides[nout]) if j != it.num_reduce_dims()]
    for n in values:
        while n % vec:
            vec //= 2
    return vec


def staging_sizes(it: Iter, arg_size: int, scalar_size: int, sms: int, max_threads_sm: int,
                  input_vec_size: int = 4, max_threads: int = 512) -> tuple[int, int]:
    """(``global_memory_size()``, ``semaphore_size()``) of one launch: ``setReduceConfig``
    (``Reduce.cuh``) worked for iterator `it`; (0, 0) when it does not reduce globally."""
    num_outputs = it.num_output_elements()
    num_inputs = it.numel() // num_outputs
    nd, nred, inp = len(it.shape), it.num_reduce_dims(), it.strides[-1]
    if nd > 0:
        on_fastest = nred == nd or inp[0] < inp[nred]
        if on_fastest:
            dim0, dim1, fastest = num_inputs, num_outputs, inp[0]
        else:
            dim0, dim1, fastest = num_outputs, num_inputs, inp[nred]
    else:
        on_fastest, dim0, dim1, fastest = True, 1, 1, scalar_size
    out_vec = 1
    if fastest == scalar_size:
        if on_fastest and dim0 >= 128 and nred == 1:
            dim0 //= input_vec_size
        elif not on_fastest:
            out_vec = _output_vec_size(it, scalar_size)
            dim0 //= out_vec
    mnt = max_threads // out_vec  # set_block_dimension
    dim0_pow2 = _last_pow2(dim0) if dim0 < mnt else mnt
    dim1_pow2 = _last_pow2(dim1) if dim1 < mnt else mnt
    bw = min(dim0_pow2, WARP_SIZE)
    bh = min(dim1_pow2, mnt // bw)
    bw = min(dim0_pow2, mnt // bh)
    num_threads = bw * bh
    step_in, step_out = 1, 1
    block_x_reduce = nd == 0 or on_fastest
    if block_x_reduce:
        step_in *= bw
    else:
        step_out *= bw
    if _div_up(num_inputs, step_in) >= min(bh * 16, MAX_VALUES_PER_THREAD):
        split_warps = True  # input_mult[1] = split_input(block_height): nonzero
        step_in *= bh
    else:
        split_warps = False
        step_out *= bh
    grid_x = _div_up(num_outputs // out_vec, step_out)
    target = sms * (max_threads_sm // num_threads)
    vpt = _div_up(num_inputs, step_in)
    if not (split_warps and vpt >= MAX_VALUES_PER_THREAD and grid_x <= target):
        return 0, 0
    ctas = max(min(_div_up(target, grid_x), _div_up(vpt, MIN_VALUES_PER_THREAD)),
               _div_up(vpt, MAX_VALUES_PER_THREAD))
    if ctas <= 1:
        return 0, 0
    size = arg_size * num_outputs * ctas
    if not block_x_reduce:
        size *= bw * out_vec
    return size, 4 * grid_x


def _acc_size(name: str, dtype: torch.dtype) -> int | None:
    """``sizeof(arg_t)`` of the op's reduction on this input dtype; None if not modelled."""
    size = dtype.itemsize
    low = dtype in (torch.float16, torch.bfloat16)
    if name in _SAME or name in ("max", "min"):
        return size
    if name in _MINMAX:
        return 2 * size
    if dtype.is_complex:
        return None if name not in ("sum", "prod", "mean") else max(size, 8)
    if name in _OPMATH:
        return 4 if low else size
    if name in _PAIR:
        return 16  # pair<acc_t (<= 8 bytes), int64_t>
    if name in _WELFORD:
        return 32 if dtype == torch.float64 else 16
    return None


def _reduced_dims(name: str, args: tuple[Any, ...], ndim: int) -> set[int] | None:
    """The dims the op reduces (its ``dim`` argument; all when absent, None or empty)."""
    at = 2 if name in ("norm", "linalg_vector_norm") else 1
    dim = args[at] if len(args) > at else None
    if name in ("max", "min") and dim is not None and not isinstance(dim, int):
        return None  # max(a, b): elementwise
    if isinstance(dim, bool) or dim is None or (isinstance(dim, (list, tuple)) and not dim):
        return set(range(ndim))  # var(self, unbiased), sum(self, dim=None), amax(self, [])
    if isinstance(dim, int):
        dims = [dim]
    elif isinstance(dim, (list, tuple)):
        dims = list(dim)
    else:
        return None
    return {d % ndim if ndim else 0 for d in dims}


def reduction_plan(name: str, args: tuple[Any, ...], outs: list[Any], sms: int,
                   max_threads_sm: int) -> list[tuple[str, Any]] | None:
    """The allocations of a reduction op in order (see `vram.run.kernels.plan.op_plan`), or None."""
    if name not in REDUCTIONS or not args or not isinstance(args[0], torch.Tensor):
        return None
    x = args[0]
    tensors = [o for o in outs if isinstance(o, torch.Tensor)]
    if not tensors or len(tensors) != len(outs) or x.numel() == 0 or x.dim() == 0:
        return None
    if name in ("max", "min") and len(args) > 1 and isinstance(args[1], torch.Tensor):
        return None
    reduced = _reduced_dims(name, args, x.dim())
    if reduced is None:
        return None
    out_dtype = tensors[0].dtype
    in_dtype = x.dtype
    if name in _CASTS and not (x.dtype in (torch.float16, torch.bfloat16) and out_dtype == torch.float32):
        in_dtype = out_dtype if not x.is_complex() else x.dtype
    arg_size = _acc_size(name, in_dtype)
    if arg_size is None:
        return None
    plan: list[tuple[str, Any]] = [("out", i) for i in range(len(outs))]
    shape, strides, offset = list(x.shape), list(x.stride()), x.storage_offset() * in_dtype.itemsize
    ntmp = 0
    if name in ("argmax", "argmin") and (len(args) < 2 or args[1] is None) and x.dim() > 1:
        if not x.is_contiguous():  # argmax_out: self.reshape({-1}) copies a non-viewable input
            plan.append(("tmp", x.numel() * x.element_size()))
            ntmp += 1
        shape, strides, offset, reduced = [x.numel()], [1], 0 if not x.is_contiguous() else offset, {0}
    copied = in_dtype != x.dtype
    if copied:  # make_reduction: self.to(in_dtype), same strides when dense (preserve_format)
        plan.append(("tmp", x.numel() * in_dtype.itemsize))
        ntmp += 1
        dense = x.is_contiguous() or _dense(x)
        strides = list(x.stride()) if dense else list(torch.empty(shape, device="meta").stride())
        offset = 0
    keep = len(shape) == tensors[0].dim()
    ostrides: list[tuple[list[int], int]] = []
    for t in tensors:
        st = list(t.stride())
        if not keep:
            full, k = [], 0
            for d in range(len(shape)):
                if d in reduced:
                    full.append(0)
                else:
                    full.append(st[k] if k < len(st) else 0)
                    k += 1
            st = full
        ostrides.append((st, t.element_size()))
    it = build_iter(shape, strides, in_dtype.itemsize, offset, ostrides, reduced)
    struct_acc = name in _PAIR or name in _WELFORD or (name in ("max", "min") and len(outs) == 2)
    if (name in ("max", "min") and len(outs) == 2):
        arg_size = 16
    can_accumulate = not struct_acc and not (in_dtype == out_dtype and in_dtype in (torch.float16, torch.bfloat16))
    acc_buf = None
    if not it.can_use_32bit_indexing() and not can_accumulate:
        t0 = tensors[0]
        mem = max([t0.element_size()] + [s * st for s, st in zip(it.shape, it.strides[0])]) // t0.element_size()
        plan.append(("tmp", mem * arg_size))
        acc_buf = ntmp
        ntmp += 1
    for sub in _split_32bit(it):
        size, sem = staging_sizes(sub, arg_size, in_dtype.itemsize, sms, max_threads_sm)
        if size:
            plan += [("tmp", size), ("tmp", sem), ("free", ntmp + 1), ("free", ntmp)]
            ntmp += 2
    if acc_buf is not None:
        plan.append(("free", acc_buf))
    plan += [("free", j) for j in range(ntmp) if j != acc_buf and ("free", j) not in plan]
    return plan


def _dense(x: torch.Tensor) -> bool:
    """``is_non_overlapping_and_dense``: some permutation of `x` is contiguous."""
    order = sorted(range(x.dim()), key=lambda d: x.stride(d))
    expected = 1
    for d in order:
        if x.size(d) != 1 and x.stride(d) != expected:
            return False
        expected *= x.size(d)
    return True


def _split_32bit(it: Iter) -> list[Iter]:
    """``TensorIteratorBase::with_32bit_indexing`` (``SplitUntil32Bit``): the pieces in launch order."""
    pieces: list[Iter] = []
    stack = [it]
    while stack:
        while not stack[-1].can_use_32bit_indexing():
            top = stack[-1]
            stack.append(top.split(top.dim_to_split()))
        pieces.append(stack.pop())
    return pieces
