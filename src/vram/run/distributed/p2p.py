"""Point-to-point values between launched ranks: what ``send`` puts on the wire, ``recv`` gets.

Every rank runs in its own process and no collective waits for another rank (see
`vram.run.distributed.process_group`): a collective's values are assumed from this rank's own.
Point-to-point messages cannot be assumed so: pipeline parallelism (``torch.distributed.
pipelining``) sends *metadata* between stages (``send_object_list``: a size, then the pickled
bytes, ``distributed_c10d.py``; the warm-up vote of ``stage.py``, ``_warmup_forward_vote``), and
each stage builds its receive buffers from what the previous one sent. So under the launcher a
``send`` posts the values it knows (`vram.run.values.known`; "unknown" otherwise, for activations) to
a mailbox folder shared by the rank processes, and ``recv`` takes them, waiting for the sender
as NCCL would. Messages are matched in order per (group, sender, receiver), as NCCL orders
them on one communicator. A receive from a rank that is not simulated (``--ranks``) gets unknown
values at once; from a rank that ended without sending, a clear error.

While a rank waits it says so (a ``waiting-R`` file), so the launcher can start a rank beyond
``--jobs`` that the waiting ones depend on; when every rank waits and none is left to start, the
launcher marks a deadlock (``deadlock``) and each waiting rank raises.
"""
from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["MAILBOX_ENV", "SIMULATED_ENV", "Mailbox", "P2PError", "mailbox", "exited_marker",
           "waiting_marker", "deadlock_marker", "wait_for"]

MAILBOX_ENV = "VRAM_RANK_MAILBOX"      # the folder the launched ranks share (set by the launcher)
SIMULATED_ENV = "VRAM_SIMULATED_RANKS"  # "0,2,3": the ranks the launcher simulates
T = TypeVar("T")


class P2PError(RuntimeError):
    """A receive that can never complete (its sender ended, or every rank waits)."""


def exited_marker(folder: str, rank: int) -> str:
    return os.path.join(folder, f"exited-{rank}")


def waiting_marker(folder: str, rank: int) -> str:
    return os.path.join(folder, f"waiting-{rank}")


def deadlock_marker(folder: str) -> str:
    return os.path.join(folder, "deadlock")


class Mailbox:
    """This rank's end of the shared mailbox folder."""

    def __init__(self, folder: str, rank: int, simulated: set[int]) -> None:
        self.folder, self.rank, self.simulated = folder, rank, simulated
        self._sent: Counter[tuple[str, int, int]] = Counter()
        self._received: Counter[tuple[str, int, int]] = Counter()

    def _path(self, group: str, src: int, dst: int, seq: int) -> str:
        safe = "".join(c if c.isalnum() else "_" for c in group)
        return os.path.join(self.folder, f"p2p-{safe}-{src}-{dst}-{seq}.pt")

    def post(self, group: str, dst: int, values: list[torch.Tensor | None]) -> None:
        """Send: this rank's known values of the sent tensors (None: unknown)."""
        key = (group, self.rank, dst)
        path = self._path(group, self.rank, dst, self._sent[key])
        self._sent[key] += 1
        tmp = path + ".tmp"
        torch.save(values, tmp)
        os.replace(tmp, path)  # the receiver sees the whole message or none of it

    def take(self, group: str, src: int) -> list[torch.Tensor | None] | None:
        """Receive from global rank `src`: its values (None each: unknown), or None when `src`
        is not simulated. Waits for the sender."""
        if src not in self.simulated:
            return None
        key = (group, src, self.rank)
        seq = self._received[key]
        self._received[key] += 1
        path = self._path(group, src, self.rank, seq)
        wait_for(self.folder, self.rank, src, lambda: os.path.exists(path) or None,
                 f"receives message {seq} from rank {src} (group {group!r})", "sending it")
        values: list[Any] = torch.load(path, weights_only=True)
        os.remove(path)
        return values


