"""Layer 4: run an unmodified PyTorch script as if on a CUDA GPU (``vram run``). Needs torch.

How it works, inside `simulated_cuda`:

* **Where tensors live.** A ``TorchFunctionMode`` rewrites every CUDA device argument ("cuda",
  "cuda:1", ``torch.device("cuda")``, an int index; ``device=`` of factories, ``Tensor.to``,
  ``Tensor.cuda``, and so ``Module.to/cuda``) to ``meta``, remembering the CUDA index. Meta tensors
  have shapes, dtypes and strides but no data, so forward, backward and optimizer steps run at the
  cost of shape inference. To the script, such a tensor *is* a CUDA tensor: ``.device`` is
  ``cuda:N``, ``.is_cuda`` is True, ``.data_ptr()`` is its simulated address — so optimizers take
  their CUDA code paths (foreach Adam, as on a GPU) and ``torch.zeros(n, device=x.device)`` works.
* **What is allocated, and when.** A ``TorchDispatchMode`` sees every aten op after autograd —
  forward, backward and optimizer — with its outputs. Every *new* storage among them is charged to
  the simulated caching allocator (``storage.nbytes()``, on the current stream), in output order,
  when the op runs; a weak reference to the storage frees the block the moment PyTorch frees the
  storage (its last tensor, view, or autograd saved-tensor reference dies). See `vram.run.kernels`
  for what CUDA kernels allocate besides outputs (cuBLAS workspaces, flash-attention scratch).
* **Identity of a storage.** ``t.untyped_storage()`` returns the *same* Python object for every
  tensor and view of one ``StorageImpl`` (PyObject preservation), and ``_cdata`` is the
  ``StorageImpl`` address, unique while it lives. Meta storages all have ``data_ptr() == 0``, so the
  address cannot be used.
* **Which meta storages are "CUDA".** An op's new storages take the device of its first simulated
  input, or the CUDA index the function mode redirected; an op fed only by meta tensors the script
  made itself (``device="meta"``) stays on meta; a factory without device arguments inside a
  Python-level torch function (``device=x.device`` seen unredirected) goes to the current device.
* **Freed when PyTorch frees.** ``weakref.ref(storage, callback)`` rather than
  ``weakref.finalize``: the same timing (the storage's PyObject dies with the ``StorageImpl``), no
  atexit registry, and the callbacks can be disarmed when the simulation ends.
* **No values.** ``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``, printing, ``.numpy()``,
  ``.cpu()`` / ``.to("cpu")``, ``nonzero``, boolean-mask indexing and other data-dependent ops on a
  simulated tensor raise `DataDependentError` naming the script line. A copy to the host is
  legitimate on a GPU, but it would have to invent the values, and invented values silently steer
  control flow — so it is an error, not zeros.
* **OOM.** The allocator's out-of-memory error surfaces as ``torch.OutOfMemoryError`` (alias
  ``torch.cuda.OutOfMemoryError``) with PyTorch's message, raised from the op that allocated; the
  op's already-allocated outputs are freed first, as C++ unwinding would.
* **autocast.** ``torch.autocast("cuda", dtype)`` / ``torch.cuda.amp.autocast`` set the autocast
  state, but no kernel casts meta tensors, so the function mode applies CUDA's cast policy to the
  ops listed in `vram.run.kernels` (lower precision: matmul/linear/conv/bmm/addmm/baddbmm/SDPA…;
  float32: softmax/log_softmax/layer_norm/losses…), with autocast's weight-cast cache (leaf float32
  tensors that require grad keep their cast copy until the outermost autocast exits). Casts are
  done right to left, the evaluation order GCC gives the C++ wrapper's argument pack.

Also: the autograd engine runs under the function mode, so Python code it calls (custom
``Function.backward``, hooks, ``torch.utils.checkpoint``'s recomputation) sees the simulated GPU as
the forward did (see `vram.run.cuda_api.patch_torch_extras`); ``torch.compile`` runs eagerly,
``GradScaler.step`` steps without reading ``found_inf``, ``UntypedStorage.resize_`` is followed
(see `vram.run.cuda_api`). Limits: ops inside Python-level
torch functions (``F.multi_head_attention_forward``, ``F.normalize``…) are seen at the aten level
only, so they get no autocast casting or SDPA routing — except ``F.multi_head_attention_forward``
(``nn.MultiheadAttention``) and ``F.normalize``, whose inner calls the mode sees
(`vram.run.kernels.TRANSPARENT`). Storage-level moves, which no mode sees
(``torch.load(map_location="cuda")``, a checkpoint saved on a GPU, ``storage.cuda()``), are
charged by `vram.run.cuda_api.patch_storages`, which also makes a simulated storage's
``data_ptr()`` its simulated address.
"""
from __future__ import annotations

