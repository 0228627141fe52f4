"""cuFFT on the simulated GPU: what ``torch.fft`` allocates through the caching allocator (layer 4;
needs torch).

Read from ``aten/src/ATen/native/cuda/SpectralOps.cpp`` and ``CuFFTPlanCache.h``:

* ``_fft_c2c``: the output, then one ``_exec_fft`` per group of at most three dims (more dims need
  a second buffer: not modelled, named).
* ``_fft_r2c``: the output; a contiguous copy of an input not aligned as a complex one would be
  (``complex_aligned``); on the optimized path (``use_optimized_cufft_path``: at most three dims,
  not starting with (0, 1)) one ``_exec_fft``. Otherwise the last dim's R2C writes into a first
  buffer, a second one of the same size is made (the returned output) and the remaining dims'
  C2C transforms write into it; the first dies on return (two-sided results on that path: named).
* ``_fft_c2r``: the output, then a contiguous clone of the input ("Complex to real FFTs may overwrite
  the input buffer", gh-34551), or on the other path the C2C transforms of all but the last dim.
* ``_exec_fft``: the input permuted batch-first and reshaped to one batch dim (a copy when that is
  not a view), cloned when cuFFT cannot embed its strides (``as_cufft_embed``: a non-positive inner
  stride, a zero batch stride, a signal stride not a multiple of the next inner one; float16 with
  an inner stride ≠ 1), replacing the reshaped copy; then the plan's workspace
  (``at::empty({config->workspace_size()})``), whose size cuFFT reports when it makes the plan
  (``cufftXtMakePlanMany``): a CPU machine cannot ask it, so it is not charged and the run names
  such calls (`WORKSPACE`). Plans live in a per-device LRU cache (``CuFFTParamsLRUCache``, 4096 by
  default) and hold no caching-allocator memory (auto-allocation is off).
* Half precision (``CuFFTConfig``): a compute capability of at least 5.3 and power-of-two signal
  sizes (the two-sided size of each transformed dim of one ``_exec_fft``), else CUDA refuses when
  it makes the plan; the refusal is raised here with CUDA's message. (``torch.fft``'s composites
  reach these kernels with half inputs through `vram.run.kernels.cufft_half`.)
"""
from __future__ import annotations

from typing import Any

import torch

WORKSPACE = ("cuFFT plan workspaces (torch.fft on CUDA: SpectralOps.cpp _exec_fft allocates "
             "config->workspace_size() bytes per transform, a size cuFFT reports when it makes the "
             "plan), freed within the call")
UNMODELLED = ("cuFFT transforms of more than three dims, or two-sided real-to-complex ones with dims "
              "starting at (0, 1) (SpectralOps.cpp: intermediate buffers not modelled)")
_MAX_NDIM = 3  # cufft_max_ndim
_HALF = (torch.float16, torch.complex32)


def optimized_path(dims: list[int]) -> bool:
    """``use_optimized_cufft_path``: at most three dims, not starting with (0, 1)."""
    return not (len(dims) > _MAX_NDIM or (len(dims) >= 2 and dims[0] == 0 and dims[1] == 1))


def _must_clone(strides: list[int], sizes: list[int], onesided: bool) -> bool:
    """``as_cufft_embed``'s ``must_clone`` for a batched layout (batch dim first)."""
    n = len(strides) - 1
    last = strides[n]
    if last <= 0 or (sizes[0] != 1 and strides[0] == 0):
        return True
    for i in range(n - 1, 0, -1):
        if sizes[i] == 1:
            continue
        if strides[i] > 0 and strides[i] % last == 0:
            last = strides[i]
        else:
            return True
    return False


def _exec(x: torch.Tensor, dims: list[int], out_sizes: list[int], c2r: bool) -> list[int]:
    """Bytes ``_exec_fft`` allocates before its workspace, in order: the reshaped input's copy
    (when the batch dims do not collapse to a view), the clone cuFFT's layout rules ask for."""
    batch = sorted((d for d in range(x.dim()) if d not in dims), key=lambda d: -x.stride()[d])
    p = x.permute(*batch, *dims)
    shape = [-1, *p.shape[len(batch):]]
    taken: list[int] = []
    try:
        r = p.view(shape)
    except RuntimeError:
        r = p.reshape(shape)
        taken.append(r.numel() * r.element_size())
    signal = [r.shape[0]] + [max(r.shape[i + 1], out_sizes[d]) for i, d in enumerate(dims)]
    if x.dtype in _HALF and any(n & (n - 1) for n in signal[1:]):
        raise RuntimeError("cuFFT only supports dimensions whose sizes are powers of two when computing in half "
                           f"precision, but got a signal size of{signal[1:]}")
    clone = x.dtype in _HALF and r.stride(-1) != 1
    if clone or _must_clone(list(r.stride()), signal, c2r):
        taken.append(r.numel() * r.element_size())
    return taken


