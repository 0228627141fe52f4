"""What ``DistributedDataParallel``'s C++ helpers do on simulated GPUs, where they would read
values another rank sent (``torch/csrc/distributed/c10d/reducer.cpp``)."""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["verify_params_across_processes"]


def verify_params_across_processes(process_group: Any, params: list[torch.Tensor], logger: Any = None) -> None:
    """``c10d::verify_params_across_processes`` with its allocations and collectives: the parameter
    count (``at::tensor({n}, long)`` on ``params[0]``'s device, ``world`` ``empty_like`` outputs,
    an all-gather waited for), then every parameter's sizes and strides (built on the host,
    ``clone().to(device)``, broadcast from rank 0, waited for). Each rank runs its own copy of the
    script, so the other ranks' counts and shapes are this rank's: the checks pass, as they do
    on a GPU when every rank builds the same model."""
    device = params[0].device
    count = torch.tensor([len(params)], dtype=torch.long, device=device)
    gathered = [torch.empty_like(count) for _ in range(process_group.size())]
    process_group.allgather([gathered], [count]).wait()
    sizes: list[int] = []
    for t in params:
        sizes.extend(t.size())
        sizes.extend(t.stride())
    metadata = torch.tensor(sizes, dtype=torch.long)
    metadata_dev = metadata.clone().to(device)
    process_group.broadcast([metadata_dev]).wait()
    del count, gathered, metadata_dev