import os
import runpy
import sys
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from vram.allocator import history as _history
from vram.allocator.errors import OutOfMemoryError as _SimOOM
from vram.devices.gpus import GpuPreset, resolve_gpu
from vram.frontend import memory as _memory

from . import kernels as _k
from .cuda_api import DeviceProperties, patch_storages, patch_torch_cuda, patch_torch_extras
from .values import DataDependentError, describe, value_error

__all__ = ["DataDependentError", "simulated_cuda", "run_script", "active_sim"]

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_VRAM_DIR = _history.PACKAGE_DIR
_MODE_FRAMES = tuple(os.path.join(_TORCH_DIR, p) for p in (  # frames only the modes add
    "_compile.py", os.path.join("_dynamo", "eval_frame.py"), os.path.join("utils", "_python_dispatch.py"),
    os.path.join("utils", "_device.py"), "overrides.py"))
_SDPA = F.scaled_dot_product_attention
_META = torch.device("meta")
_CPU_COPY = frozenset({"cpu", "numpy", "tolist", "__array__", "__repr__", "__format__", "equal",
                       "allclose", "__complex__"})
_SCALAR = frozenset({"item", "__bool__", "__int__", "__float__", "__index__"})
_DATA_ERRORS = ("meta tensor", "meta device", "no data", "data-dependent", "data dependent",
                "register_meta", "Meta tensors", "has no data")


class _Block:
    """One charged storage: its block, device and the weak reference that frees it."""

    __slots__ = ("ptr", "nbytes", "device", "ref")

    def __init__(self, ptr: int, nbytes: int, device: int, ref: weakref.ref[Any]) -> None:
        self.ptr, self.nbytes, self.device, self.ref = ptr, nbytes, device, ref


