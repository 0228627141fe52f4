"""``ProcessGroupGloo`` in a simulated run: the ``cpu`` half of ``"cpu:gloo,cuda:nccl"`` and
plain ``init_process_group("gloo")`` (``torch/csrc/distributed/c10d/ProcessGroupGloo.cpp``).

A real Gloo group connects to every other rank through the store when it is built, and each
rank is its own process here that no other rank answers: it would wait forever. Gloo's
collectives run on host tensors, which hold real values in a simulated run and take no GPU
memory; their values are computed as for NCCL's (`vram.run.distributed.process_group`): every
rank's inputs under the launcher (`.exchange`), else as if every rank held this rank's. A host
tensor cannot be marked unknown: outputs that cannot be known keep the bytes they held.
Point-to-point messages carry the sender's real values under the launcher (`.p2p`).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from . import combine
from .p2p import post, take
from .process_group import Options, SimProcessGroup, SimWork, _sim

__all__ = ["SimProcessGroupGloo"]


#: the groups ``_new_process_group_helper`` is building: (backend, global ranks in the group)
BUILDING: list[tuple[str, list[int]]] = []


def _host(pg: SimProcessGroupGloo, tensors: list[torch.Tensor], what: str) -> None:
    if pg.mixed:
        return
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
        spec, ranks = BUILDING[-1] if BUILDING else ("gloo", [])
        self.options.global_ranks_in_group = ranks
        # "cpu:gloo,cuda:nccl": torch keeps this first backend as the whole group
        # (``_new_process_group_helper`` stops at a ProcessGroup subclass), so it serves CUDA too
        self.mixed = "nccl" in spec

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device("cpu"), torch.device("cuda")] if self.mixed else [torch.device("cpu")]

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
        _host(self, tensors, "all_reduce")
        return super().allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        _host(self, tensors, "broadcast")
        return super().broadcast(tensors, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        _host(self, tensors, "reduce")
        return super().reduce(tensors, opts)

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: Any = None) -> SimWork:
        _host(self, [*inputs, *output_lists[-1]], "all_gather")
        return super().allgather(output_lists, inputs, opts)

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> SimWork:
        _host(self, [*outputs, *inputs], "all_gather_into_tensor")
        return super().all_gather_single_coalesced(outputs, inputs, opts)

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                       opts: Any = None) -> SimWork:
        _host(self, [*outputs, *input_lists[-1]], "reduce_scatter")
        return super().reduce_scatter(outputs, input_lists, opts)

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> SimWork:
        _host(self, [*inputs, *(output_lists[-1] if output_lists else [])], "gather")
        return super().gather(output_lists, inputs, opts)

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None) -> SimWork:
        _host(self, [*outputs, *(input_lists[-1] if input_lists else [])], "scatter")
        return super().scatter(outputs, input_lists, opts)

    def barrier(self, opts: Any = None) -> SimWork:
        """Gloo's barrier: every rank reaches it (under the launcher this rank waits for them)."""
        t = torch.zeros(1)
        return self._collective([t], [t], False, kind="barrier", value=combine.all_reduce(combine.SUM, 1))

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> SimWork:
        if self.mixed and _sim().block_of(tensors[0]) is not None:
            return super().send(tensors, dst, tag)
        _host(self, tensors, "send")
        post(self, tensors, dst)
        return SimWork(None, [])

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> SimWork:
        if self.mixed and _sim().block_of(tensors[0]) is not None:
            return super().recv(tensors, src, tag)
        _host(self, tensors, "recv")
        take(self, tensors, src)
        return SimWork(tensors, [])
