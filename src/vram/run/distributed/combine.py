"""What each collective's outputs hold, from every group rank's inputs (CPU tensors), as NCCL
computes them (``torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp``; the NCCL collectives'
definitions). Each function takes ``per_rank``: for each group rank, the values it puts in
(`vram.run.distributed.exchange.contributions`; None for ranks the outputs do not depend on)
and returns the outputs' values, in the order of the outputs.

Reductions fold the ranks' tensors in rank order, elementwise, in the tensor's dtype: SUM adds
(booleans: NCCL sums them as a max, ``getNcclReduceOp``), PRODUCT multiplies (booleans: a min),
MIN and MAX compare, BAND/BOR/BXOR (Gloo's) are bitwise; AVG is NCCL's ``ncclAvg``: floating
types multiply each contribution by ``1/world`` then add (``ncclDevPreMulSum``), integers add
then divide (``ncclDevSumPostDiv``). ``PREMUL_SUM``'s factor lives in C++: not modelled (None).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Combine", "SUM", "reduce_op", "all_reduce", "broadcast", "all_gather_stacked", "all_gather_each",
           "all_gather_flat", "reduce_scatter_rows", "reduce_scatter_each", "reduce_scatter_flat",
           "all_to_all_flat", "all_to_all_each", "gather_each", "scatter_each"]

PerRank = list[list[torch.Tensor] | None]
Combine = Callable[[PerRank], list[torch.Tensor]]
Fold = Callable[[list[torch.Tensor]], torch.Tensor]


def _avg(vs: list[torch.Tensor]) -> torch.Tensor:
    if vs[0].is_floating_point() or vs[0].is_complex():
        return functools.reduce(torch.add, [v * (1.0 / len(vs)) for v in vs]).to(vs[0].dtype)
    return torch.div(functools.reduce(torch.add, vs), len(vs), rounding_mode="trunc").to(vs[0].dtype)


def _fold(f: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Fold:
    return lambda vs: functools.reduce(f, vs)


SUM = _fold(torch.add)


def reduce_op(opts: Any) -> Fold | None:
    """The fold of ``opts.reduceOp`` over the ranks' tensors (see the module doc); None: not modelled."""
    op = getattr(opts, "reduceOp", None) if opts is not None else None
    op = getattr(op, "op", dist.ReduceOp.SUM)  # ReduceOp -> its RedOpType (``in`` needs the enum)
    R = dist.ReduceOp
    if op == R.SUM:
        return SUM                  # booleans: logical or, NCCL's max
    if op == R.PRODUCT:
        return _fold(torch.mul)     # booleans: logical and, NCCL's min
    if op == R.MIN:
        return _fold(torch.minimum)
    if op == R.MAX:
        return _fold(torch.maximum)
    if op == R.AVG:
        return _avg
    if op == R.BAND:
        return _fold(torch.bitwise_and)
    if op == R.BOR:
        return _fold(torch.bitwise_or)
    if op == R.BXOR:
        return _fold(torch.bitwise_xor)
    return None


def _rows(per_rank: PerRank, i: int) -> list[torch.Tensor]:
    return [p[i] for p in per_rank if p is not None]


def all_reduce(fold: Fold, n: int) -> Combine:
    """Each of `n` tensors: the fold of every rank's."""
    return lambda per_rank: [fold(_rows(per_rank, i)) for i in range(n)]


def broadcast(root: int) -> Combine:
    """The root's tensors."""
    return lambda per_rank: list(per_rank[root] or [])


def all_gather_stacked(per_rank: PerRank) -> list[torch.Tensor]:
    """One ``[world, *shape]`` tensor of every rank's input (``newLikeFlat``)."""
    return [torch.stack(_rows(per_rank, 0))]


def all_gather_each(per_rank: PerRank) -> list[torch.Tensor]:
    """One output per rank: its input (uneven sizes: one broadcast per rank)."""
    return _rows(per_rank, 0)


def all_gather_flat(shapes: Sequence[torch.Size]) -> Combine:
    """Each output: every rank's input, one after the other (``_allgather_base``)."""
    return lambda per_rank: [torch.cat([r.reshape(-1) for r in _rows(per_rank, i)]).reshape(s)
                             for i, s in enumerate(shapes)]


def reduce_scatter_rows(fold: Fold, me: int) -> Combine:
    """From ``[world, *shape]`` inputs: the fold of every rank's row `me`."""
    return lambda per_rank: [fold([p[0][me] for p in per_rank if p is not None])]


def reduce_scatter_each(fold: Fold, me: int) -> Combine:
    """From a list of inputs, one per rank: the fold of every rank's input number `me`."""
    return lambda per_rank: [fold([p[me] for p in per_rank if p is not None])]


def reduce_scatter_flat(fold: Fold, me: int, world: int, shapes: Sequence[torch.Size]) -> Combine:
    """Each output: the fold of every rank's chunk `me` of its flattened input."""
    return lambda per_rank: [fold([r.reshape(-1).chunk(world)[me].reshape(s) for r in _rows(per_rank, i)])
                             for i, s in enumerate(shapes)]


def all_to_all_flat(me: int, shape: torch.Size) -> Combine:
    """``alltoall_base``: every rank's input ``[tensor, input split sizes]`` (empty sizes: equal
    chunks of dimension 0); the output: each rank's split `me`, in rank order."""
    def combine(per_rank: PerRank) -> list[torch.Tensor]:
        parts = []
        for p in per_rank:
            assert p is not None
            t, splits = p[0], [int(s) for s in p[1].tolist()]
            chunks = t.split(splits) if splits else t.chunk(len(per_rank))
            parts.append(chunks[me])
        return [torch.cat(parts).reshape(shape)]
    return combine


def all_to_all_each(me: int) -> Combine:
    """``alltoall`` of lists: output `j` is rank j's input number `me`."""
    return lambda per_rank: [p[me] for p in per_rank if p is not None]


def gather_each(per_rank: PerRank) -> list[torch.Tensor]:
    """At the root: one output per rank, its input."""
    return _rows(per_rank, 0)


def scatter_each(root: int, me: int) -> Combine:
    """The root's input number `me`."""
    return lambda per_rank: [(per_rank[root] or [])[me]]