class _Sim:
    """State shared by the two modes: the charged storages, workspaces, the current redirect."""

    def __init__(self, props: list[DeviceProperties]) -> None:
        self.props = props
        self.live: dict[int, _Block] = {}
        self.workspaces: dict[tuple[Any, ...], int] = {}
        self.target: int | None = None       # CUDA index the running torch function was sent to
        self.explicit_meta = False           # the running torch function asked for "meta" itself
        self.call: Any = None                # the running top-level torch function
        self.busy = 0
        self.pending: list[tuple[int, int]] = []  # (device, ptr) freed while inside malloc
        self.autocast_cache: dict[int, tuple[weakref.ref[Any], torch.Tensor]] = {}
        self.active = True

    # -- identity ---------------------------------------------------------------------------
    def block_of(self, t: Any) -> _Block | None:
        if type(t) is not torch.Tensor and not isinstance(t, torch.Tensor):
            return None
        try:
            return self.live.get(t.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError, AttributeError):  # sparse, nested, …
            return None

    def idx_of(self, t: Any) -> int | None:
        b = self.block_of(t)
        return None if b is None else b.device

    # -- allocation -------------------------------------------------------------------------
    def malloc(self, idx: int, nbytes: int) -> int:
        allocator = _memory.get_allocator(idx)
        self.busy += 1
        try:
            return allocator.malloc(nbytes, _memory.current_stream(idx).cuda_stream)
        except _SimOOM as e:
            raise torch.OutOfMemoryError(str(e)) from None
        finally:
            self.busy -= 1
            if not self.busy and self.pending:
                self._flush()

    def _free(self, b: _Block) -> None:
        if b.ptr and self.active:
            if self.busy:  # a storage died during our own malloc (garbage collector): later
                self.pending.append((b.device, b.ptr))
            else:
                _memory.get_allocator(b.device).free(b.ptr)
        b.ptr = 0

    def _flush(self) -> None:
        pending, self.pending = self.pending, []
        for device, ptr in pending:
            _memory.get_allocator(device).free(ptr)

    def track(self, storage: Any, idx: int) -> _Block:
        """Charge a new storage to device `idx`; its block is freed when the storage dies."""
        key = storage._cdata
        nbytes = storage.nbytes()
        ptr = self.malloc(idx, nbytes) if nbytes else 0

        def died(ref: Any, key: int = key) -> None:
            b = self.live.get(key)
            if b is not None and b.ref is ref:
                del self.live[key]
                self._free(b)

        b = _Block(ptr, nbytes, idx, weakref.ref(storage, died))
        self.live[key] = b
        return b

    def untrack(self, storage: Any) -> None:
        b = self.live.pop(storage._cdata, None)
        if b is not None:
            self._free(b)

    def resize(self, storage: Any, b: _Block) -> None:
        """A charged storage changed size (``resize_``, ``out=``): CUDA allocates anew, then frees."""
        nbytes = storage.nbytes()
        if nbytes == b.nbytes:
            return
        old = b.ptr
        b.ptr = self.malloc(b.device, nbytes) if nbytes else 0
        b.nbytes = nbytes
        if old:
            _memory.get_allocator(b.device).free(old)

    def storage_resized(self, storage: Any) -> None:
        b = self.live.get(storage._cdata)
        if b is not None:
            self.resize(storage, b)

    def storage_address(self, storage: Any) -> int | None:
        b = self.live.get(storage._cdata)
        return None if b is None else b.ptr

    def storage_to(self, storage: Any, device: torch.device) -> Any:
        """``UntypedStorage.to(device)``: to a simulated GPU, a new charged meta storage (no values
        to copy); a simulated storage to the host would need its values."""
        b = self.live.get(storage._cdata)
        if device.type == "cuda":
            idx = _memory._device_index(device)
            if b is not None and b.device == idx:
                return storage
            moved = torch.UntypedStorage(storage.nbytes(), device=_META)
            self.track(moved, idx)
            return moved
        if b is not None and device.type != "meta":
            raise value_error(f"UntypedStorage.to({device.type!r})")
        return None

    def workspace(self, key: tuple[Any, ...], nbytes: int) -> None:
        """A per-(device, stream, thread) workspace, allocated once and kept (cuBLAS)."""
        if key not in self.workspaces:
            self.workspaces[key] = self.malloc(key[0], nbytes)


