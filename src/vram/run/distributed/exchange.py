"""Collectives' values between launched ranks: what each rank puts in, as NCCL carries it.

A collective's outputs depend on other ranks' inputs. Under the launcher every rank process
appends, for each collective it calls, one record to its own log in the mailbox folder
(`vram.run.distributed.p2p`): the collective's number on its communicator (ranks call a
communicator's collectives in one order, as NCCL requires), its kind, and the values this rank
contributes when known (`vram.run.values.known`; "unknown" otherwise, for activations and
gradients). A rank whose outputs it can know reads the records it needs from the other ranks'
logs, waiting for them as NCCL would: ``broadcast_object_list`` on a non-root rank gets the
root's object sizes and pickled bytes, ``all_gather_object`` every rank's, an all-reduce of a
count the exact sum. So a rank posts before it reads, and no two collectives wait on each other.

A contribution is unknown when the rank is not simulated (``--ranks``), when its values are not
known, or outside the launcher; the outputs are then computed as if that rank held this rank's
values, and marked *assumed* (reads of them are listed in the run's value report; a run strict
about values leaves them unknown). A rank that ended without reaching a collective another
waits in is an error, as is a record of another kind: the ranks' programs diverged.

A re-executed rank (the meta engine's rerun) posts its records again; the first record of each
collective wins, and records of collectives this rank has passed are dropped as read.
"""
from __future__ import annotations

import io
import os
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from vram.run.values import known

from .combine import Combine
from .p2p import P2PError, mailbox, wait_for

if TYPE_CHECKING:
    from vram.run.memory.storages import SimState

__all__ = ["Exchange", "Record", "exchange", "contributions", "outputs_values"]

_HEAD = struct.Struct("<IQ")   # header bytes, payload bytes
#: (kind, values or None when unknown, assumed)
Record = tuple[str, list[torch.Tensor] | None, bool]


