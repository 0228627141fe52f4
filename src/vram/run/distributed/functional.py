"""The functional collectives (``torch.ops._c10d_functional``, behind DTensor's redistributions,
torchtitan and ``torch.distributed._functional_collectives``) on simulated GPUs, as their CUDA
kernels run them (``torch/csrc/distributed/c10d/Functional.cpp``, ``Work.cpp``): their Meta
kernels allocate the outputs but never reach a process group, so a program whose only
collectives were functional created no NCCL communicator, and ``wait_tensor`` / the
``AsyncCollectiveTensor`` wrapper made copies (``empty_like``) a GPU does not.

What ``Functional.cpp`` does, kept here op for op:

* **Outputs** are allocated on the *current* stream before the collective: ``all_reduce`` and
  ``broadcast`` clone their input (contiguous) and reduce in place; ``all_gather_into_tensor``
  allocates ``[group_size * d0, ...]``, ``reduce_scatter_tensor`` ``[d0 / group_size, ...]``,
  ``all_to_all_single`` ``[sum(output_split_sizes), ...]``; the ``_`` and ``_out`` overloads
  write the tensors given. Complex tensors go through ``view_as_real``.
* **The collective** is the group's (``resolve_process_group(group_name)``) with default options:
  ``asyncOp`` is true, so it runs on the group's NCCL stream and stashes its inputs and outputs
  until waited (`vram.run.distributed.process_group`); its communicator is created and connected
  as for any collective (`vram.run.distributed.nccl`).
* **The Work** is registered for each output's storage (``c10d::register_work``; the registry
  holds the Work, the Work its outputs). ``wait_tensor(t)`` pops the storage's Works and waits
  for each (the stash is released) and returns ``t`` itself. A tensor never waited for keeps its
  Work, and so its memory, to the end of the process, as on a GPU.
* ``_wrap_tensor_autograd(t)`` (``_maybe_wrap_tensor`` in eager) returns
  ``AsyncCollectiveTensor(t)``, a wrapper around the same storage; its fake kernel returns
  ``empty_like(t)``.
* ``_dtensor::shard_dim_alltoall`` (DTensor's ``Shard(i) -> Shard(j)``): the input viewed as
  ``[.., group, d/group, ..]``, the group dimension moved first and made contiguous, an
  ``empty_like`` receive buffer, ``alltoall_base`` waited for at once, then the group dimension
  moved to ``gather_dim`` and made contiguous.

Tensors no simulated GPU holds (a Gloo group's host tensors) take the op's own kernel.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vram.run.memory.storages import SimState

__all__ = ["overrides"]

#: ``to_reduce_op`` of Functional.cpp (``premul_sum`` is not supported there either)
_REDUCE_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor")


class _Registry:
    """``WorkRegistry`` (``Work.cpp``): the Works registered for each storage, until waited."""

    def __init__(self) -> None:
        self.works: dict[int, list[Any]] = {}

    def register(self, t: torch.Tensor, work: Any) -> None:
        works = self.works.setdefault(t.untyped_storage()._cdata, [])
        if not any(w is work for w in works):
            works.append(work)

    def wait(self, t: torch.Tensor) -> torch.Tensor:
        for work in self.works.pop(t.untyped_storage()._cdata, []):
            work.wait()
        return t


def _opts(kind: str, reduce_op: str | None = None, root: int | None = None) -> Any:
    """Default ``c10d`` options of `kind` (``asyncOp`` true), with a reduce op or root rank."""
    import torch._C._distributed_c10d as c10d
    import torch.distributed as dist

    opts = getattr(c10d, kind)()
    if reduce_op is not None:
        if reduce_op not in _REDUCE_OPS:
            raise RuntimeError(f"Unrecognized reduce_op: {reduce_op}")
        opts.reduceOp = dist.ReduceOp(getattr(dist.ReduceOp.RedOpType, reduce_op.upper()))
    if root is not None:
        opts.rootRank = root
    return opts


def _group(name: str) -> Any:
    from torch.distributed.distributed_c10d import GroupName, _resolve_process_group
    return _resolve_process_group(GroupName(name))


def _contiguous(t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise RuntimeError("Expected input.is_contiguous() to be true, but got false.")


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


def _as(like: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_complex(t) if like.is_complex() else t


class FunctionalCollectives:
    """The ``_c10d_functional`` ops as ``Functional.cpp`` runs them on a CUDA group: outputs
    allocated on the current stream, the group's asynchronous collective, and the registry that
    keeps an unwaited output's work (and so its tensors) alive until ``wait_tensor``."""

    def __init__(self) -> None:
        self.registry = _Registry()

    def all_reduce_(self, t: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
        work = _group(group_name).allreduce([_real(t)], _opts("AllreduceOptions", reduce_op))
        self.registry.register(t, work)
        return t

    def all_reduce(self, t: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
        out = _real(t).clone(memory_format=torch.contiguous_format)
        return _as(t, self.all_reduce_(out, reduce_op, group_name))

    def all_reduce_coalesced_(self, ts: list[torch.Tensor], reduce_op: str, group_name: str) -> list[torch.Tensor]:
        work = _group(group_name).allreduce_coalesced(ts, _opts("AllreduceCoalescedOptions", reduce_op))
        for t in ts:
            self.registry.register(t, work)
        return ts

    def all_reduce_coalesced(self, ts: list[torch.Tensor], reduce_op: str, group_name: str) -> list[torch.Tensor]:
        outs = [t.clone(memory_format=torch.contiguous_format) for t in ts]
        return self.all_reduce_coalesced_(outs, reduce_op, group_name)

    def all_gather_coalesced(self, ts: list[torch.Tensor], group_size: int, group_name: str) -> list[torch.Tensor]:
        outs = []
        for t in ts:   # allocate_all_gather_output
            _contiguous(t)
            size = list(t.shape) or [1]
            size[0] *= group_size
            outs.append(t.new_empty(size))
        work = _group(group_name).allgather_into_tensor_coalesced(outs, ts, _opts("AllgatherOptions"))
        for o in outs:
            self.registry.register(o, work)
        return outs

    def all_gather(self, t: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
        _contiguous(t)
        return _as(t, self.all_gather_coalesced([_real(t)], group_size, group_name)[0])

    def all_gather_out(self, t: torch.Tensor, group_size: int, group_name: str, *, out: torch.Tensor) -> torch.Tensor:
        _contiguous(t)
        work = _group(group_name)._allgather_base(out, t, _opts("AllgatherOptions"))
        self.registry.register(out, work)
        return out

    def reduce_scatter_into(self, ts: list[torch.Tensor], outs: list[torch.Tensor], reduce_op: str,
                            group_name: str) -> list[torch.Tensor]:
        opts = _opts("ReduceScatterOptions", reduce_op)
        work = _group(group_name).reduce_scatter_tensor_coalesced(outs, ts, opts)
        for o in outs:
            self.registry.register(o, work)
        return outs

    def reduce_scatter_coalesced(self, ts: list[torch.Tensor], reduce_op: str, group_size: int,
                                 group_name: str) -> list[torch.Tensor]:
        _opts("ReduceScatterOptions", reduce_op)   # the reduce op is checked before allocating
        outs = []
        for t in ts:   # allocate_reduce_scatter_output
            _contiguous(t)
            size = list(t.shape)
            size[0] //= group_size
            outs.append(t.new_empty(size))
        return self.reduce_scatter_into(ts, outs, reduce_op, group_name)

    def reduce_scatter(self, t: torch.Tensor, reduce_op: str, group_size: int, group_name: str) -> torch.Tensor:
        _contiguous(t)
        return _as(t, self.reduce_scatter_coalesced([_real(t)], reduce_op, group_size, group_name)[0])

    def reduce_scatter_out(self, t: torch.Tensor, reduce_op: str, group_size: int, group_name: str, *,
                           out: torch.Tensor) -> torch.Tensor:
        _contiguous(t)
        return _as(t, self.reduce_scatter_into([_real(t)], [_real(out)], reduce_op, group_name)[0])

    def all_to_all_single(self, t: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
                          group_name: str) -> torch.Tensor:
        _contiguous(t)
        size = list(t.shape)
        size[0] = sum(int(s) for s in output_split_sizes)
        out = t.new_empty(size)
        work = _group(group_name).alltoall_base(out, t, list(output_split_sizes), list(input_split_sizes),
                                                _opts("AllToAllOptions"))
        self.registry.register(out, work)
        return out

    def broadcast_(self, t: torch.Tensor, src: int, group_name: str) -> torch.Tensor:
        work = _group(group_name).broadcast([_real(t)], _opts("BroadcastOptions", root=src))
        self.registry.register(t, work)
        return t

    def broadcast(self, t: torch.Tensor, src: int, group_name: str) -> torch.Tensor:
        return self.broadcast_(t.clone(memory_format=torch.contiguous_format), src, group_name)

    def shard_dim_alltoall(self, t: torch.Tensor, gather_dim: int, shard_dim: int, group_name: str) -> torch.Tensor:
        group = _group(group_name)
        n = group.size()
        sizes, out_sizes = list(t.shape), list(t.shape)
        sizes[shard_dim] //= n
        sizes.insert(shard_dim, n)
        shards = t.view(sizes).movedim(shard_dim, 0).contiguous()
        send = _real(shards)
        recv = torch.empty_like(send)
        group.alltoall_base(recv, send, [], [], _opts("AllToAllOptions")).wait()
        out = _as(t, recv).movedim(0, gather_dim).contiguous()
        out_sizes[shard_dim] //= n
        out_sizes[gather_dim] *= n
        return out.view(out_sizes)


def overrides(sim: SimState) -> dict[Any, Any]:
    """Op overload -> its CUDA behaviour, for `vram.run.memory.storages.SimState.ops` (run with the
    dispatch mode on, so what they allocate is charged). The ops are C++'s (Functional.cpp), but
    for `wrapper_override`'s, added once ``torch.distributed._functional_collectives`` (a fifth of
    a second to import) is."""
    c = FunctionalCollectives()
    ops = torch.ops._c10d_functional
    table: dict[Any, Callable[..., Any]] = {
        ops.all_reduce.default: c.all_reduce,
        ops.all_reduce_.default: c.all_reduce_,
        ops.all_reduce_coalesced.default: c.all_reduce_coalesced,
        ops.all_reduce_coalesced_.default: c.all_reduce_coalesced_,
        ops.all_gather_into_tensor.default: c.all_gather,
        ops.all_gather_into_tensor_out.default: c.all_gather_out,
        ops.all_gather_into_tensor_coalesced.default: c.all_gather_coalesced,
        ops.reduce_scatter_tensor.default: c.reduce_scatter,
        ops.reduce_scatter_tensor_out.default: c.reduce_scatter_out,
        ops.reduce_scatter_tensor_coalesced.default: c.reduce_scatter_coalesced,
        ops.all_to_all_single.default: c.all_to_all_single,
        ops.broadcast.default: c.broadcast,
        ops.broadcast_.default: c.broadcast_,
        torch.ops._dtensor.shard_dim_alltoall.default: c.shard_dim_alltoall,
    }

    def on_gpu(kernel: Callable[..., Any]) -> Callable[..., Any]:
        """`kernel` when the op's first tensor is on a simulated GPU; else declined (the op's own
        kernel runs, as for any op)."""
        def run(*args: Any, **kwargs: Any) -> Any:
            first = args[0][0] if isinstance(args[0], (list, tuple)) and args[0] else args[0]
            return NotImplemented if sim.block_of(first) is None else kernel(*args, **kwargs)
        return run

    result = {op: on_gpu(kernel) for op, kernel in table.items()}
    result[ops.wait_tensor.default] = on_gpu(c.registry.wait)
    return result


def wrapper_override(module: Any) -> dict[Any, Any]:
    """``_wrap_tensor_autograd``, a custom op that ``torch.distributed._functional_collectives``
    (`module`) defines, -> ``AsyncCollectiveTensor(t)``, a wrapper around the same storage."""
    wrapper = module.AsyncCollectiveTensor
    return {torch.ops._c10d_functional._wrap_tensor_autograd.default: lambda t: wrapper(t)}
