"""What an op on a simulated GPU adds to its meta kernel, for both engines: outputs whose shape
depends on values (computed on the CPU from known values), the entries of an indexing op's known
boolean masks (`mask_counts`), and the cuBLAS workspaces a floating matmul's handle allocates on
first use (`vram.run.kernels.blas`)."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from vram.frontend import memory as _memory
from vram.run.kernels import blas as _blas
from vram.run.memory.storages import SimState
from vram.run.values import known
from vram.run.values.placeholders import describe

__all__ = ["cublas_if_device", "data_dependent", "mask_counts"]

#: indexing ops whose kernels take a boolean mask's ``nonzero()`` (``make_info``, ``index_put_with_sort``)
_MASKED_INDEXING = frozenset({"index", "index_put_", "_index_put_impl_"})
_MASKS = (torch.bool, torch.uint8)


def data_dependent(sim: SimState, func: Any, args: Any, kwargs: Any) -> tuple[Any, bool]:
    """The CPU result of an op whose output shape depends on values (``nonzero``, boolean
    masks) and whether placeholders went into it (then the shape is recorded as assumed);
    (None, False) when its inputs cannot be known."""
    used: list[Any] = []
    try:
        result = known.run_on_cpu(sim, func, args, kwargs, used)
    except Exception:  # noqa: BLE001 - unknown inputs or no CPU kernel: the caller reports it
        return None, False
    if used:
        what = describe(sim.call) if sim.call is not None else str(func)
        shapes = [list(r.shape) for r in tree_leaves(result) if isinstance(r, torch.Tensor)]
        sim.report.record(what, f"output shape {shapes[0] if len(shapes) == 1 else shapes}", derived=True)
    return result, bool(used)


def mask_counts(sim: SimState, name: str, args: Any, kwargs: Any) -> dict[int, int] | None:
    """The number of entries of each boolean mask among an indexing op's indices whose values the
    run knows (not placeholders), by position; None for other ops. The kernels' index tensors are
    that mask's ``nonzero()`` (`vram.run.kernels.indexing`), whose size no output may show
    (``x[mask] = v`` with a broadcast ``v``)."""
    if name not in _MASKED_INDEXING:
        return None
    indices = args[1] if len(args) > 1 else kwargs.get("indices")
    counts: dict[int, int] = {}
    for j, t in enumerate(indices if isinstance(indices, (list, tuple)) else ()):
        if isinstance(t, torch.Tensor) and t.dtype in _MASKS and not known.assumed(sim, t):
            value = known.cpu_value(sim, t)
            if value is not None:
                with torch._C.DisableTorchFunction():
                    counts[j] = int(torch.count_nonzero(value))
    return counts


def cublas_if_device(sim: SimState, idx: int, name: str, args: Any, kwargs: Any, out: torch.Tensor) -> None:
    """The cuBLAS workspaces of a floating matmul whose output is simulated (a host one has none)."""
    if sim.block_of(out) is not None and (out.is_floating_point() or out.is_complex()):
        _cublas(sim, idx, name, args, kwargs, out)


def _cublas(sim: SimState, idx: int, name: str, args: Any, kwargs: Any, out: torch.Tensor) -> None:
    thread = "autograd" if torch._C._current_autograd_node() is not None else "main"
    stream = _memory.current_stream(idx).cuda_stream
    p = sim.props[idx]
    size = _blas.cublas_workspace_size(p.major, p.minor)
    sim.workspace((idx, stream, thread, "cublas"), size)
    if _blas.uses_cublaslt(name, args, kwargs, out):
        lt = _blas.cublaslt_workspace_size(size)
        if lt:
            sim.workspace((idx, stream, thread, "cublaslt"), lt)