class _DispatchMode(TorchDispatchMode):
    """Charges every new output storage of every aten op to the simulated allocator."""

    def __init__(self, sim: _Sim) -> None:
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        sim = self.sim
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        try:
            out = func(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as e:
            if any(s in str(e) for s in _DATA_ERRORS) and any(sim.block_of(t) for t in inputs):
                what = describe(sim.call) if sim.call is not None else f"{func}"
                no_kernel = "no fake impl or Meta kernel" in str(e)
                raise value_error(what, f"{func} has no meta kernel" if no_kernel else "") from None
            raise
        idx: int | None = sim.target
        if idx is None:
            for t in inputs:
                b = sim.block_of(t)
                if b is not None:
                    idx = b.device
                    break
            else:
                if not sim.explicit_meta and not any(t.is_meta for t in inputs):
                    idx = _memory.current_device()
        if idx is None:
            return out
        if func._schema.is_mutable:
            for t in inputs:
                b = sim.block_of(t)
                if b is not None:
                    sim.resize(t.untyped_storage(), b)
        self._charge(func, args, kwargs, out, idx)
        return out

    def _charge(self, func: Any, args: Any, kwargs: Any, out: Any, idx: int) -> None:
        sim = self.sim
        outs = out if isinstance(out, (tuple, list)) else [out]
        name = func.overloadpacket.__name__
        plan = _k.op_plan(name, args, outs, sim.props[idx].multi_processor_count)
        tmps: list[int] = []
        done: list[Any] = []
        seen: set[int] = set()
        try:
            for step, arg in plan:
                if step == "tmp":
                    tmps.append(sim.malloc(idx, arg))
                elif step == "free":
                    _memory.get_allocator(idx).free(tmps[arg])
                    tmps[arg] = 0
                else:
                    for t in tree_leaves(outs[arg]) if arg < len(outs) else ():
                        if isinstance(t, torch.Tensor) and t.is_meta:
                            st = t.untyped_storage()
                            key = st._cdata
                            if key in seen:
                                continue
                            seen.add(key)
                            b = sim.live.get(key)
                            if b is None:
                                sim.track(st, idx)
                                done.append(st)
                            else:
                                sim.resize(st, b)
            if name in _k.CUBLAS_OPS and (outs[0].is_floating_point() or outs[0].is_complex()):
                self._cublas(idx, name, args, kwargs, outs[0])
        except torch.OutOfMemoryError:
            for p in tmps:
                if p:
                    _memory.get_allocator(idx).free(p)
            for st in reversed(done):
                sim.untrack(st)
            del done, outs, out
            raise

    def _cublas(self, idx: int, name: str, args: Any, kwargs: Any, out: torch.Tensor) -> None:
        sim = self.sim
        thread = "autograd" if torch._C._current_autograd_node() is not None else "main"
        stream = _memory.current_stream(idx).cuda_stream
        p = sim.props[idx]
        size = _k.cublas_workspace_size(p.major, p.minor)
        sim.workspace((idx, stream, thread, "cublas"), size)
        if _k.uses_cublaslt(name, args, kwargs, out):
            lt = _k.cublaslt_workspace_size(size)
            if lt:
                sim.workspace((idx, stream, thread, "cublaslt"), lt)


def _parse_device(value: Any) -> tuple[str, int | None] | None:
    """("cuda", index) / ("meta", None) / ("cpu", None) for a device-like value, else None."""
    if isinstance(value, torch.device):
        kind, index = value.type, value.index
    elif isinstance(value, str):
        try:
            d = torch.device(value)
        except RuntimeError:
            return None
        kind, index = d.type, d.index
    elif isinstance(value, int) and not isinstance(value, bool):
        kind, index = "cuda", value
    else:
        return None
    if kind == "cuda":
        return kind, _memory.current_device() if index is None else _memory._device_index(index)
    return kind, None


class _FunctionMode(TorchFunctionMode):
    """Sends CUDA to meta, plays the CUDA tensor to the script, routes SDPA, applies autocast."""

    def __init__(self, sim: _Sim) -> None:
        super().__init__()
        self.sim = sim

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        sim = self.sim
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a Tensor property
            prop = getattr(getattr(func, "__self__", None), "__name__", "")
            if prop in ("device", "is_cuda", "is_meta") and args:
                idx = sim.idx_of(args[0])
                if idx is not None:
                    return torch.device("cuda", idx) if prop == "device" else prop == "is_cuda"
            return func(*args, **kwargs)
        t0 = args[0] if args and isinstance(args[0], torch.Tensor) else None
        b0 = sim.block_of(t0) if t0 is not None else None
        if b0 is not None and t0 is not None:
            if name in _CPU_COPY or (name in _SCALAR and t0.numel() == 1):
                raise value_error(describe(func))
            if name == "data_ptr":  # the simulated address, as a CUDA tensor's would be
                return b0.ptr + t0.storage_offset() * t0.element_size() if b0.ptr else 0
            if name == "get_device":
                return b0.device
            if name == "record_stream" and len(args) > 1 and b0.ptr:
                _memory.get_allocator(b0.device).record_stream(b0.ptr, args[1].cuda_stream)
                return None
        if name == "cuda" and t0 is not None:
            return self._cuda(t0, b0, args, kwargs)
        if func in _k.TRANSPARENT and any(sim.block_of(t) for t in tree_leaves((args, kwargs))):
            return self._call(func, lambda: self._inside(func, args, kwargs), None, False, args, kwargs)
        if name == "pin_memory" and t0 is not None:  # page-locked host memory: not GPU memory
            return t0
        if torch.is_autocast_enabled("cuda"):
            if name in _k.AUTOCAST_BANNED and any(sim.block_of(t) for t in tree_leaves((args, kwargs))):
                raise RuntimeError(_k.AUTOCAST_BANNED[name])
            if name == "cross_entropy" and _k.simple_cross_entropy(args, kwargs) and self._eligible(t0):
                return self._call(func, lambda: _k.cross_entropy_autocast(args, kwargs, self._cast),
                                  None, False, args, kwargs)
            args, kwargs = _k.autocast_args(name, args, kwargs, self._eligible, self._cast)
        if func is _SDPA and args and sim.block_of(args[0]) is not None:
            p = _k.sdpa_args(args, kwargs)
            return self._call(func, lambda: _k.sdpa_cuda(p, _k.select_sdpa_backend(p), func),
                              None, False, args, kwargs)
        target, explicit_meta = None, False
        default = getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)  # set_default_device
        if default is not None and kwargs.get("device") is None and func in _device_constructors():
            kwargs = dict(kwargs, device=default.device)  # its mode sits below this one: apply it here
        if "device" in kwargs:
            d = _parse_device(kwargs["device"])
            if d is not None and d[0] == "cuda":
                kwargs = dict(kwargs, device=_META)
                target = d[1]
            elif d is not None and d[0] == "meta":
                explicit_meta = True
        if name == "to" and t0 is not None:
            args, kwargs, target = self._to(t0, b0, args, kwargs, target)
        return self._call(func, lambda: func(*args, **kwargs), target, explicit_meta, args, kwargs)

    def _call(self, func: Any, run: Callable[[], Any], target: int | None, explicit_meta: bool,
              args: Any = (), kwargs: Any = None) -> Any:
        """Run `run` (the op) with the redirect recorded for the dispatch mode; meta's "no data"
        errors on simulated tensors become `DataDependentError`."""
        sim = self.sim
        saved = (sim.target, sim.explicit_meta, sim.call)
        sim.target, sim.explicit_meta, sim.call = target, explicit_meta, func
        try:
            out = run()
            if target is not None:  # torch.tensor(..., device=) builds its tensor below the modes
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.is_meta and sim.block_of(t) is None:
                        sim.track(t.untyped_storage(), target)
            return out
        except (RuntimeError, NotImplementedError) as e:
            if (isinstance(e, torch.OutOfMemoryError) or not any(s in str(e) for s in _DATA_ERRORS)
                    or not any(sim.block_of(t) for t in tree_leaves((args, kwargs or {})))):
                raise
            raise value_error(describe(func)) from None
        finally:
            sim.target, sim.explicit_meta, sim.call = saved

    def _inside(self, func: Any, args: Any, kwargs: Any) -> Any:
        with self:
            return _k.transparent(func)(*args, **kwargs)

    def _cuda(self, t: torch.Tensor, b: _Block | None, args: Any, kwargs: Any) -> Any:
        """``Tensor.cuda(device=None, non_blocking=False, memory_format=...)``."""
        d = _parse_device(args[1] if len(args) > 1 else kwargs.get("device"))
        idx = d[1] if d is not None and d[0] == "cuda" else _memory.current_device()
        if b is not None and b.device == idx:
            return t
        extra = {k: v for k, v in kwargs.items() if k in ("non_blocking", "memory_format")}
        if len(args) > 2:
            extra["non_blocking"] = args[2]
        return self._call(torch.Tensor.cuda, lambda: torch.Tensor.to(t, _META, copy=b is not None, **extra),
                          idx, False)

    def _to(self, t: torch.Tensor, b: _Block | None, args: Any, kwargs: Any,
            target: int | None) -> tuple[Any, Any, int | None]:
        """``Tensor.to(device|dtype|tensor, ...)``: CUDA devices become meta; host copies need values."""
        new = list(args)
        for i, a in enumerate(new[1:], 1):
            if isinstance(a, torch.Tensor):
                ob = self.sim.block_of(a)
                if ob is not None:
                    target = ob.device
                elif b is not None and not a.is_meta:
                    raise value_error(f"Tensor.to({a.device.type})")
                continue
            d = _parse_device(a)
            if d is None:
                continue
            if d[0] == "cuda":
                new[i], target = _META, d[1]
            elif d[0] == "cpu" and b is not None:
                raise value_error("Tensor.to('cpu')")
        kd = _parse_device(kwargs.get("device")) if "device" in kwargs else None
        if kd is not None and kd[0] == "cpu" and b is not None:
            raise value_error("Tensor.to('cpu')")
        if target is not None and b is not None and b.device != target:
            kwargs = dict(kwargs, copy=True)
        return tuple(new), kwargs, target

    # -- autocast -----------------------------------------------------------------------------
    def _eligible(self, t: torch.Tensor) -> bool:
        return t.is_floating_point() and t.dtype != torch.float64 and self.sim.block_of(t) is not None

    def _cast(self, t: torch.Tensor, to: torch.dtype) -> torch.Tensor:
        """``cached_cast``: a cast copy; float32 leaf parameters keep theirs until autocast exits."""
        if not self._eligible(t) or t.dtype == to:
            return t
        cache = self.sim.autocast_cache
        cacheable = (to in (torch.float16, torch.bfloat16) and t.dtype == torch.float32 and t.requires_grad
                     and t.is_leaf and not t._is_view() and torch.is_autocast_cache_enabled())
        if cacheable:
            hit = cache.get(id(t))
            if hit is not None and hit[0]() is t:
                return hit[1]
        out = t.to(to)
        if cacheable:
            cache[id(t)] = (weakref.ref(t), out)
        return out