def _exec_steps(plan: list[tuple[str, Any]], held: list[int], x: torch.Tensor, dims: list[int],
                out_sizes: list[int], c2r: bool) -> None:
    """One ``_exec_fft``: its copies (a clone replaces the reshaped copy at once), the workspace
    note, the copies dying when it returns. `held` counts the plan's temporaries."""
    taken = _exec(x, dims, out_sizes, c2r)
    mine = []
    for nbytes in taken:
        plan.append(("tmp", nbytes))
        mine.append(held[0])
        held[0] += 1
    if len(mine) == 2:  # input = input.clone(): the reshaped copy goes as the clone arrives
        plan.append(("free", mine.pop(0)))
    plan.append(("note", WORKSPACE))
    plan += [("free", i) for i in mine]


def _dims(arg: Any, ndim: int) -> list[int]:
    return [int(d) % ndim for d in arg]


def fft_plan(name: str, args: tuple[Any, ...], outs: list[Any],
             cc: tuple[int, int] = (9, 0)) -> list[tuple[str, Any]] | None:
    """The allocation order of ``_fft_c2c`` / ``_fft_r2c`` / ``_fft_c2r`` on CUDA (`module
    docstring`) on a GPU of compute capability `cc`; None for other ops."""
    if name not in ("_fft_c2c", "_fft_r2c", "_fft_c2r") or len(args) < 4 or len(outs) != 1:
        return None
    x, out = args[0], outs[0]
    if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor) or x.numel() == 0:
        return None
    dims = _dims(args[1], x.dim())
    if not dims:
        return None
    if x.dtype in _HALF and cc < (5, 3):
        raise RuntimeError("cuFFT doesn't support signals of half type with compute capability less than SM_53, "
                           f"but the device containing input half tensor only has SM_{cc[0]}{cc[1]}")
    plan: list[tuple[str, Any]] = []
    held = [0]
    if name == "_fft_c2c":
        if len(dims) > _MAX_NDIM:
            return [("out", 0), ("note", UNMODELLED)]
        plan.append(("out", 0))
        _exec_steps(plan, held, x, dims, list(out.shape), False)
        return plan
    if name == "_fft_c2r":
        return _c2r_plan(x, out, dims)
    return _r2c_plan(x, out, dims, bool(args[3]))


def _c2r_plan(x: torch.Tensor, out: torch.Tensor, dims: list[int]) -> list[tuple[str, Any]]:
    """``_fft_c2r_cufft``: output, the clone (or the C2C result of all but the last dim), the C2R."""
    plan: list[tuple[str, Any]] = [("out", 0), ("tmp", x.numel() * x.element_size())]
    held = [1]
    temp = x.contiguous()
    if not optimized_path(dims) and len(dims) > 1:  # temp = _fft_c2c(self, dims[:-1]): its own exec
        if len(dims) - 1 > _MAX_NDIM:
            return [("out", 0), ("note", UNMODELLED)]
        _exec_steps(plan, held, x, dims[:-1], list(x.shape), False)
        last = [dims[-1]]
    else:
        last = dims if optimized_path(dims) else [dims[-1]]
    _exec_steps(plan, held, temp, last, list(out.shape), True)
    plan.append(("free", 0))
    return plan


def _r2c_plan(x: torch.Tensor, out: torch.Tensor, dims: list[int], onesided: bool) -> list[tuple[str, Any]]:
    """``_fft_r2c_cufft``: output, the alignment copy, the transforms (`module docstring`)."""
    aligned = (x.storage_offset() * x.element_size()) % (2 * x.element_size()) == 0
    copy = [] if aligned else [("tmp", x.numel() * x.element_size())]
    work = x if aligned else x.movedim(dims[-1], -1).contiguous().movedim(-1, dims[-1])
    if optimized_path(dims):
        plan: list[tuple[str, Any]] = [("out", 0), *copy]
        _exec_steps(plan, [len(copy)], work, dims, list(out.shape), False)
        return plan + [("free", 0)] * len(copy)
    if not onesided or len(dims) - 1 > _MAX_NDIM:
        return [("out", 0), ("note", UNMODELLED)]
    first = out.numel() * out.element_size()
    plan = [("tmp", first), *copy]  # 0: the buffer the last dim's R2C writes; 1: the copy
    held = [len(plan)]
    _exec_steps(plan, held, work, [dims[-1]], list(out.shape), False)
    plan.append(("out", 0))  # working_tensor = at::empty(out_sizes): the copy dies with the old value
    plan += [("free", 1)] * len(copy)
    _exec_steps(plan, held, out, dims[:-1], list(out.shape), False)
    return plan + [("free", 0)]
