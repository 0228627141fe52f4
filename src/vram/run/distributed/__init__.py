"""Layer 4: many simulated GPUs for ``vram run``: ``torch.distributed`` with the
``nccl`` backend on simulated GPUs, one process per rank.

* `install` (called by `vram.run.runtime.simulated_cuda`) makes ``init_process_group("nccl")``
  (also ``"cuda:nccl"``, ``"cpu:gloo,cuda:nccl"``, ``init_device_mesh("cuda", ...)``) build a
  `process_group.SimProcessGroup`: ``is_nccl_available()`` is True and ``ProcessGroupNCCL`` is
  vram's. Rendezvous (``env://``, ``tcp://``) keeps PyTorch's parsing, checks and messages
  (``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` must be set) but its store is an
  in-process ``HashStore``: no rank waits for another, since each is simulated on its own.
* ``ProcessGroupGloo`` (``"gloo"``, and the group of ``"cpu:gloo,cuda:nccl"``) is
  `gloo.SimProcessGroupGloo`: host tensors (and CUDA ones as NCCL's, for the mixed group).
* A collective's values are every launched rank's (`exchange`, `combine`), else as if every
  rank held this rank's.
* `vram.run.distributed.launcher` is ``torchrun`` for simulated GPUs (``vram run
  --nproc-per-node N``): one process per rank, the torchrun environment, a per-rank summary.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from vram.devices.nccl import VERSION as NCCL_VERSION
from vram.frontend import memory as _memory
from vram.run.cuda.on_import import when_imported
from vram.run.cuda.stand_ins import attribute_patches
from vram.run.memory.storages import SimState

__all__ = ["install", "current_sim"]

_SIMS: list[SimState] = []


def current_sim() -> SimState:
    """The state of the simulation the process groups charge (the innermost `install`)."""
    if not _SIMS:
        raise RuntimeError("vram's ProcessGroupNCCL is used outside a simulated run")
    return _SIMS[-1]


def install(sim: SimState, device_for: Callable[[int], Any]) -> Callable[[], None]:
    """Make ``torch.distributed``'s ``nccl`` backend vram's; returns the function that undoes it.
    `device_for` maps a CUDA index to where the engine keeps that GPU's tensors (the function
    mode's ``device_for``)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    import torch.distributed.rendezvous  # noqa: F401 - the module; the package's name is a function
    from torch.distributed import HashStore

    from . import nccl
    from .ddp import refuse_local_used_map, verify_params_across_processes
    from .dtensor import device_state_on, rebuild_on_meta
    from .functional import overrides, wrapper_override
    from .gloo import BUILDING
    from .rank import stage_snapshots
    from .wrappers import make_wrapper_subclass

    rdzv = sys.modules["torch.distributed.rendezvous"]

    put, undo = attribute_patches()

    def create_store(hostname: str, port: int, rank: int, world_size: int, timeout: Any,
                     use_libuv: bool = True) -> Any:
        if not 0 <= port < 2**16:  # rendezvous.py's own check, kept
            raise ValueError(f"port must have value from 0 to 65535 but was {port}.")
        return HashStore()

    _patch_backends(put)
    put(rdzv, "_create_c10d_store", create_store)
    helper = c10d._new_process_group_helper

    def new_process_group_helper(group_size: int, group_rank: int, global_ranks_in_group: list[int],
                                 backend: Any, *args: Any, **kwargs: Any) -> Any:
        """The helper, telling the Gloo group it builds its backend string and global ranks
        (NCCL's options carry them; Gloo's constructor is not given them)."""
        BUILDING.append((str(backend), list(global_ranks_in_group)))
        try:
            return helper(group_size, group_rank, global_ranks_in_group, backend, *args, **kwargs)
        finally:
            BUILDING.pop()
    put(c10d, "_new_process_group_helper", new_process_group_helper)
    put(dist, "_verify_params_across_processes", verify_params_across_processes)
    if device_for(0).type != "meta":  # the PrivateUse1 engine
        refuse_local_used_map(torch.nn.parallel.DistributedDataParallel, put)
    batch = coalesced_p2p(c10d.batch_isend_irecv)
    put(c10d, "batch_isend_irecv", batch)
    put(dist, "batch_isend_irecv", batch)
    nccl.reset()   # this run's communicators only

    def patch_schema(schema: Any) -> None:
        put(schema, "_rebuild_tensor_from_dtensor_meta", rebuild_on_meta(schema._rebuild_tensor_from_dtensor_meta))

    def patch_random(dtensor_random: Any) -> None:
        tracker = dtensor_random.OffsetBasedRNGTracker
        put(tracker, "_get_device_state", device_state_on(tracker._get_device_state, device_for))
    # DTensor's modules (a second to import: sympy) are patched when the script imports them
    waiting = [when_imported("torch.distributed.tensor._op_schema", patch_schema),
               when_imported("torch.distributed.tensor._random", patch_random)]
    put(torch.Tensor, "_make_wrapper_subclass", make_wrapper_subclass(torch.Tensor._make_wrapper_subclass, device_for))
    staged = stage_snapshots(_memory._dump_snapshot)  # a launched rank: dumps wait for the launcher
    if staged is not None:
        import torch.cuda.memory
        put(torch.cuda.memory, "_dump_snapshot", staged)
    _SIMS.append(sim)
    sim.ops.update(ops := overrides(sim))
    waiting.append(when_imported("torch.distributed._functional_collectives",
                                 lambda module: _add_ops(sim, ops, wrapper_override(module))))

    def restore() -> None:
        for op in ops:
            sim.ops.pop(op, None)
        if dist.is_initialized():
            dist.destroy_process_group()
        _SIMS.remove(sim)
        for cancel in waiting:
            cancel()
        undo()

    return restore