class Exchange:
    """This rank's collective log and its reads of the other ranks' logs (see the module doc)."""

    def __init__(self, folder: str, rank: int, simulated: set[int]) -> None:
        self.folder, self.rank, self.simulated = folder, rank, simulated
        self._next: dict[str, int] = {}                  # communicator -> this rank's next collective
        self._offsets: dict[int, int] = {}               # peer -> bytes of its log read
        self._records: dict[tuple[int, str, int], tuple[str, bool, bytes | None]] = {}
        self._fd: int | None = None

    def _log(self, rank: int) -> str:
        return os.path.join(self.folder, f"collectives-{rank}.log")

    def begin(self, comm: str) -> int:
        """The number of this rank's next collective on communicator `comm`."""
        seq = self._next.get(comm, 0)
        self._next[comm] = seq + 1
        for peer in self.simulated:   # records of the collective before, not needed here
            self._records.pop((peer, comm, seq - 1), None)
        return seq

    def post(self, comm: str, seq: int, kind: str, values: list[torch.Tensor] | None, assumed: bool) -> None:
        """Append this rank's contribution to collective `seq` of `comm` (None: unknown)."""
        payload = b""
        if values is not None:
            buf = io.BytesIO()
            torch.save([v.contiguous() for v in values], buf)
            payload = buf.getvalue()
        head = f"{comm}\0{seq}\0{kind}\0{int(assumed)}\0{int(values is not None)}".encode()
        if self._fd is None:
            self._fd = os.open(self._log(self.rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.write(self._fd, _HEAD.pack(len(head), len(payload)) + head + payload)

    def _read(self, peer: int) -> None:
        """Parse the whole records `peer` has appended since the last read."""
        try:
            with open(self._log(peer), "rb") as f:
                f.seek(self._offsets.get(peer, 0))
                data = f.read()
        except FileNotFoundError:
            return
        at = 0
        while at + _HEAD.size <= len(data):
            nhead, npay = _HEAD.unpack_from(data, at)
            end = at + _HEAD.size + nhead + npay
            if end > len(data):
                break   # the writer is still appending it
            comm, seq, kind, assumed, known = data[at + _HEAD.size:at + _HEAD.size + nhead].decode().split("\0")
            key = (peer, comm, int(seq))
            if int(seq) >= self._next.get(comm, 0) - 1 and key not in self._records:
                self._records[key] = (kind, assumed == "1", data[end - npay:end] if known == "1" else None)
            at = end
        self._offsets[peer] = self._offsets.get(peer, 0) + at

    def take(self, comm: str, seq: int, kind: str, peer: int) -> Record | None:
        """Rank `peer`'s record of collective `seq` of `comm`, waiting for it; None when `peer` is
        not simulated."""
        if peer not in self.simulated:
            return None
        key = (peer, comm, seq)

        def ready() -> bool | None:
            if key not in self._records:
                self._read(peer)
            return True if key in self._records else None
        wait_for(self.folder, self.rank, peer, ready, f"waits for rank {peer} in collective {seq} ({kind}) of "
                 f"communicator {comm!r}", "reaching it")
        theirs, assumed, payload = self._records.pop(key)
        if theirs != kind:
            raise P2PError(f"rank {self.rank}'s collective {seq} of communicator {comm!r} is {kind}, rank "
                           f"{peer}'s is {theirs}: the ranks call their collectives in different orders")
        values = None if payload is None else torch.load(io.BytesIO(payload), weights_only=True)
        return kind, values, assumed


_EXCHANGE: list[Exchange] = []


def exchange() -> Exchange | None:
    """This launched rank's exchange, or None outside the launcher."""
    box = mailbox()
    if box is None:
        return None
    if not _EXCHANGE or _EXCHANGE[0].folder != box.folder or _EXCHANGE[0].rank != box.rank:
        _EXCHANGE[:] = [Exchange(box.folder, box.rank, box.simulated)]
    return _EXCHANGE[0]


def contributions(group: Any, backend: str, kind: str, sent: list[torch.Tensor] | None, sent_assumed: bool,
                  needs: Sequence[int], mine: list[torch.Tensor] | None, mine_assumed: bool,
                  strict: bool) -> tuple[list[list[torch.Tensor] | None], bool] | None:
    """Every group rank's inputs to this collective, as far as this rank's outputs need them.

    Posts `sent` (this rank's contribution; None: unknown) under the launcher, on `group`'s
    communicator of `backend` (a group of ``"cpu:gloo,cuda:nccl"`` has one of each), then reads the
    contributions of the group ranks in `needs`. A needed contribution that is unknown is
    assumed to be `mine` (what this rank holds). Returns (per group rank: its values, or None
    where not needed) and whether any of it is assumed; None when the outputs cannot be known."""
    ex, world, me = exchange(), group.size(), group.rank()
    comm, seq = "", 0
    if ex is not None:
        comm = f"{backend}-{group._group_name or 'default'}"
        seq = ex.begin(comm)
        ex.post(comm, seq, kind, sent, sent_assumed)
    ranks = list(getattr(group.options, "global_ranks_in_group", None) or []) or list(range(world))
    per_rank: list[list[torch.Tensor] | None] = [None] * world
    assumed = False
    for r in needs:
        if r == me:
            values, guessed = sent if sent is not None else mine, sent_assumed if sent is not None else mine_assumed
        else:
            record = ex.take(comm, seq, kind, ranks[r]) if ex is not None and world > 1 else None
            values, guessed = (record[1], record[2]) if record is not None else (None, False)
            if values is None:
                values, guessed = mine, True
        if values is None:
            return None
        per_rank[r] = values
        assumed = assumed or guessed
    if assumed and strict:
        return None
    return per_rank, assumed


def outputs_values(group: Any, backend: str, sim: SimState, inputs: Sequence[torch.Tensor],
                   outputs: Sequence[torch.Tensor], value: Combine | None, kind: str, needs: Sequence[int] | None,
                   sends: bool) -> None:
    """Give a collective's `outputs` their values: `value` (`.combine`) of the group ranks'
    inputs, those of the ranks in `needs` (all when None), this rank's `inputs` among them when
    it `sends`; unknown when they cannot be known. Host tensors (gloo) get the bytes."""
    ins = [known.cpu_value(sim, t) for t in inputs]
    mine = None if any(v is None for v in ins) else [v for v in ins if v is not None]
    mine_assumed = any(known.assumed(sim, t) for t in inputs)
    me = group.rank()
    order = [] if value is None else sorted(range(group.size()) if needs is None else needs, key=lambda r: r != me)
    got = contributions(group, backend, kind, mine if sends else None, mine_assumed, order, mine, mine_assumed,
                        sim.strict_values)
    results = None
    if value is not None and got is not None:
        try:
            with torch._C.DisableTorchFunction():
                results = value(got[0])
        except (RuntimeError, IndexError, ValueError):   # the ranks' tensors do not fit together
            results = None
    for i, t in enumerate(outputs):
        if results is None:
            known.forget(sim, t)
        elif sim.block_of(t) is None and t.device.type == "cpu":   # a host tensor (gloo): its bytes
            with torch._C.DisableTorchFunction():
                t.copy_(results[i].reshape(t.shape))
        else:
            with torch._C.DisableTorchFunction():
                v = results[i].reshape(t.shape)
            known.define(sim, t, v, bool(got and got[1]))
