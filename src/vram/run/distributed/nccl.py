"""The NCCL communicators a simulated rank creates, and their device memory outside the caching
allocator (`vram.devices.nccl` computes the bytes), charged to the simulated GPU when PyTorch
would create or connect them, so they count toward its capacity as on a real card.

When (``ProcessGroupNCCL``, torch 2.13): a group's communicator is created at its first operation
(``getNCCLComm``/``initNCCLComm``), or at ``init_process_group``/``new_group`` when a ``device_id``
binds the group (``eagerConnectSingleDevice``; subgroups are then ``ncclCommSplit`` from the
default group, which with NCCL's default ``splitShare=0`` gives them resources of their own).
Creating it allocates NCCL's bookkeeping; its ring is connected at its first collective and a
peer at the first send to / receive from it (``NCCL_RUNTIME_CONNECT=1``). Which communicator a
send or receive uses (``ProcessGroupNCCL::pointToPoint``): the group's own inside a coalescing
batch (``batch_isend_irecv``: ``batchP2P = ncclActiveGroupCounter_ > 0``) or when the group was
eagerly initialised (``eagerInit_``: "unbatched P2P ops are treated as independent collective
ops"), else a two-rank communicator of its own keyed ``"low:high"``.

Each time a rank's communicators change, the GPU they live on is charged the change in
`nccl_memory`'s total (`vram.devices.simulated.SimulatedDevice.take_outside`), so a later
``cudaMalloc`` of the caching allocator sees less free memory, and ``mem_get_info``/NVML count it.
When it does not fit, NCCL's ``cuMemCreate`` fails and PyTorch raises its ``DistBackendError``
(``C10D_NCCL_CHECK``: ``ncclUnhandledCudaError``, NCCL's last error "Cuda failure 2 'out of
memory'"); the communicators are left as before. Where the figure is not derived (`nccl_memory`
says why) nothing is charged. ``destroy_process_group`` gives a group's memory back
(``ncclCommDestroy``), so the card's usage goes down; the rank's figure (`rank_memory`) is the
peak over time of the communicators alive together, not the sum of all it ever made.

Collectives on a communicator whose ring is already connected (and sends to a peer already
connected) change nothing and return at once: NCCL connects once (``ncclTransportRingConnect``
runs when ``comm->runtimeConn`` and the channels are not yet connected, ``src/enqueue.cc``).
"""
from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch.distributed as dist

from vram.devices.gpus import GpuPreset
from vram.devices.nccl import Communicator, NcclEnv, NcclMemory, nccl_memory, node_for
from vram.frontend import memory as _memory

__all__ = ["NcclOutOfMemoryError", "note_connect", "note_collective", "note_p2p", "note_destroy",
           "rank_figure", "rank_memory", "reset", "oom_text"]

_COMMS: dict[tuple[int, str], Communicator] = {}   # alive (destroyed ones are removed)
_WHERE: dict[tuple[int, str], int | None] = {}   # the GPU each communicator lives on
_TAKEN: dict[int, int] = {}                       # GPU -> NCCL bytes charged to it
#: the communicators alive together just before each destroy (copies), by what sizes them: the
#: candidates for the rank's peak besides those alive at the end (`rank_memory`)
_BEFORE_DESTROY: dict[tuple[Any, ...], list[Communicator]] = {}
_MADE = [0]                                       # communicators of 2+ ranks created in this run


def reset() -> None:
    _COMMS.clear()
    _WHERE.clear()
    _TAKEN.clear()
    _BEFORE_DESTROY.clear()
    _MADE[0] = 0


class NcclOutOfMemoryError(dist.DistBackendError):  # type: ignore[misc]
    """PyTorch's ``DistBackendError`` for NCCL memory that did not fit on the simulated GPU (a
    subclass, so a front end can tell it from other backend errors: a run out of memory)."""


def oom_text() -> str:
    """``C10D_NCCL_CHECK``'s text for a ``cuMemCreate`` that ran out of memory (the file, line and
    NCCL version of the real message are the build's; they are left out)."""
    return ("NCCL error in: ProcessGroupNCCL.cpp, unhandled cuda error (run with NCCL_DEBUG=INFO for details)\n"
            "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nCuda failure 2 'out of memory'")


def _global_ranks(pg: Any) -> list[int]:
    ranks = list(getattr(pg.options, "global_ranks_in_group", None) or [])
    return ranks if len(ranks) == pg.size() else list(range(pg.size()))


