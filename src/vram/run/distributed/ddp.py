"""What ``DistributedDataParallel``'s C++ helpers do on simulated GPUs, where they would read
values another rank sent (``torch/csrc/distributed/c10d/reducer.cpp``)."""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["refuse_local_used_map", "verify_params_across_processes"]


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


def refuse_local_used_map(ddp: Any, put: Any) -> None:
    """Where the PrivateUse1 engine runs without its C++ hooks (`vram.run.engine.native`), refuse
    DDP's ``find_unused_parameters=True`` and ``static_graph`` at once: the Reducer's
    ``all_reduce_local_used_map`` (reducer.cpp) copies the used-parameter map through a *pinned*
    host tensor when the parameters are CUDA or PrivateUse1 tensors and asserts ``is_pinned()``,
    and Python hooks have no pinned-memory allocator (``getPinnedMemoryAllocator``/``isPinnedPtr``
    are not among the hooks torch/csrc/acc/Module.cpp lets Python implement), so the first
    backward would fail in C++."""
    from vram.run.engine import EngineLimit, native

    if native.loaded():
        return
    init = ddp.__init__
    why = ("vram run: DDP's {} copies its used-parameter map through pinned host memory (reducer.cpp "
           "all_reduce_local_used_map), which needs the engine's C++ hooks: " + native.why_not())

    def ddp_init(self: Any, *args: Any, **kwargs: Any) -> None:
        import inspect

        bound = inspect.signature(init).bind(self, *args, **kwargs)
        if bound.arguments.get("find_unused_parameters"):
            raise EngineLimit(why.format("find_unused_parameters=True"))
        init(self, *args, **kwargs)

    def set_static_graph(self: Any) -> None:
        raise EngineLimit(why.format("static_graph"))

    put(ddp, "__init__", ddp_init)
    put(ddp, "_set_static_graph", set_static_graph)