def _add_ops(sim: SimState, ops: dict[Any, Any], more: dict[Any, Any]) -> None:
    """`more` overrides in the run's table and in `ops`, the run's own (removed at its end)."""
    ops.update(more)
    sim.ops.update(more)


def _patch_backends(put: Callable[[Any, str, Any], None]) -> None:
    """The ``nccl`` and ``gloo`` backends as vram's process groups, and what a CUDA build's
    ``torch.distributed`` says of NCCL (available, its version, its default timeout)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.c10d_logger as c10d_logger
    import torch.distributed.distributed_c10d as c10d

    from .gloo import SimProcessGroupGloo
    from .process_group import SimProcessGroup

    put(c10d, "ProcessGroupNCCL", SimProcessGroup)
    put(c10d, "ProcessGroupGloo", SimProcessGroupGloo)   # would wait for the other ranks' processes
    put(dist, "ProcessGroupGloo", SimProcessGroupGloo)
    # c10d_logger's exception wrapper builds a debug-log dict that asks a CPU build for its NCCL
    # version, and the AttributeError buries the collective's own error: log without it
    put(c10d_logger, "_get_msg_dict", lambda func_name, *args, **kwargs: {"func_name": func_name})
    put(dist, "ProcessGroupNCCL", SimProcessGroup)
    put(c10d, "is_nccl_available", lambda: True)
    put(dist, "is_nccl_available", lambda: True)
    put(c10d, "_NCCL_AVAILABLE", True)
    # torch.cuda.nccl.version() (torchtune's and FSDP's bf16 checks): NCCL_MAJOR << 32 | NCCL_MINOR << 16
    # | NCCL_PATCH (torch/csrc/cuda/nccl.cpp ``version``), of the NCCL release vram models
    major, minor, patch = NCCL_VERSION
    put(torch._C, "_nccl_version", lambda: major << 32 | minor << 16 | patch)
    put(torch._C, "_nccl_version_suffix", lambda: b"")
    # torch/distributed/constants.py: a CUDA build's ``_DEFAULT_PG_NCCL_TIMEOUT``
    # (``kProcessGroupNCCLDefaultTimeout``, 10 minutes); a CPU build has None, and
    # ``_get_default_timeout("nccl")`` warned "NCCL support is not compiled" in every run
    put(c10d, "default_pg_nccl_timeout", timedelta(minutes=10))


def coalesced_p2p(original: Callable[..., Any]) -> Callable[..., Any]:
    """``batch_isend_irecv`` taking PyTorch's NCCL branch for vram's process groups: torch asks
    ``type(group) is ProcessGroup``, which a ``ProcessGroup`` subclass fails, and would send each
    operation alone (a two-rank communicator per pair, one Work each). The branch, as in
    ``distributed_c10d.py``: the operations inside ``_coalescing_manager`` (``startCoalescing`` /
    ``endCoalescing``), one Work for the batch."""
    import torch.distributed.distributed_c10d as c10d

    from .gloo import SimProcessGroupGloo
    from .process_group import SimProcessGroup

    def batch_isend_irecv(p2p_op_list: list[Any]) -> list[Any]:
        c10d._check_p2p_op_list(p2p_op_list)
        group = p2p_op_list[0].group or c10d._get_default_group()
        if not isinstance(group, SimProcessGroup) or isinstance(group, SimProcessGroupGloo):
            return original(p2p_op_list)
        with c10d._coalescing_manager(group, p2p_op_list[0].tensor.device, async_ops=True) as cm:
            for op in p2p_op_list:
                peer = {"group_dst" if op.op is c10d.isend else "group_src": op.group_peer}
                op.op(op.tensor, group=op.group, tag=op.tag, **peer)
        return cm.works
    return batch_isend_irecv