def _one_node(ranks: list[int]) -> bool:
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    return per_node <= 0 or len({r // per_node for r in ranks}) == 1


_GROUP_IDS = itertools.count()


def _gid(pg: Any) -> int:
    """A number for `pg` that no later group reuses (``id()`` is reused once a group is freed, and
    a new group would find a destroyed one's communicators)."""
    gid = getattr(pg, "_vram_nccl_id", None)
    if gid is None:
        gid = next(_GROUP_IDS)
        pg._vram_nccl_id = gid
    return gid


def _change(pg: Any, key: str, ranks: list[int], device: int | None, what: str = "", peer: int = -1) -> None:
    """Create (if new) `pg`'s communicator `key` on `device`, connect its ring (`what` "ring") or
    a peer (`what` "send"/"recv"), and charge the GPU the change; undone if it does not fit."""
    k = (_gid(pg), key)
    old = _COMMS.get(k)
    c = old if old is not None else Communicator(
        f"of group {pg.group_name!r}" + (f", ranks {key}" if key else ""), len(ranks), _one_node(ranks))
    saved = _copy(c)
    if what == "ring":
        c.ring = True
    elif what:
        (c.sends if what == "send" else c.recvs).add(peer)
    if old is None:
        _COMMS[k], _WHERE[k] = c, device
    try:
        _settle(_WHERE[k])
    except Exception:
        if old is None:
            del _COMMS[k], _WHERE[k]
        else:
            _COMMS[k] = saved
        raise
    if old is None and c.nranks > 1:
        _MADE[0] += 1


def _copy(c: Communicator) -> Communicator:
    """A copy of `c` that later connections leave as it is."""
    return replace(c, sends=set(c.sends), recvs=set(c.recvs))


def _connected(pg: Any, key: str, what: str, peer: int = -1) -> bool:
    """Whether `pg`'s communicator `key` exists with its ring (`what` "ring") or `peer`
    ("send"/"recv") already connected: nothing to create, connect or charge."""
    gid = getattr(pg, "_vram_nccl_id", None)
    c = _COMMS.get((gid, key)) if gid is not None else None
    if c is None:
        return False
    return c.ring if what == "ring" else peer in (c.sends if what == "send" else c.recvs)


def _settle(device: int | None) -> None:
    """Charge `device` the difference between its communicators' NCCL memory and what it holds."""
    if device is None or not 0 <= device < _memory.device_count():
        return
    from . import current_sim
    try:
        env = NcclEnv.from_environ(os.environ)
    except ValueError:   # the figure is "not derived" (rank_figure says why); nothing to charge
        return
    p = current_sim().props[device]
    live = [c for k, c in _COMMS.items() if _WHERE[k] == device]
    m = nccl_memory(live, node_for(p.name, p.major, p.minor), env)
    if m.bytes is None:
        return
    gpu, delta = _memory.get_device(device), m.bytes - _TAKEN.get(device, 0)
    if delta > 0 and not gpu.take_outside(delta):
        raise NcclOutOfMemoryError(oom_text())
    if delta < 0:
        gpu.give_outside(-delta)
    _TAKEN[device] = m.bytes


def note_connect(pg: Any, device: int) -> None:
    """``eagerConnectSingleDevice``: `pg`'s communicator is created on `device` now."""
    _change(pg, "", _global_ranks(pg), device)


def note_collective(pg: Any, device: int | None) -> None:
    """A collective ran on `pg`: its communicator exists and its ring is connected."""
    if not _connected(pg, "", "ring"):
        _change(pg, "", _global_ranks(pg), _where(pg, "", device), "ring")


def note_p2p(pg: Any, peer: int, send: bool, shared: bool, device: int | None) -> None:
    """A send to (or receive from) group rank `peer`, on the group's communicator (`shared`: in a
    batch, or the group was eagerly initialised) or on the pair's own."""
    ranks = _global_ranks(pg)
    me, other = ranks[pg.rank()], ranks[peer]
    if shared:
        key, members = "", ranks
    else:
        lo, hi = sorted((pg.rank(), peer))
        key, members = f"{lo}:{hi}", sorted({me, other})
    what = "send" if send else "recv"
    if not _connected(pg, key, what, other):
        _change(pg, key, members, _where(pg, key, device), what, other)


def _sizing(comms: list[Communicator]) -> tuple[Any, ...]:
    """What `nccl_memory` sizes a set of communicators by (names aside)."""
    return tuple(sorted((c.nranks, c.one_node, c.ring, len(c.sends), len(c.recvs)) for c in comms))


def note_destroy(pg: Any) -> None:
    """``destroy_process_group``: `pg`'s communicators are destroyed (``ncclCommDestroy``) and
    their memory given back to the card; those alive until now are kept as a candidate for the
    rank's peak."""
    keys = [k for k in _COMMS if k[0] == _gid(pg)]
    if not keys:
        return
    alive = [_copy(c) for c in _COMMS.values()]
    _BEFORE_DESTROY.setdefault(_sizing(alive), alive)
    devices = {_WHERE[k] for k in keys}
    for k in keys:
        del _COMMS[k], _WHERE[k]
    for device in devices:
        _settle(device)


def _where(pg: Any, key: str, device: int | None) -> int | None:
    """The GPU of an existing communicator, else `device` (the operation's tensors')."""
    return _WHERE.get((_gid(pg), key), device)


def rank_memory(gpu: GpuPreset, environ: Mapping[str, str] | None = None) -> NcclMemory:
    """This process's peak NCCL memory on `gpu` (the simulated card), the ``NCCL_*`` environment
    read: the largest `nccl_memory` of the communicators alive together (just before each
    destroy, and now); not derived if any of those sets is not."""
    env = NcclEnv.from_environ(os.environ if environ is None else environ)
    node = node_for(gpu.name, gpu.major, gpu.minor)
    best: tuple[NcclMemory, int] | None = None
    for comms in (*_BEFORE_DESTROY.values(), list(_COMMS.values())):
        m = nccl_memory(comms, node, env)
        if m.bytes is None:
            return m
        if best is None or m.bytes > best[0].bytes:   # type: ignore[operator]
            best = (m, len([c for c in comms if c.nranks > 1]))
    assert best is not None
    m, alive = best
    if _MADE[0] > alive and alive:
        m.lines.append(f"peak over the run: these {alive} communicator(s) alive together; {_MADE[0]} were "
                       "created in all, the others destroyed (ncclCommDestroy gave their memory back) before "
                       "or after")
    return m


def rank_figure(gpu: GpuPreset) -> dict[str, Any]:
    """`rank_memory` as the launcher's JSON: ``{"bytes": int | None, "lines": [...]}``; a bad
    ``NCCL_*`` variable makes it not derived, with the reason."""
    try:
        m = rank_memory(gpu)
    except ValueError as e:
        return {"bytes": None, "lines": [f"not derived: {e}"]}
    return {"bytes": m.bytes, "lines": m.lines}