_ACTIVE: list[_Sim] = []  # the running `simulated_cuda` blocks' state, innermost last


def active_sim() -> _Sim | None:
    """The state of the innermost running `simulated_cuda` block, or None.

    A hook for tools built on a simulated run (`vram.estimate`): ``active_sim().block_of(t)`` is
    the simulated block of a tensor's storage, ``.workspaces`` the cuBLAS workspaces by key.
    """
    return _ACTIVE[-1] if _ACTIVE else None


@contextmanager
def simulated_cuda(gpu: int | str | GpuPreset = "80GiB", context: int | str = 0, conf: str | None = None,
                   device_count: int = 1, *, arch: str | None = None, name: str | None = None,
                   major: int | None = None, minor: int | None = None,
                   multi_processor_count: int | None = None,
                   **simulate_kwargs: Any) -> Iterator[list[Any]]:
    """Run PyTorch code inside as if on `device_count` CUDA GPUs of `gpu` bytes each.

    `gpu` is a size ("24GiB", bytes) or a card (``"A100-80GB"``: its name, CUDA's total memory,
    compute capability and SM count; see `vram.devices.gpus`). `context` is the CUDA context's share of
    the GPU (what nvidia-smi shows on top of PyTorch's reserved memory); `conf` is a
    ``PYTORCH_CUDA_ALLOC_CONF`` string (None: read the environment). A size is otherwise an H100
    (sm90, 132 SMs); `arch` ("8.0", "sm_86") or `major`/`minor` change the compute capability,
    which decides cuBLAS's workspace size, and `multi_processor_count` flash attention's split
    heuristic. Yields the `vram.SimulatedDevice` list; the simulator's state
    (``vram.memory_summary()`` etc.) remains readable after the block.
    """
    spec = resolve_gpu(gpu, arch)
    name = spec.name if name is None else name
    major = spec.major if major is None else major
    minor = spec.minor if minor is None else minor
    sms = spec.multi_processor_count if multi_processor_count is None else multi_processor_count
    total = spec.total_memory
    devices = _memory.simulate(total, context, device_count, conf, name=name, **simulate_kwargs)
    sim = _Sim([DeviceProperties(name, total, major, minor, sms) for _ in range(device_count)])
    dispatch, function = _DispatchMode(sim), _FunctionMode(sim)
    restore = patch_torch_cuda(sim.props)
    restore_extras = patch_torch_extras(sim.autocast_cache.clear, lambda t: sim.block_of(t) is not None,
                                        sim.storage_resized, function)
    restore_storages = patch_storages(sim.storage_address, sim.storage_to)
    _history.SKIP_PREFIXES.extend(_MODE_FRAMES)  # snapshot stacks without the modes' own frames
    _ACTIVE.append(sim)
    try:
        with dispatch, function:
            yield devices
    finally:
        _ACTIVE.remove(sim)
        for prefix in _MODE_FRAMES:
            _history.SKIP_PREFIXES.remove(prefix)
        restore_storages()
        restore_extras()
        restore()
        sim.autocast_cache.clear()
        sim.active = False  # storages that outlive the block no longer touch the allocator
        sim.live.clear()


