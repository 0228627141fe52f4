"""What a simulated run has charged to the allocator: one `ChargedStorage` per live meta storage
that stands for a CUDA one, found by the storage's identity (``untyped_storage()._cdata``), and
the `SimState` both modes share (see `vram.run.runtime` for the design)."""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from vram.allocator.errors import OutOfMemoryError as _SimOOM
from vram.devices.host import available_memory as host_available
from vram.frontend import memory as _memory
from vram.run.cuda.api import DeviceProperties
from vram.run.values.limits import VALUE_LIMIT, HostMemoryError, refusal
from vram.run.values.placeholders import ValueReport, value_error

from .lazy_host import LazyHost
from .storage_api import raw_device

_META = torch.device("meta")
#: layouts whose tensors own no storage but dense component tensors (indices, values)
_SPARSE = frozenset({torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc})
#: intra-op threads for the ops run on value copies (`vram.run.values.known.run_on_cpu`); None: the
#: script's ``torch.get_num_threads()``. One: on a busy machine torch's default pool made them
#: several times slower (benchmarks/bench_real_values.py measures both)
VALUE_THREADS: int | None = 1
#: host memory a real-values run leaves free when it makes a value copy (bytes; `SimState.reserve`)
HOST_RESERVE = 1 << 30
#: value copies smaller than this are checked together, once they add up to it
CHECK_EVERY = 16 << 20
#: addresses of what a CUDA graph's replay makes (`SimState.replaying_graph`): far above any
#: simulated address, never charged
UNCHARGED_BASE = 1 << 52


class ChargedStorage:
    """One charged storage: its block, device, the weak reference that frees it, and a CPU copy
    of its contents when they are known (`vram.run.values.known`)."""

    __slots__ = ("ptr", "nbytes", "device", "ref", "value", "assumed", "aux", "why", "filling")

    def __init__(self, ptr: int, nbytes: int, device: int, ref: weakref.ref[Any]) -> None:
        self.ptr, self.nbytes, self.device, self.ref = ptr, nbytes, device, ref
        self.value: torch.UntypedStorage | None = None
        self.assumed = False  # the value was computed from placeholders
        self.aux: Any = None  # CPU state a CUDA-only kernel's backward needs (`vram.run.values.real_values`)
        self.why = ""  # real-values mode: why the value is unknown (the op that failed on the CPU)
        self.filling: Any = None  # an unknown storage written piece by piece (`vram.run.values.known.define`)

    def forget(self, why: str = "") -> None:
        """Its contents are unknown now (and so is any piece written so far)."""
        self.value, self.why, self.filling = None, why, None


