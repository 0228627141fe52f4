"""The NCCL communicators a simulated rank would have created, for its memory outside the caching
allocator (`vram.devices.nccl` computes the bytes).

``ProcessGroupNCCL`` creates one communicator per group and device at the group's first
operation (``getNCCLComm``); a send or receive outside a batch gets its own two-rank communicator
keyed ``"low:high"``, while one inside ``batch_isend_irecv`` (a coalescing batch, as
``torch.distributed.pipelining`` sends) uses the group's (``ProcessGroupNCCL::pointToPoint``:
``batchP2P = ncclActiveGroupCounter_ > 0``). A collective connects the communicator's ring; a
point-to-point operation connects the peer in its direction.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from vram.devices.gpus import GpuPreset
from vram.devices.nccl import Communicator, NcclEnv, NcclMemory, nccl_memory, node_for

__all__ = ["note_collective", "note_p2p", "rank_figure", "rank_memory", "reset"]

_COMMS: dict[tuple[int, str], Communicator] = {}


def reset() -> None:
    _COMMS.clear()


def _global_ranks(pg: Any) -> list[int]:
    ranks = list(getattr(pg.options, "global_ranks_in_group", None) or [])
    return ranks if len(ranks) == pg.size() else list(range(pg.size()))


def _one_node(ranks: list[int]) -> bool:
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    return per_node <= 0 or len({r // per_node for r in ranks}) == 1


def _comm(pg: Any, key: str, ranks: list[int]) -> Communicator:
    c = _COMMS.get((id(pg), key))
    if c is None:
        label = f"of group {pg.group_name!r}" + (f", ranks {key}" if key else "")
        c = _COMMS[(id(pg), key)] = Communicator(label, len(ranks),
                                                 _one_node(ranks))
    return c


def note_collective(pg: Any) -> None:
    """A collective ran on `pg`: its communicator exists and its ring is connected."""
    _comm(pg, "", _global_ranks(pg)).ring = True


def note_p2p(pg: Any, peer: int, send: bool, batched: bool) -> None:
    """A send to (or receive from) group rank `peer`, inside a batch or alone."""
    ranks = _global_ranks(pg)
    me, other = ranks[pg.rank()], ranks[peer]
    if batched:
        c = _comm(pg, "", ranks)
    else:
        lo, hi = sorted((pg.rank(), peer))
        c = _comm(pg, f"{lo}:{hi}", sorted({me, other}))
    (c.sends if send else c.recvs).add(other)


def rank_memory(gpu: GpuPreset, environ: Mapping[str, str] | None = None) -> NcclMemory:
    """This process's communicators on `gpu` (the simulated card), the ``NCCL_*`` environment read."""
    env = NcclEnv.from_environ(os.environ if environ is None else environ)
    return nccl_memory(list(_COMMS.values()), node_for(gpu.name, gpu.major, gpu.minor), env)


def rank_figure(gpu: GpuPreset) -> dict[str, Any]:
    """`rank_memory` as the launcher's JSON: ``{"bytes": int | None, "lines": [...]}``; a bad
    ``NCCL_*`` variable makes it not derived, with the reason."""
    try:
        m = rank_memory(gpu)
    except ValueError as e:
        return {"bytes": None, "lines": [f"not derived: {e}"]}
    return {"bytes": m.bytes, "lines": m.lines}