def _print_exception(e: BaseException) -> None:
    """Print a traceback as Python would, without the frames the simulation itself adds."""
    te = traceback.TracebackException.from_exception(e)
    te.stack = traceback.StackSummary.from_list(
        [f for f in te.stack if not f.filename.startswith((_VRAM_DIR, "<frozen runpy"))
         and not f.filename.startswith(_MODE_FRAMES) and not f.filename.endswith("runpy.py")])
    sys.stdout.flush()
    sys.stderr.write("".join(te.format()))
    sys.stderr.flush()


def run_script(path: str, argv: Sequence[str] = (), *, summary: bool = False,
               on_exit: Callable[[], None] | None = None, **sim_kwargs: Any) -> int:
    """Run the script at `path` with `argv` under `simulated_cuda`; returns its exit status.

    As ``python path argv...`` would: ``sys.argv`` and ``sys.path[0]`` are the script's,
    ``__name__ == "__main__"``, an uncaught exception prints its traceback and gives status 1
    (a `DataDependentError` prints its one-line message), ``sys.exit(n)`` gives n. `summary`
    prints ``torch.cuda.memory_summary()`` when the script ends (while its globals still hold their
    tensors); `on_exit` is called at that moment too. `sim_kwargs` go to `simulated_cuda`.
    """
    path = os.fspath(path)
    saved_argv, saved_path0 = sys.argv, sys.path[0] if sys.path else None
    sys.argv = [path, *argv]
    script_dir = os.path.dirname(os.path.abspath(path))
    if sys.path:
        sys.path[0] = script_dir
    else:
        sys.path.insert(0, script_dir)
    status = 0
    try:
        with simulated_cuda(**sim_kwargs):
            result: Any = None
            try:
                result = runpy.run_path(path, run_name="__main__")
            except SystemExit as e:
                code = e.code
                status = code if isinstance(code, int) else (0 if code is None else 1)
                if code is not None and not isinstance(code, int):
                    print(code, file=sys.stderr)
            except DataDependentError as e:
                sys.stdout.flush()
                print(f"vram run: {e}", file=sys.stderr, flush=True)
                status = 1
            except Exception as e:  # noqa: BLE001 - the script's own failure, reported as python would
                _print_exception(e)
                status = 1
            finally:
                if summary:
                    print(_memory.memory_summary(), end="")
                if on_exit is not None:
                    on_exit()
                del result
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None:
            sys.path[0] = saved_path0
    return status
