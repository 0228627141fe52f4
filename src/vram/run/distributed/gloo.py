"""``ProcessGroupGloo`` in a simulated run: the ``cpu`` half of ``"cpu:gloo,cuda:nccl"`` and
plain ``init_process_group("gloo")`` (``torch/csrc/distributed/c10d/ProcessGroupGloo.cpp``).

A real Gloo group connects to every other rank through the store when it is built, and each
rank is its own process here that no other rank answers: it would wait forever. Gloo's
collectives run on host tensors, which hold real values in a simulated run and take no GPU
memory; so this group moves no data and computes each output as if every rank held this
rank's values, as `vram.run.distributed.process_group` assumes for NCCL (all-reduce SUM:
``world`` times the value; all-gather: ``world`` copies; broadcast: unchanged). A host tensor
cannot be marked unknown, so these values are written even where they are only assumed.
Point-to-point messages carry the sender's real values under the launcher (`.p2p`).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from .p2p import post, take
from .process_group import Options, SimProcessGroup, SimWork, _reduction

__all__ = ["SimProcessGroupGloo"]


def _host(tensors: list[torch.Tensor], what: str) -> None:
    for t in tensors:
        if t.device.type != "cpu":
            raise NotImplementedError(f"vram run: gloo's {what} on a CUDA tensor is not simulated "
                                      "(the nccl backend is, for CUDA tensors)")


class SimProcessGroupGloo(SimProcessGroup):
    """``ProcessGroupGloo(store, rank, size, timeout)`` on host tensors (see the module doc)."""

    nccl = False

    def __init__(self, store: Any, rank: int, size: int, timeout: Any = timedelta(minutes=30)) -> None:
        super().__init__(store, rank, size, Options())
        self.options.backend = "gloo"

    @staticmethod
    def create_default_device(*args: Any, **kwargs: Any) -> Any:
        return torch._C._distributed_c10d.ProcessGroupGloo.create_default_device(*args, **kwargs)

    def getBackendName(self) -> str:  # noqa: N802 - torch's names
        return "gloo"

    def name(self) -> str:
        return "gloo"

    def __repr__(self) -> str:
        return f"<vram ProcessGroupGloo rank={self._rank} size={self._size} name={self._group_name!r}>"

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        _host(tensors, "all_reduce")
        op = _reduction(opts, self._size)
        with torch._C.DisableTorchFunction():
            for t in tensors:
                if op is not None:
                    t.copy_(op(t.clone()))
        return SimWork(tensors, [])

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        _host(tensors, "broadcast")
        return SimWork(tensors, [])

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        root = getattr(opts, "rootRank", 0) if opts is not None else 0
        return self.allreduce(tensors, opts) if root == self._rank else SimWork(tensors, [])

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: Any = None) -> SimWork:
        _host([*inputs, *output_lists[-1]], "all_gather")
        with torch._C.DisableTorchFunction():
            for outs, inp in zip(output_lists, inputs):
                for o in outs:
                    o.copy_(inp)
        return SimWork(output_lists[-1], [])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> SimWork:  # noqa: A002
        _host([output, input], "all_gather_into_tensor")
        with torch._C.DisableTorchFunction():
            output.copy_(torch.cat([input.reshape(-1)] * self._size).reshape(output.shape))
        return SimWork([output], [])

    _allgather_base = all_gather_single

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                       opts: Any = None) -> SimWork:
        _host([*outputs, *input_lists[-1]], "reduce_scatter")
        op = _reduction(opts, self._size)
        with torch._C.DisableTorchFunction():
            for out, ins in zip(outputs, input_lists):
                if op is not None:
                    out.copy_(op(ins[self._rank].clone()))
        return SimWork(outputs, [])

    def barrier(self, opts: Any = None) -> SimWork:
        return SimWork(None, [])

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> SimWork:
        _host(tensors, "send")
        post(self, tensors, dst)
        return SimWork(None, [])

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> SimWork:
        _host(tensors, "recv")
        take(self, tensors, src)
        return SimWork(tensors, [])