def wait_for(folder: str, rank: int, peer: int, ready: Callable[[], T | None], doing: str, missing: str) -> T:
    """`ready()`'s first answer that is not None, polled while rank `peer` may still give it; this
    rank says it waits (a ``waiting-R`` file) meanwhile. `doing` and `missing` word the error
    when `peer` ended first ("rank 1 `doing`, but rank 0 ended without `missing`") or every
    simulated rank waits (a deadlock)."""
    got = ready()
    delay, waiting = 0.001, False
    try:
        while got is None:
            if not waiting:
                open(waiting_marker(folder, rank), "w").close()
                waiting = True
            if os.path.exists(exited_marker(folder, peer)) and (got := ready()) is None:
                raise P2PError(f"rank {rank} {doing}, but rank {peer} ended without {missing}")
            if got is None and os.path.exists(deadlock_marker(folder)):
                raise P2PError(f"rank {rank} {doing} while every simulated rank waits: a deadlock")
            if got is None:
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
                got = ready()
    finally:
        if waiting:
            os.remove(waiting_marker(folder, rank))
    return got


_MAILBOX: list[Mailbox] = []


def mailbox() -> Mailbox | None:
    """This launched rank's mailbox, or None outside the launcher (then receives are unknown)."""
    folder = os.environ.get(MAILBOX_ENV)
    if not folder:
        return None
    rank = int(os.environ.get("RANK", "0"))
    if not _MAILBOX or _MAILBOX[0].folder != folder or _MAILBOX[0].rank != rank:
        simulated = {int(r) for r in os.environ.get(SIMULATED_ENV, "").split(",") if r.strip()}
        _MAILBOX[:] = [Mailbox(folder, rank, simulated)]
    return _MAILBOX[0]


def _endpoint(group: Any, peer: int) -> tuple[Mailbox, Any, str, int] | None:
    """(mailbox, simulation, group name, `peer`'s global rank) for a group rank, or None outside
    the launcher. Global ranks: ``Options.global_ranks_in_group`` (``_new_process_group_helper``;
    empty for the world group: the identity)."""
    box = mailbox()
    if box is None:
        return None
    from . import current_sim
    ranks = list(getattr(group.options, "global_ranks_in_group", None) or [])
    return box, current_sim(), group._group_name or "default", ranks[peer] if ranks else peer


def post(group: Any, tensors: list[torch.Tensor], dst: int) -> None:
    """``send`` under the launcher: post the known values of `tensors` for group rank `dst`."""
    end = _endpoint(group, dst)
    if end is None:
        return
    from vram.run.values import known
    box, sim, name, peer = end
    with torch._C.DisableTorchFunction():
        values = [known.cpu_value(sim, t) for t in tensors]
        values = [None if v is None or known.assumed(sim, t) else v.clone() for v, t in zip(values, tensors)]
    box.post(name, peer, values)


def take(group: Any, tensors: list[torch.Tensor], src: int) -> None:
    """``recv`` under the launcher: `tensors` hold what group rank `src` sent, where known."""
    end = _endpoint(group, src)
    if end is None:
        return
    from vram.run.values import known
    box, sim, name, peer = end
    values = box.take(name, peer)
    if values is None:
        return
    if len(values) != len(tensors):
        raise P2PError(f"rank {box.rank} receives {len(tensors)} tensor(s) from rank {peer}, which sent {len(values)}")
    for t, v in zip(tensors, values):
        if v is None:
            continue
        if v.numel() * v.element_size() != t.numel() * t.element_size():
            raise P2PError(f"rank {box.rank} receives a {t.dtype} tensor of shape {tuple(t.shape)} from rank "
                           f"{peer}, which sent {v.dtype} {tuple(v.shape)}: NCCL needs the same byte count")
        # NCCL moves bytes: shapes may differ (pipelining sends a 0-d tensor into a [1] buffer)
        with torch._C.DisableTorchFunction():
            v = v.contiguous().reshape(-1).view(torch.uint8).view(t.dtype).reshape(t.shape)
        if sim.block_of(t) is None and t.device.type == "cpu":   # a host tensor (gloo): its bytes
            with torch._C.DisableTorchFunction():
                t.copy_(v)
        else:
            known.define(sim, t, v, False)
