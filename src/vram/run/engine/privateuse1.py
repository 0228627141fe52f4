"""The PrivateUse1 engine's fallback, state and function mode (see `vram.run.engine`).

Every aten op on a PrivateUse1 tensor reaches `_fallback` (a boxed fallback,
``torch.library.Library("_", "IMPL").fallback(fn, "PrivateUse1")``; PyTorch's
test/test_privateuseone_python_backend.py registers its ops the same way). It runs the op on meta
views of its inputs; outputs that alias an input (``alias_info`` in the op's schema) view that
input's storage, new ones get a new storage (`vram.run.engine.dlpack`) charged in the order of
the CUDA kernel's allocations (`vram.run.kernels.plan.op_plan`, with the cuBLAS workspaces of
`vram.run.engine.outputs`). A block is found from a tensor's data pointer (the storage's
address *is* the simulated address), never from ``untyped_storage()``, whose Python object would
pin the storage.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._pytree import tree_map

from vram.run.kernels import blas as _cublas
from vram.run.kernels import cudnn as _cudnn
from vram.run.kernels import plan as _plan
from vram.run.kernels import sparse as _sparse
from vram.run.memory.storage_api import raw_device
from vram.run.memory.storages import ChargedStorage, SimState
from vram.run.values import known
from vram.run.values.placeholders import describe, needs_data, value_error

from . import cpp_meta, lazy, meta_cache, native, op_info, sparse_layouts, views
from . import reads as _reads
from .dlpack import new_storage as _dlpack_storage
from .function_mode import FunctionMode
from .outputs import cublas_if_device, data_dependent, mask_counts
from .whole_ops import COPY_FROM as _COPY_FROM
from .whole_ops import SET_SOURCE as _SET_SOURCE
from .whole_ops import structured_kernels

#: PrivateUse1's name in a process that ran the engine (``torch.utils.rename_privateuse1_backend``)
NAME = "vramsim"
_META = torch.device("meta")
_CPU = torch._C.DispatchKey.CPU
_HAS_STORAGE, _DATA_ADDRESS = torch._C._has_storage, torch._C._data_address  # type: ignore[attr-defined]
_ENGINE_OWN = known.ENGINE_OWN
_AS_STRIDED = torch.ops.aten.as_strided.default
_SET = torch.ops.aten.set_.source_Tensor
#: view ops whose remembered calls take `_plain_view`
_PLAIN_VIEWS = frozenset({torch.ops.aten.view.default, torch.ops.aten.as_strided.default})
#: composites whose input a CUDA kernel takes ``contiguous()`` and PrivateUse1 does not
_CUDA_CONTIGUOUS = frozenset({"group_norm"})
_STATE: list[BackendState] = []  # the running simulations, innermost last
_LOCK = threading.RLock()  # the simulated allocators, shared by the autograd engine's device threads
_LIB: list[Any] = []
#: how new storages are made: ``_fast.cpp``'s ``new_storage`` once `register` has built it, else
#: (and as the reference) `vram.run.engine.dlpack.new_storage`
NEW_STORAGE: list[Any] = [_dlpack_storage]
#: ``_fast.cpp``'s ``place`` once `register` has built it (`_block`)
_PLACE: list[Any] = [None]


class EngineLimit(RuntimeError):
    """What the engine cannot run in this process, for a reason in PyTorch's C++ (named in the
    message): a backward on more GPUs than the autograd engine started with, or, without the
    C++ device guard (`vram.run.engine.native`), several autograd devices or pinned memory."""


def register(devices: int = 1) -> None:
    """Set PrivateUse1 up as a backend named `NAME` with at least `devices` devices: the C++
    device guard and hooks (`vram.run.engine.native`, registered first so that PyTorch keeps them)
    and `_fallback` for every op; once per process (PyTorch cannot undo it; it changes nothing
    for other devices). Later calls only raise the device count."""
    native.load(devices)
    if _LIB:
        return
    compiled = native.fast()
    if compiled is not None:
        NEW_STORAGE[0], _PLACE[0], views.COMPILED[0] = compiled.new_storage, compiled.place, compiled.view_of
        meta_cache.use_compiled(compiled.key, NAME)
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(NAME)
    cpp_meta.activate()  # the ops' meta runs on torch's C++ kernels while nothing symbolic exists
    known.SIMULATED_DEVICE_TYPES.add(NAME)
    lib = torch.library.Library("_", "IMPL")  # noqa: TOR901 - a fallback for every namespace
    lib.fallback(_fallback, "PrivateUse1")
    _LIB.append(lib)
    _LIB.append(structured_kernels(_fallback))
    _LIB.append(views.math_bit_copies(_fallback))
    _LIB.extend(sparse_layouts.register(_STATE))


def _raw_device(t: torch.Tensor) -> torch.device:
    with torch._C.DisableTorchFunction():
        return t.device


def _block(blocks: dict[tuple[int, int], ChargedStorage], empty: list[ChargedStorage],
           t: torch.Tensor) -> ChargedStorage | None:
    """`BackendState.block_of` of a tensor, torch functions disabled: `_block_reference`, with the
    tensor's device and storage address read by ``_fast.cpp``'s ``place`` where it is built."""
    place = _PLACE[0]
    where = NotImplemented if place is None else place(t)
    if where is NotImplemented:
        return _block_reference(blocks, empty, t)
    if where is None:
        return None
    if _ENGINE_OWN[0]:
        idx = known.engine_index(where[0])
        return blocks.get((idx, where[1])) or empty[idx]
    return blocks.get(where) or empty[where[0]]


def _block_reference(blocks: dict[tuple[int, int], ChargedStorage], empty: list[ChargedStorage],
                     t: torch.Tensor) -> ChargedStorage | None:
    """`BackendState.block_of` of a tensor, torch functions disabled."""
    d = t.device
    if d.type != NAME or not _HAS_STORAGE(t):  # a vmap BatchedTensor wraps one
        return None
    idx = d.index or 0
    if _ENGINE_OWN[0]:  # `known.engine_index`: the identity unless a rank's own GPU trades places with 0
        idx = known.engine_index(idx)
    return blocks.get((idx, _DATA_ADDRESS(t))) or empty[idx]


class BackendState(SimState):
    """`SimState` whose charged storages are PrivateUse1 storages, found by (device, address)."""

    def __init__(self, props: list[Any]) -> None:
        super().__init__(props)
        self.blocks: dict[tuple[int, int], ChargedStorage] = {}
        self._empty = [ChargedStorage(0, 0, i, None) for i in range(len(props))]  # type: ignore[arg-type]

    def block_of(self, t: Any) -> ChargedStorage | None:
        """The charged storage behind `t` (by its storage's data pointer, ``_data_address``:
        ``storage().data()``), `_empty` for an unknown storage on a simulated GPU, None off them."""
        if not isinstance(t, torch.Tensor):
            return None
        with torch._C.DisableTorchFunction():
            return _block(self.blocks, self._empty, t)

    def blocks_of(self, tensors: list[Any]) -> list[ChargedStorage | None]:
        """`block_of` of each of `tensors`, with torch functions disabled once for all."""
        blocks, empty = self.blocks, self._empty
        with torch._C.DisableTorchFunction():
            return [_block(blocks, empty, t) if isinstance(t, torch.Tensor) else None for t in tensors]

    def charged(self) -> Iterable[ChargedStorage]:
        return self.blocks.values()

    def storage_block(self, storage: Any) -> ChargedStorage | None:
        device = raw_device(storage)
        if device.type != NAME:
            return None
        idx = known.engine_index(device.index or 0)
        return self.blocks.get((idx, torch._C.StorageBase.data_ptr(storage)))

    def new_storage(self, nbytes: int, idx: int) -> Any:
        t = self.new(torch.empty(nbytes, dtype=torch.uint8, device=_META), idx)
        return t.untyped_storage(), self.block_of(t)

    def resize_storage(self, storage: Any, size: int, original: Any) -> Any:
        """``UntypedStorage.resize_`` of a simulated storage as CUDA's ``resize_bytes_cuda`` does it
        (aten/src/ATen/native/cuda/Resize.cpp): a new block of `size` bytes, then the old one
        freed. A Python PrivateUse1 backend cannot resize (``resizePrivateUse1Bytes`` is not one
        of the hooks torch/csrc/acc/Module.cpp lets Python implement), so the storage trades its
        data pointer with new storages' (``_swap_data_ptr_``: equal sizes or one empty); the old
        block goes with the storage it moved to. FSDP2 frees and re-allocates its unsharded
        parameters this way."""
        device = raw_device(storage)
        if device.type != NAME:
            return super().resize_storage(storage, size, original)
        if size == storage.nbytes():
            return storage
        idx = known.engine_index(device.index or 0)
        grown, _ = self.new_storage(size, idx)  # allocated before the old block is freed
        emptied = None
        if storage.nbytes():
            emptied, _ = self.new_storage(0, idx)
            storage._swap_data_ptr_(emptied)
        storage._swap_data_ptr_(grown)
        del grown, emptied  # the old block's storage dies: freed
        return storage

    def new(self, meta: torch.Tensor, idx: int) -> torch.Tensor:
        """A PrivateUse1 tensor like `meta` over a new storage charged to device `idx`; its death
        frees its own block (not a later one at the same address: `release`)."""
        nbytes = meta.untyped_storage().nbytes()
        ptr = self.malloc(idx, nbytes) if nbytes else 0
        if not ptr:
            return NEW_STORAGE[0](meta, known.engine_index(idx), ptr, _nothing, nbytes)
        b = self.blocks[(idx, ptr)] = ChargedStorage(ptr, nbytes, idx, None)  # type: ignore[arg-type]
        return NEW_STORAGE[0](meta, known.engine_index(idx), ptr,
                              lambda engine_idx, address: self._died(b, address), nbytes)

    def _died(self, b: ChargedStorage, address: int) -> None:
        with _LOCK:
            key = (b.device, address)
            if self.blocks.get(key) is b:
                del self.blocks[key]
            self._free(b)

    def release(self, b: ChargedStorage) -> None:
        """`SimState.release`; the storage, dying later, finds its block gone."""
        with _LOCK:
            if self.blocks.get((b.device, b.ptr)) is b:
                del self.blocks[(b.device, b.ptr)]
            self._free(b)

    def close(self) -> None:
        self.active = False
        self.blocks.clear()


def _nothing(engine_idx: int, address: int) -> None:
    """The death of a storage that holds no block."""


def _on_meta(t: Any) -> Any:
    if isinstance(t, torch.device) and t.type == NAME:
        return _META
    if isinstance(t, torch.Tensor) and t.device.type == NAME:
        # a storage as long as the view reaches: meta kernels that ``set_`` or resize an input
        # (``mv``'s ``out=``) check the view against it
        shape, stride, offset = t.shape, t.stride(), t.storage_offset()
        extent = offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if t.numel() else 0
        return torch.empty(extent, dtype=t.dtype, device=_META).as_strided(shape, stride, offset)
    return t


def _device(inputs: list[torch.Tensor], kwargs: dict[str, Any]) -> int:
    """The simulated GPU an op runs on: its first simulated tensor's, else its ``device``, else
    the current one."""
    for t in inputs:
        d = t.device
        if d.type == NAME:
            return known.engine_index(d.index or 0)
    from vram.frontend import memory as _memory

    d = kwargs.get("device")
    if isinstance(d, torch.device) and d.type == NAME:  # no index: the current device, as C++'s guard
        return _memory.current_device() if d.index is None else known.engine_index(d.index)
    return _memory.current_device()


def _fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    """Run `op` on meta; charge its new outputs and scratch to the simulated allocator. Without
    the function mode: an op may run where it is on the stack (the autograd engine's threads).
    One op at a time: a backward across GPUs runs on one autograd thread per device (engine.cpp
    ``thread_init``), as CUDA's allocator takes its device's lock for each call."""
    with _LOCK, torch._C.DisableTorchFunction():
        return _run(op_info.scalar_overload(op, args), args, kwargs)


def _run(op: Any, args: Any, kwargs: Any) -> Any:
    if not _STATE:
        raise RuntimeError(f"vram: a {NAME} tensor outside a simulated run")
    sim = _STATE[-1]
    if op is _COPY_FROM:  # copy_ across devices: the values, where they are known
        _reads.copy_values(sim, args[0], args[1])
        return args[1]
    if op in _SET_SOURCE:  # onto another simulated storage: the CPU kernel, which allocates nothing
        return op._op_dk(_CPU, *args, **kwargs)
    computed, computed_assumed = None, False
    key = meta_cache.key(op, args, kwargs, NAME)
    seen = meta_cache.lookup(key)
    if seen is not None:
        margs, mkwargs, out = seen
        if op in _PLAIN_VIEWS and args and isinstance(out, torch.Tensor) and out.layout == torch.strided:
            return _plain_view(sim, op, args, kwargs, out)
    else:
        margs, mkwargs = tree_map(_on_meta, args), tree_map(_on_meta, kwargs)
    try:
        if seen is None:
            out = _plan.CUDA_META.get(op, op)(*margs, **mkwargs)  # CUDA's output where the meta kernel's differs
            meta_cache.remember(key, margs, mkwargs, out)
    except (RuntimeError, NotImplementedError) as e:
        if not needs_data(e):
            raise
        # an output shape that depends on values (nonzero, boolean masks): from the CPU copies
        computed, computed_assumed = data_dependent(sim, op, args, kwargs)
        if computed is None:
            what = describe(sim.call) if sim.call is not None else f"{op}"
            raise value_error(what, f"{op} has no meta kernel" if "no fake impl" in str(e) else "") from None
        out = known.meta_outputs(computed)
    info = op_info.of(op)
    name = info.name
    out = _plan.cuda_outputs(name, margs, mkwargs, _cudnn.cudnn_batch_norm_outputs(name, margs, out))
    single = not isinstance(out, tuple)
    outs = [out] if single else list(out)
    if _sparse.sparse_layout(outs):
        raise NotImplementedError(_sparse.sparse_message(describe(sim.call) if sim.call is not None else f"{op}"))
    results: list[Any] = list(outs)
    for i, (alias, o) in enumerate(zip(info.returns, outs)):
        if alias is None or not isinstance(o, (torch.Tensor, list)):
            continue
        src = info.source(i, args, kwargs)
        if alias.is_write:
            results[i] = src
        elif isinstance(o, list):
            results[i] = [views.view_of(src, m) for m in o]
        else:
            results[i] = views.view_of(src, o)
    inputs = op_info.tensors(args, kwargs)
    idx = _device(inputs, kwargs)
    _charge(sim, info, idx, margs, mkwargs, outs, results, mask_counts(sim, name, args, kwargs))
    for i, o in enumerate(outs):  # outputs the kernel's plan leaves out live on the host (SDPA's
        if results[i] is o and isinstance(o, torch.Tensor):  # philox seed and offset)
            results[i] = torch.zeros(o.shape, dtype=o.dtype)
    if computed is not None and name in _plan.SHRUNK_BY_RESIZE:
        sim.zeroed_tails(results)
    final = results[0] if single else tuple(results)
    known.propagate(sim, op, args, kwargs, final, inputs, computed, computed_assumed)
    return final


def _plain_view(sim: BackendState, op: Any, args: Any, kwargs: Any, out: torch.Tensor) -> torch.Tensor:
    """A remembered ``view`` or ``as_strided`` (over half of a training step's ops): what `_run`
    does, less what comes to nothing for them — the return aliases ``self`` (``Tensor(a)``, not
    written), CUDA's output rules leave it as it is, and the kernel's plan is that output alone,
    which allocates nothing (`vram.run.kernels.plan.op_plan`; tests/test_engine_speed.py)."""
    final = views.view_of(args[0], out)
    known.propagate(sim, op, args, kwargs, final, op_info.tensors(args, kwargs))
    return final


def _charge(sim: BackendState, info: op_info.OpInfo, idx: int, margs: Any, mkwargs: Any, outs: list[Any],
            results: list[Any], counts: dict[int, int] | None) -> None:
    name = info.name
    props = sim.props[idx]
    plan = _plan.op_plan(name, margs, outs, props.multi_processor_count, props.max_threads_per_multi_processor,
                         (props.major, props.minor), mkwargs, counts)
    returns = info.returns

    def on_out(arg: int) -> None:
        if arg < len(outs) and arg < len(returns):  # a void op (``_amp_foreach_*_``) has none
            _materialise(sim, returns[arg], outs, results, arg, idx)

    sim.run_plan(idx, plan, name in _cublas.CUBLAS_OPS, on_out, lambda: _blas(sim, idx, name, margs, mkwargs, results))


def _materialise(sim: BackendState, alias: Any, outs: list[Any], results: list[Any], i: int, idx: int) -> None:
    """Give return `i` its storage: new outputs a new one; an output written in place (``out=``,
    ``resize_``) whose meta storage grew a new one too, as CUDA's ``resize_`` allocates anew."""
    o = outs[i]
    if alias is None:
        if isinstance(o, torch.Tensor):
            results[i] = sim.new(o, idx)
        elif isinstance(o, list):
            results[i] = [sim.new(m, idx) if isinstance(m, torch.Tensor) else m for m in o]
    elif alias.is_write and isinstance(o, torch.Tensor):
        t = results[i]
        b = sim.block_of(t)
        if b is not None and o.untyped_storage().nbytes() > b.nbytes:
            _SET._op_dk(_CPU, t, sim.new(o, idx))
            nb = sim.block_of(t)
            if nb is not None:
                sim.carry(b.value, nb)  # a real-values run keeps the old bytes
        elif (tuple(t.shape), t.stride(), t.storage_offset()) != (tuple(o.shape), o.stride(), o.storage_offset()):
            # as_strided_'s CPU kernel crashes on these tensors; set_ onto a restrided alias of
            # the same storage does what a shrinking resize_ does
            _SET._op_dk(_CPU, t, _AS_STRIDED._op_dk(_CPU, t, o.shape, o.stride(), o.storage_offset()))


def _blas(sim: BackendState, idx: int, name: str, margs: Any, mkwargs: Any, results: list[Any]) -> None:
    out = results[0]
    if isinstance(out, torch.Tensor):
        cublas_if_device(sim, idx, name, margs, mkwargs, out)


class BackendFunctionMode(FunctionMode):
    """The default engine's function mode with ``cuda:N`` sent to PrivateUse1 device N."""

    def host_factories(self) -> bool:
        return lazy.ready(self.sim, _fallback)

    def device_for(self, idx: int) -> torch.device:
        return torch.device(NAME, known.engine_index(idx))

    @contextmanager
    def backward_scope(self, roots: Any) -> Iterator[None]:
        """`lazy.outside_backward`; a backward on a GPU the autograd engine has no ready queue for
        (``device_ready_queues_``, sized once per process by the device guard's count:
        engine.cpp ``start_device_threads``) is refused in one line."""
        try:
            with lazy.outside_backward(self.sim, roots):
                yield
        except RuntimeError as e:
            if "device_ready_queues_" not in str(e):
                raise
            if native.loaded():
                why = ("the autograd engine of this process started its device threads for fewer GPUs "
                       "(engine.cpp start_device_threads: once per process)")
            else:
                why = (f"{native.why_not()}, and the Python device guard counts one device "
                       "(torch/csrc/acc/Module.cpp PythonDeviceGuard::deviceCount)")
            raise EngineLimit(f"vram run: a backward on a GPU the engine has no autograd queue for: {why}") from None

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        lazy.retire(self.sim)
        if getattr(func, "__name__", "") in _CUDA_CONTIGUOUS and args and self.sim.block_of(args[0]) is not None:
            # composites that make a CUDA input contiguous but keep a PrivateUse1 one in its
            # suggested memory format (group_norm.cpp: ``is_cpu() || is_privateuseone() ?
            # contiguous(memory_format) : contiguous()``): take CUDA's path here
            args = (args[0].contiguous(), *args[1:])
        return super().__torch_function__(func, types, args, kwargs)


def push(sim: BackendState) -> None:
    _STATE.append(sim)


def pop(sim: BackendState) -> None:
    lazy.retire(sim, end=True)
    _STATE.remove(sim)
    sim.close()