class SimState:
    """State shared by the two modes: the charged storages, workspaces, the current redirect."""

    def __init__(self, props: list[DeviceProperties]) -> None:
        self.props = props
        self.live: dict[int, ChargedStorage] = {}
        self.workspaces: dict[tuple[Any, ...], int] = {}
        self.target: int | None = None       # CUDA index the running torch function was sent to
        self.explicit_meta = False           # the running torch function asked for "meta" itself
        self.call: Any = None                # the running top-level torch function
        self.busy = 0
        self.pending: list[tuple[int, int]] = []  # (device, ptr) freed while inside malloc
        self.autocast_cache: dict[int, tuple[weakref.ref[Any], torch.Tensor]] = {}
        self.active = True
        self.strict_values = False           # unknown values: raise instead of placeholders
        self.real_values = False             # every value computed on the CPU (`vram.run.values.real_values`)
        self.value_limit = VALUE_LIMIT       # elements of a storage whose known values are kept
        self.unchecked_bytes = 0             # value copies made since host memory was last checked
        self.value_threads: int | None = VALUE_THREADS  # intra-op threads of the CPU value ops
        self.device_rng: torch.Tensor | None = None  # the simulated GPUs' draws (vram.run.values.known)
        self.report = ValueReport()          # where placeholders were used
        self.host_factory = False            # the running torch function is a CPU factory
        self.host_call = False               # the running torch function reads lazy host tensors only
        self.host = LazyHost(VALUE_LIMIT, lambda t: None, self._host_unknown)  # lazy host tensors
        self.ops: dict[Any, Any] = {}        # op -> its GPU behaviour (meta differs); NotImplemented: declined
        self.uncharged: dict[str, int] = {}  # kernel scratch left out (a plan's "note" steps): calls
        self.cudnn_plans: dict[tuple[Any, ...], int] = {}  # cuDNN call -> its cached plan's workspace
        self.replaying = 0                   # inside a CUDA graph's replay: nothing is charged
        self.next_uncharged = UNCHARGED_BASE

    def _host_unknown(self, what: str) -> None:
        self.report.record("a host tensor's recipe read a simulated tensor", what)

    # -- identity ---------------------------------------------------------------------------
    def block_of(self, t: Any) -> ChargedStorage | None:
        if type(t) is not torch.Tensor and not isinstance(t, torch.Tensor):
            return None
        try:
            return self.live.get(t.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError, AttributeError):  # sparse, nested, …
            return None

    def blocks_of(self, tensors: list[Any]) -> list[ChargedStorage | None]:
        """`block_of` of each of `tensors`."""
        return [self.block_of(t) for t in tensors]

    def idx_of(self, t: Any) -> int | None:
        b = self.block_of(t)
        return None if b is None else b.device

    def seen_idx(self, t: Any) -> int | None:
        """The CUDA index the script sees for `t`: its storage's, or for a wrapper subclass whose
        inner tensors are simulated (a DTensor's ``_local_tensor``; ``__tensor_flatten__``) the
        first inner tensor's. A DTensor's wrapper is made on its local tensor's device, meta
        here (``THPVariable_dtensor_new``), and must say cuda as on a GPU (FSDP2 checks it)."""
        b = self.block_of(t)
        if b is not None:
            return b.device
        if isinstance(t, torch.Tensor) and t.layout in _SPARSE:  # a sparse tensor: its values' GPU
            with torch._C.DisableTorchFunction():
                return self.seen_idx(t._values() if t.layout == torch.sparse_coo else t.values())
        flatten = getattr(t, "__tensor_flatten__", None)
        if flatten is None or not isinstance(t, torch.Tensor):
            return None
        for name in flatten()[0]:
            idx = self.seen_idx(getattr(t, name, None))
            if idx is not None:
                return idx
        return None

    # -- allocation -------------------------------------------------------------------------
    def run_plan(self, idx: int, plan: list[tuple[str, Any]], cublas_op: bool,
                 on_out: Callable[[int], None], on_blas: Callable[[], None]) -> None:
        """Walk a kernel's allocation plan (`vram.run.kernels.plan.op_plan`) on device `idx`: scratch
        ("tmp", "free"; "cudnn": a workspace that survives an OOM, `cudnn_workspace`), outputs
        (`on_out(i)`), the cuBLAS call (`on_blas`; after everything for a cuBLAS op whose plan does
        not place it), scratch left uncharged ("note": counted in `uncharged`). On an OOM the
        scratch still held is freed."""
        tmps: list[int] = []
        try:
            for step, arg in plan:
                if step == "tmp":
                    tmps.append(self.malloc(idx, arg))
                elif step == "cudnn":
                    tmps.append(self.cudnn_workspace(idx, *arg))
                elif step == "free":
                    self.allocator_free(idx, tmps[arg])
                    tmps[arg] = 0
                elif step == "blas":  # the cuBLAS call, between the kernel's own scratch
                    on_blas()
                    cublas_op = False
                elif step == "note":
                    self.uncharged[arg] = self.uncharged.get(arg, 0) + 1
                else:
                    on_out(arg)
            if cublas_op:
                on_blas()
        except torch.OutOfMemoryError:
            for p in tmps:
                if p:
                    self.allocator_free(idx, p)
            raise

    def cudnn_workspace(self, idx: int, key: tuple[Any, ...], nbytes: int) -> int:
        """A cuDNN call's workspace (``Conv_v8.cpp`` ``run_single_conv``): the plan cached for `key`
        first, then the heuristics' configs, the first asking `nbytes`; a failed allocation is
        caught (the allocator's OOM path has run: cache freed, ``num_ooms`` counted, the ``oom``
        event recorded) and the next config runs, modelled as needing no workspace; the plan that
        runs is cached. Returns the block (0: none)."""
        cached = self.cudnn_plans.get(key)
        for size in (cached, nbytes):
            if size is None:
                continue
            if size == 0:
                self.cudnn_plans[key] = 0
                return 0
            try:
                ptr = self.malloc(idx, size)
            except torch.OutOfMemoryError:
                continue
            self.cudnn_plans[key] = size
            return ptr
        self.cudnn_plans[key] = 0
        return 0

    def malloc(self, idx: int, nbytes: int) -> int:
        if self.replaying:  # a CUDA graph's replay: its memory is the pool's, already charged
            ptr, self.next_uncharged = self.next_uncharged, self.next_uncharged + max(512, -(-nbytes // 512) * 512)
            return ptr
        allocator = _memory.get_allocator(idx)
        self.busy += 1
        try:
            return allocator.malloc(nbytes, _memory.current_stream_of(idx))  # idx: valid (get_allocator)
        except _SimOOM as e:
            raise torch.OutOfMemoryError(str(e)) from None
        finally:
            self.busy -= 1
            if not self.busy and self.pending:
                self._flush()

    @staticmethod
    def allocator_free(device: int, ptr: int) -> None:
        """Free a simulated block (what a graph's replay made was never charged)."""
        if ptr < UNCHARGED_BASE:
            _memory.get_allocator(device).free(ptr)

    def _free(self, b: ChargedStorage) -> None:
        if b.ptr and self.active:
            if self.busy:  # a storage died during our own malloc (garbage collector): later
                self.pending.append((b.device, b.ptr))
            else:
                self.allocator_free(b.device, b.ptr)
        b.ptr = 0

    def release(self, b: ChargedStorage) -> None:
        """Free a live storage's block now, the storage kept without memory
        (``torch._C._free_And_Remove_DeleterFn``, what CUDA graph trees do to a finished path's outputs)."""
        self._free(b)

    def _flush(self) -> None:
        pending, self.pending = self.pending, []
        for device, ptr in pending:
            self.allocator_free(device, ptr)

    @contextmanager
    def replaying_graph(self) -> Iterator[None]:
        """Inside: a CUDA graph replays; what it makes is not charged (``UNCHARGED_BASE``)."""
        self.replaying += 1
        try:
            yield
        finally:
            self.replaying -= 1

    def track(self, storage: Any, idx: int) -> ChargedStorage:
        """Charge a new storage to device `idx`; its block is freed when the storage dies."""
        key = storage._cdata
        nbytes = storage.nbytes()
        ptr = self.malloc(idx, nbytes) if nbytes else 0

        def died(ref: Any, key: int = key) -> None:
            b = self.live.get(key)
            if b is not None and b.ref is ref:
                del self.live[key]
                self._free(b)

        b = ChargedStorage(ptr, nbytes, idx, weakref.ref(storage, died))
        self.live[key] = b
        return b

    def untrack(self, storage: Any) -> None:
        b = self.live.pop(storage._cdata, None)
        if b is not None:
            self._free(b)

    def resize(self, storage: Any, b: ChargedStorage) -> None:
        """A charged storage changed size (``resize_``, ``out=``): CUDA allocates anew, then frees."""
        nbytes = storage.nbytes()
        if nbytes == b.nbytes:
            return
        old, kept = b.ptr, b.value
        b.ptr = self.malloc(b.device, nbytes) if nbytes else 0
        b.nbytes = nbytes
        b.forget()
        self.carry(kept, b)  # a real-values run keeps the old bytes
        if old:
            self.allocator_free(b.device, old)

    # -- value copies of a real-values run (`vram.run.values.real_values`) ------------------------------
    def reserve(self, nbytes: int) -> None:
        """Before a value copy of `nbytes` is made in real-values mode: refuse the run when it
        would leave less than `HOST_RESERVE` of host memory available
        (`vram.devices.host.available_memory`: MemAvailable, and a cgroup limit where one is set;
        small copies are checked once they add up to `CHECK_EVERY`)."""
        if not self.real_values:
            return
        self.unchecked_bytes += nbytes
        if self.unchecked_bytes < CHECK_EVERY:
            return
        pending, self.unchecked_bytes = self.unchecked_bytes, 0
        available = host_available()
        if available is not None and available - pending < HOST_RESERVE:
            raise HostMemoryError(self.host_refusal(
                f"{pending / 2**20:,.0f} MiB more are needed and {HOST_RESERVE >> 20:,} MiB is kept free", available))

    def charged(self) -> Iterable[ChargedStorage]:
        """The live charged storages."""
        return self.live.values()

    def values_held(self) -> int:
        """Bytes of host memory the live storages' value copies hold (pieces being filled included)."""
        return sum((b.value.nbytes() if b.value is not None else 0)
                   + (b.filling[0].nbytes() if b.filling is not None else 0) for b in list(self.charged()))

    def host_refusal(self, need: str, available: int | None = None) -> str:
        """`vram.run.values.limits.refusal` for this run (`available`: read now when not given)."""
        return refusal(need, self.values_held(), host_available() if available is None else available)

    def zeros(self, nbytes: int) -> torch.UntypedStorage:
        """A zeroed value copy of `nbytes` (what a real-values run takes uninitialized memory to hold)."""
        self.reserve(nbytes)
        return torch.UntypedStorage(nbytes).fill_(0)

    def zeroed_tails(self, tensors: list[Any]) -> None:
        """Outputs allocated for the worst case and shrunk by ``resize_`` (unique's): the storage past
        the values holds uninitialized memory, taken as zeros, so the values the op computes make
        the whole storage known (within the run's value limit)."""
        for t in tensors:
            b = self.block_of(t) if isinstance(t, torch.Tensor) else None
            if b is not None and b.value is None and b.nbytes <= self.value_limit * t.element_size():
                b.value, b.why = self.zeros(b.nbytes), ""

    def carry(self, old: torch.UntypedStorage | None, new: ChargedStorage) -> None:
        """A storage grew (``resize_``: CUDA allocates anew and copies the old bytes): the new
        block's copy starts with the `old` copy's bytes, then zeros (uninitialized memory, as a
        real-values run takes it to hold), when `old` is known or the run is real-values."""
        if not self.real_values and (old is None or new.nbytes > self.value_limit):
            return
        new.value, new.why = self.zeros(new.nbytes), ""
        if old is not None:
            n = min(old.nbytes(), new.nbytes)
            with torch._C.DisableTorchFunction():
                dst = torch.empty(0, dtype=torch.uint8).set_(new.value, 0, (n,), (1,))
                dst.copy_(torch.empty(0, dtype=torch.uint8).set_(old, 0, (n,), (1,)))

    def storage_block(self, storage: Any) -> ChargedStorage | None:
        """The charged storage behind an ``UntypedStorage`` object, None for others."""
        return self.live.get(storage._cdata)

    def new_storage(self, nbytes: int, idx: int) -> Any:
        """A new ``UntypedStorage`` of `nbytes` charged to device `idx`, and its block."""
        moved = torch.UntypedStorage(nbytes, device=_META)
        return moved, self.track(moved, idx)

    def resize_storage(self, storage: Any, size: int, original: Callable[..., Any]) -> Any:
        """``UntypedStorage.resize_`` (`original`), then the charged block follows (`resize`)."""
        out = original(storage, size)
        b = self.live.get(storage._cdata)
        if b is not None:
            self.resize(storage, b)
        return out

    def storage_address(self, storage: Any) -> int | None:
        """A simulated storage's simulated address; a lazy host storage's real one (its bytes
        are computed: whoever asks for a host pointer reads through it)."""
        b = self.storage_block(storage)
        if b is not None:
            return b.ptr
        ls = self.host.storage(storage)
        return None if ls is None else self.host.materialize(ls).data_ptr()

    def storage_location(self, storage: Any) -> str | None:
        """``torch.serialization.location_tag`` of a simulated ("cuda:N") or lazy host ("cpu")
        storage; None for others."""
        b = self.storage_block(storage)
        if b is not None:
            return f"cuda:{b.device}"
        return "cpu" if self.host.storage(storage) is not None else None

    def storage_new(self, nbytes: int, device: torch.device) -> Any:
        """``torch.UntypedStorage(nbytes, device=)`` on a simulated GPU (``cuda``, or the engine's
        own device type): a new storage charged to it; None for other devices."""
        if device.type not in ("cuda", torch._C._get_privateuse1_backend_name()):
            return None
        idx = _memory.current_device() if device.index is None else device.index
        return self.new_storage(nbytes, idx)[0]

    def storage_to(self, storage: Any, device: torch.device) -> Any:
        """``UntypedStorage.to(device)``: to a simulated GPU, a new charged meta storage (no values
        to copy; a host storage's known contents come along); to the host (``torch.save``,
        ``storage.cpu()``), a copy of its known contents, else zeros recorded as placeholders
        (or `DataDependentError` when strict about values)."""
        b = self.storage_block(storage)
        ls = self.host.storage(storage) if b is None else None
        if ls is not None and device.type == "cpu":
            return self.host.materialize(ls)
        if device.type == "cuda":
            idx = _memory._device_index(device)
            if b is not None and b.device == idx:
                return storage
            moved, nb = self.new_storage(storage.nbytes(), idx)
            if b is None and raw_device(storage).type == "cpu" and storage.nbytes() <= self.value_limit * 4:
                self.reserve(storage.nbytes())  # the host's bytes exactly, whatever a view made
                nb.value, nb.assumed = storage.clone(), False  # while the storage was built assumed
            return moved
        if b is not None and device.type != "meta":
            if b.value is not None:
                return b.value.clone()
            if self.strict_values:
                raise value_error(f"UntypedStorage.to({device.type!r})")
            self.report.record(f"UntypedStorage.to({device.type!r})", f"{storage.nbytes():,} zero bytes")
            return torch.UntypedStorage(storage.nbytes()).fill_(0)
        return None

    def workspace(self, key: tuple[Any, ...], nbytes: int) -> None:
        """A per-(device, stream, thread) workspace, allocated once and kept (cuBLAS); none in a
        CUDA graph's replay (the one its recording used is the graph's)."""
        if key not in self.workspaces and not self.replaying:
            self.workspaces[key] = self.malloc(key[0], nbytes)

    def clear_workspaces(self) -> None:
        """``torch._C._cuda_clearCublasWorkspaces()`` (CublasHandlePool.cpp ``clearCublasWorkspaces``):
        every cuBLAS and cuBLASLt workspace freed; the next matmul allocates its own again."""
        workspaces, self.workspaces = self.workspaces, {}
        for key, ptr in workspaces.items():
            self.allocator_free(key[0], ptr)


