"""``ProcessGroupNCCL`` on simulated GPUs: collectives that move no data but allocate, keep alive
and free what ProcessGroupNCCL does (``torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp``).

`SimProcessGroup` is a Python ``torch.distributed.ProcessGroup`` (the trampoline PyTorch's own
``multi_threaded_pg`` uses), so collectives called from Python (``dist.all_reduce``, FSDP2,
DTensor) and from C++ (DDP's ``Reducer``, the functional collectives) reach it. Every rank runs
in its own process and a collective completes at once, as on an infinitely fast GPU, like
PyTorch's ``FakeProcessGroup``; a launched rank waits only for other ranks' known values its
outputs depend on (`.exchange`). What a collective does to memory, from
``ProcessGroupNCCL::collective`` and the collectives built on it:

* **Where it runs.** ``asyncOp=False`` (``dist.all_reduce(t)``; FSDP2's collectives inside its own
  streams) runs on the *current* stream and keeps nothing. ``asyncOp=True`` (``async_op=True``,
  DDP's bucket all-reduce, the functional collectives) runs on the group's NCCL stream (one per
  device, ``getStreamFromPool``) and *stashes* its inputs and outputs on the Work
  (``stashed_for_allocator_safety_``) until ``work.wait()``; a Work that is never waited is
  unstashed by the watchdog once the GPU is done, the shelf being emptied at the *next*
  collective's ``workEnqueue`` on the same group (the GPU is infinitely fast here, and the
  watchdog has seen completion by then). The Work also keeps its outputs (``outputs_``, for
  ``result()``) for as long as it lives.
* **What it allocates.** ``allgather`` into a list of equal-size tensors flattens them into one
  new tensor (``newLikeFlat``: ``[world, *shape]``, on the current stream, before the collective)
  and copies out of it; ``reduce_scatter`` from a list flattens its inputs likewise; ``barrier``
  all-reduces a new 1-element float32 ``zeros`` tensor on the group's device. Uneven lists become
  coalesced broadcasts/reduces, which allocate nothing. Nothing else goes through the caching
  allocator: NCCL's own buffers are ``cuMemCreate``'d outside it (see `vram.run.distributed.nccl`).
* **Values.** A collective's outputs hold what NCCL would put there (`.combine`), from every
  rank's inputs where `.exchange` brings them (launched ranks), else as if every rank held this
  rank's values, marked *assumed*. Unknown inputs give unknown outputs.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from vram.frontend import memory as _memory
from vram.run.memory.storages import SimState
from vram.run.values import known

from . import combine
from .combine import Combine
from .exchange import outputs_values
from .nccl import note_collective, note_connect, note_destroy, note_p2p
from .p2p import post, take

__all__ = ["Options", "SimProcessGroup", "SimWork"]

BACKEND_NAME = "nccl"

class Options:
    """``ProcessGroupNCCL.Options``: the fields ``torch.distributed`` sets and reads."""

    def __init__(self, is_high_priority_stream: bool = False) -> None:
        self.is_high_priority_stream = is_high_priority_stream
        self._timeout = timedelta(minutes=10)
        self.global_ranks_in_group: list[int] = []
        self.group_name = ""
        self.split_from: Any = None
        self.split_color = 0
        self.config: Any = None
        self.backend = BACKEND_NAME


class SimWork(dist.Work):  # type: ignore[misc]
    """A completed collective's Work (``WorkNCCL``): `wait` unstashes its tensors."""

    def __init__(self, outputs: list[torch.Tensor] | None, shelf: list[Any]) -> None:
        super().__init__()
        self._outputs = outputs
        self._shelf = shelf

    def wait(self, timeout: Any = None) -> bool:
        """``WorkNCCL::wait``: the current stream waits for the NCCL stream, then unstashes."""
        self._shelf.clear()
        return True

    def synchronize(self) -> None:
        self._shelf.clear()

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None

    def result(self) -> list[torch.Tensor]:
        return list(self._outputs or ())

    def get_future(self) -> Future[list[torch.Tensor]]:
        fut: Future[list[torch.Tensor]] = Future()
        fut.set_result(list(self._outputs or ()))
        return fut


class SimProcessGroup(dist.ProcessGroup):  # type: ignore[misc]
    """``ProcessGroupNCCL(store, rank, size, options)`` on simulated GPUs (see the module doc)."""

    Options = Options
    #: its collectives run on an NCCL communicator (`.nccl`); Gloo's run on the host
    nccl = True
    #: a Gloo group whose CUDA tensors' collectives are NCCL's (``"cpu:gloo,cuda:nccl"``)
    mixed = False

    def __init__(self, store: Any, rank: int, size: int, options: Options | None = None) -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self.options = options if options is not None else Options()
        self._group_name = getattr(self.options, "group_name", "") or ""
        self._group_desc = ""
        self._store = store
        self._streams: dict[int, Any] = {}      # device -> the NCCL stream (asyncOp)
        self._unwaited: list[list[Any]] = []   # shelves of async works not waited for
        self._used: list[int] = []             # devices collectives ran on (guessDeviceId)
        self.bound_device_id: Any = None
        self._batch: list[Any] | None = None   # a coalescing batch's tensors (batch_isend_irecv)
        self._eager = False                    # eagerConnectSingleDevice ran (init with device_id)

    # -- identity ---------------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - torch's names
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    @property
    def _device_types(self) -> list[torch.device]:
        """The devices of its backends (``_get_object_coll_device``: object collectives use CUDA
        tensors on an NCCL group, host tensors where Gloo serves the CPU)."""
        return [torch.device("cuda")]

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        if not self._group_name:
            raise RuntimeError("ProcessGroup name not set")
        return self._group_name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def _set_sequence_number_for_group(self) -> None:
        return None

    # -- what torch.distributed asks a ProcessGroupNCCL backend ---------------------------------
    def _get_backend(self, device: Any) -> SimProcessGroup:
        """This group is its own backend (a ``ProcessGroup`` subclass, as ``_new_process_group_
        helper`` allows), for every device."""
        return self

    @property
    def supports_splitting(self) -> bool:
        return True

    @property
    def supports_coalescing(self) -> bool:
        return True

    def eager_connect_single_device(self, device: Any) -> None:
        """``eagerConnectSingleDevice`` (``init_process_group``/``new_group`` with ``device_id``):
        the communicator is created now, and sends and receives use it (`.nccl`)."""
        index = device.index if getattr(device, "index", None) is not None else _memory.current_device()
        note_connect(self, index)
        self._eager = True

    def perform_nocolor_split(self, device: Any) -> None:
        """A rank outside a new subgroup joins ``ncclCommSplit`` with ``NCCL_SPLIT_NOCOLOR``: it
        gets no communicator."""
        return None

    def shutdown(self) -> None:
        """``destroy_process_group``: ``ncclCommDestroy`` frees the communicators' memory."""
        note_destroy(self)

    def __repr__(self) -> str:
        return f"<vram ProcessGroupNCCL rank={self._rank} size={self._size} name={self._group_name!r}>"

    # -- the collective skeleton ------------------------------------------------------------
    def _collective(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], async_op: bool,
                    post: Callable[[], None] | None = None, keep: Sequence[torch.Tensor] = (),
                    value: Combine | None = None, kind: str = "", needs: Sequence[int] | None = None,
                    sends: bool = True, ring: bool = True) -> SimWork:
        """``ProcessGroupNCCL::collective``: stash when async, run, then ``workEnqueue``.

        `value` computes the outputs' values from the group ranks' inputs (`.combine`; the ranks
        in `needs`, all by default, whose inputs `.exchange` brings: this rank's `inputs` when it
        `sends`); `post` runs after the collective (copies out); `ring`: a collective, which
        connects the NCCL communicator's ring (`.nccl`; a send or receive connects its peer)."""
        sim = _sim()
        device = _device_of(sim, inputs[0] if inputs else outputs[0]) if inputs or outputs else None
        nccl = self.nccl or (self.mixed and device is not None)
        if ring and nccl:
            note_collective(self, device)
        if device is not None and device not in self._used:
            self._used.append(device)
        shelf: list[Any] = []
        if async_op:
            if device is not None and device not in self._streams:
                self._streams[device] = _memory.Stream(device)
            shelf.extend(inputs)
            shelf.extend(outputs)
            shelf.extend(keep)
        if ring:
            outputs_values(self, "nccl" if nccl else "gloo", sim, inputs, outputs, value, kind, needs, sends)
        else:   # a send or receive: `.p2p` carries the values
            for t in outputs:
                known.forget(sim, t)
        if post is not None:
            post()
        if self._batch is not None:   # coalesced: end_coalescing stashes and enqueues the batch
            self._batch.extend(shelf)
            return SimWork(list(outputs) if async_op else None, [])
        return SimWork(list(outputs) if async_op else None, self._enqueue(shelf))

    def _enqueue(self, shelf: list[Any]) -> list[Any]:
        """``workEnqueue``: shelves of earlier works the watchdog saw complete are unstashed now."""
        for old in self._unwaited:
            old.clear()
        self._unwaited = [shelf] if shelf else []
        return shelf

    # -- collectives --------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        fold = combine.reduce_op(opts)
        return self._collective(tensors, tensors, _async(opts), kind="allreduce",
                                value=fold and combine.all_reduce(fold, len(tensors)))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        root = _root(opts)
        return self._collective(tensors, tensors, _async(opts), kind="broadcast", value=combine.broadcast(root),
                                needs=[root], sends=root == self._rank)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        root, fold = _root(opts), combine.reduce_op(opts)
        if root != self._rank:  # NCCL leaves a non-root's buffer as it was
            return self._collective(tensors, tensors, _async(opts), kind="reduce", value=combine.broadcast(self._rank),
                                    needs=[self._rank])
        return self._collective(tensors, tensors, _async(opts), kind="reduce",
                                value=fold and combine.all_reduce(fold, len(tensors)))

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: Any = None) -> SimWork:
        """Equal sizes: ``newLikeFlat(outputs)`` receives, then is copied out on the NCCL stream."""
        outs, inp = output_lists[-1], inputs[-1]
        if outs and all(o.shape == outs[0].shape for o in outs):
            inp = inp.contiguous()
            flat = _new_like_flat(outs)

            def copy_out() -> None:
                for j, o in enumerate(outs):
                    o.copy_(flat[j])
            return self._collective([inp], [flat], _async(opts), copy_out, keep=outs, kind="allgather",
                                    value=combine.all_gather_stacked)
        # uneven sizes: coalesced broadcasts, one from each rank
        return self._collective([inp], list(outs), _async(opts), kind="allgather", value=combine.all_gather_each)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> SimWork:  # noqa: A002
        return self.all_gather_single_coalesced([output], [input], opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> SimWork:
        """Each output: every rank's input, one after the other."""
        return self._collective(inputs, outputs, _async(opts), kind="allgather_base",
                                value=combine.all_gather_flat([o.shape for o in outputs]))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists: Any, inputs: Any, opts: Any = None) -> SimWork:
        raise NotImplementedError("ProcessGroupNCCL does not support allgather_coalesced")

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                       opts: Any = None) -> SimWork:
        """Equal sizes: the inputs are copied into ``newLikeFlat(inputs)`` on the NCCL stream."""
        out, ins = outputs[-1], input_lists[-1]
        fold = combine.reduce_op(opts)
        if ins and all(i.shape == ins[0].shape for i in ins):
            out = out.contiguous()
            flat = _new_like_flat(ins)

            def copy_in() -> None:
                for j, i in enumerate(ins):
                    flat[j].copy_(i)
            copy_in()
            return self._collective([flat], [out], _async(opts), keep=ins, kind="reduce_scatter",
                                    value=fold and combine.reduce_scatter_rows(fold, self._rank))
        return self._collective(list(ins), [out], _async(opts), kind="reduce_scatter",   # coalesced reduces
                                value=fold and combine.reduce_scatter_each(fold, self._rank))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> SimWork:  # noqa: A002
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> SimWork:
        """Each output: the fold of every rank's chunk (this rank's) of its input."""
        fold = combine.reduce_op(opts)
        return self._collective(inputs, outputs, _async(opts), kind="reduce_scatter_base", value=fold and
                                combine.reduce_scatter_flat(fold, self._rank, self._size, [o.shape for o in outputs]))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_splits: Any = None,  # noqa: A002
                          input_splits: Any = None, opts: Any = None) -> SimWork:
        """Every rank's input split by its `input_splits` (empty: equal chunks); this rank gets
        each rank's split of its own number."""
        splits = torch.tensor([int(s) for s in input_splits or []], dtype=torch.long)
        sim = _sim()
        if known.known(sim, input):   # the split sizes travel with the values
            inputs: list[torch.Tensor] = [input, splits]
        else:
            inputs = [input]
        return self._collective(inputs, [output], _async(opts), kind="alltoall_base",
                                value=combine.all_to_all_flat(self._rank, output.shape))

    alltoall_base = all_to_all_single

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> SimWork:
        return self._collective(inputs, outputs, _async(opts), kind="alltoall",
                                value=combine.all_to_all_each(self._rank))

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> SimWork:
        outs, root = (output_lists[-1] if output_lists else []), _root(opts)
        if root != self._rank:
            return self._collective(inputs, [], _async(opts), kind="gather")
        return self._collective(inputs, list(outs), _async(opts), kind="gather", value=combine.gather_each)

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None) -> SimWork:
        ins, root = (input_lists[-1] if input_lists else []), _root(opts)
        return self._collective(list(ins), outputs, _async(opts), kind="scatter", needs=[root],
                                value=combine.scatter_each(root, self._rank), sends=root == self._rank)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> SimWork:
        """``pointToPoint``; under the launcher the known values go to `dst` (`.p2p`)."""
        post(self, tensors, dst)
        note_p2p(self, dst, True, self._batch is not None or self._eager, _device_of(_sim(), tensors[0]))
        return self._collective(tensors, [], True, ring=False)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> SimWork:
        """``pointToPoint``; under the launcher the values are what `src` sent (`.p2p`)."""
        note_p2p(self, src, False, self._batch is not None or self._eager, _device_of(_sim(), tensors[0]))
        work = self._collective([], tensors, True, ring=False)
        take(self, tensors, src)
        return work

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> SimWork:
        return self._collective([], tensors, True, ring=False)

    def barrier(self, opts: Any = None) -> SimWork:
        """``ProcessGroupNCCL::barrier``: all-reduce of ``zeros({1}, float)`` on the guessed device."""
        ids = list(getattr(opts, "device_ids", None) or [])
        if ids:
            device = ids[0]
        elif self.bound_device_id is not None:
            device = self.bound_device_id.index
        elif self._used:
            device = self._used[0]
        else:
            device = dist.get_rank() % max(1, _memory.device_count()) if dist.is_initialized() else 0
        t = torch.zeros(1, dtype=torch.float32, device=torch.device("cuda", device))
        work = self._collective([t], [t], _async(opts), kind="allreduce", value=combine.all_reduce(combine.SUM, 1))
        work.wait()  # barrier: a CPU wait (sync mode) or the same at the user's wait()
        return work

    def monitored_barrier(self, *args: Any, **kwargs: Any) -> None:
        return None

    def start_coalescing(self, device: Any = None) -> None:
        """``startCoalescing`` (``ncclGroupStart``): sends and receives until the end use the
        group's communicator, and enqueue no Work of their own."""
        self._batch = []

    def end_coalescing(self, device: Any = None) -> SimWork:
        """``endCoalescing``: one Work for the batch, stashing all its tensors, enqueued now."""
        shelf, self._batch = self._batch or [], None
        return SimWork(None, self._enqueue(shelf))

    _start_coalescing = start_coalescing
    _end_coalescing = end_coalescing


def _sim() -> SimState:
    from . import current_sim
    return current_sim()


def _async(opts: Any) -> bool:
    """``opts.asyncOp``: C++ options default to True; ``dist.*(async_op=False)`` sets False."""
    return bool(getattr(opts, "asyncOp", True)) if opts is not None else True


def _root(opts: Any) -> int:
    return getattr(opts, "rootRank", 0) if opts is not None else 0


def _device_of(sim: SimState, t: torch.Tensor) -> int | None:
    return sim.idx_of(t)


def _new_like_flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``newLikeFlat``: ``at::empty({n, *t.sizes()}, t.options())`` under a guard of t's device."""
    t = tensors[0]
    return torch.empty((len(tensors), *t.shape), dtype=t.dtype, device=t.device)
