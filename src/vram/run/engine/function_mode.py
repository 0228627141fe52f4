"""The function mode both engines run under (see `vram.run.runtime`): `FunctionMode` sends CUDA
devices to the engine's device (`FunctionMode.device_for`), plays the CUDA tensor to the script
(``.device``, ``.is_cuda``, ``get_device``, ``data_ptr``, reads of values), keeps Parameters
through moves, routes SDPA and the fused fast paths and applies autocast's cast policy."""
from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from vram.frontend import memory as _memory
from vram.run.cuda import patches as _patches
from vram.run.kernels import autocast as _autocast
from vram.run.kernels import ctc as _ctc
from vram.run.kernels import cudnn as _cudnn
from vram.run.kernels import fastpath as _fast
from vram.run.kernels import functions as _functions
from vram.run.kernels import sdpa as _sdpa
from vram.run.kernels import sdpa_choice as _sdpa_choice
from vram.run.kernels import sdpa_jagged as _sdpa_jagged
from vram.run.kernels import sparse as _sparse
from vram.run.memory.lazy_host import LAZY_FACTORIES
from vram.run.memory.op_args import factory_numel
from vram.run.memory.storages import ChargedStorage, SimState
from vram.run.values import known
from vram.run.values.placeholders import describe, needs_data, value_error

from . import reads as _reads
from . import tensor_options as _options

_SDPA = F.scaled_dot_product_attention
_CPU_COPY = frozenset({"cpu", "numpy", "tolist", "__array__", "__repr__", "__format__", "equal",
                       "allclose", "__complex__"})
_SCALAR = frozenset({"item", "__bool__", "__int__", "__float__", "__index__"})
_HOST_READS = frozenset({"data_ptr", "__array__", "__dlpack__", "tobytes"})  # host bytes, read directly

_META = torch.device("meta")
_FAKE = torch._C._TorchDispatchModeKey.FAKE
_PARSE_TO = torch._C._nn._parse_to
#: torch functions that build a tensor from host data below the modes (their values are known)
_HOST_DATA = frozenset({torch.tensor, torch.as_tensor, torch.asarray})
_UNHANDLED = object()  # a step of `FunctionMode.__torch_function__` left the call to the next


def draws_host_default(func: Any, kwargs: dict[str, Any], inputs: list[Any], sim: SimState) -> bool:
    """Is this random op about to draw from the default CPU generator for real?"""
    g = kwargs.get("generator")
    if (g is not None and g is not torch.default_generator) or sim.target is not None:
        return False
    if inputs:
        return not any(t.is_meta for t in inputs)
    d = kwargs.get("device")
    return d is None or torch.device(d).type == "cpu"


def _host_only(sim: SimState, args: Any, kwargs: Any) -> bool:
    """Does a call read lazy host tensors and no other meta tensor (a simulated one, the script's
    own)? Then a tensor its C++ code makes with an input's options (``at::zeros(shape,
    self.options())`` in ``one_hot``) belongs on the host too (`vram.run.engine.lazy`)."""
    lazy = False
    for t in tree_leaves((args, kwargs or {})):
        if isinstance(t, torch.Tensor) and t.is_meta:
            if sim.host.of(t) is None:
                return False
            lazy = True
    return lazy


def parse_device(value: Any) -> tuple[str, int | None] | None:
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
    if kind == "cuda" or (kind != "meta" and kind in known.SIMULATED_DEVICE_TYPES):  # the PrivateUse1 engine's device
        return "cuda", _memory.current_device() if index is None else _memory._device_index(index)
    return kind, None


class FunctionMode(TorchFunctionMode):
    """Sends CUDA to meta, plays the CUDA tensor to the script, routes SDPA, applies autocast."""

    def host_factories(self) -> bool:
        """Do large CPU factories become lazy host tensors now (`vram.run.memory.lazy_host`)? Always
        here: `DispatchMode` records their ops."""
        return True

    def __init__(self, sim: SimState) -> None:
        super().__init__()
        self.sim = sim

    def backward_scope(self, roots: Any) -> AbstractContextManager[Any]:
        """What a backward from `roots` runs under (see `vram.run.engine.lazy.outside_backward`)."""
        return nullcontext()

    def device_for(self, idx: int) -> torch.device:
        """Where a tensor the script puts on ``cuda:idx`` lives: meta (`vram.run.engine`: its own device)."""
        return _META

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch._C._get_dispatch_mode(_FAKE) is not None:  # fake tensors: shapes only, no memory
            return func(*args, **kwargs)
        sim = self.sim
        name = getattr(func, "__name__", "")
        if kwargs.get("pin_memory") is True:  # page-locked host memory is host memory, not the GPU's,
            kwargs = {**kwargs, "pin_memory": False}  # and a CPU build cannot pin (as `pin_memory()`)
        if name == "__get__":  # a Tensor property
            return self._property(func, args, kwargs)
        if name == "__set__" and len(args) == 2 and getattr(getattr(func, "__self__", None), "__name__", "") == "data":
            if self._set_data(args[0], args[1]):
                return None
            return func(*args, **kwargs)
        t0 = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name in ("to", "type_as", "type") and t0 is not None:
            rewritten = _options.rewrite(name, args, kwargs, self._played_device)
            if isinstance(rewritten, str):
                return rewritten
            if rewritten is not None:
                func, name, (args, kwargs) = torch.Tensor.to, "to", rewritten
        b0 = sim.block_of(t0) if t0 is not None else None
        if name == "__setitem__" and b0 is not None:
            args = _functions.setitem_on_host(args)
        done = self._method(func, name, t0, b0, args, kwargs)
        if done is not _UNHANDLED:
            return done
        done = self._kernel(func, name, b0, args, kwargs)
        if done is not _UNHANDLED:
            return done
        if torch.is_autocast_enabled("cuda"):
            if name in _autocast.AUTOCAST_BANNED and any(sim.block_of(t) for t in tree_leaves((args, kwargs))):
                raise RuntimeError(_autocast.AUTOCAST_BANNED[name])
            if name == "cross_entropy" and _autocast.simple_cross_entropy(args, kwargs) and self._eligible(t0):
                return self._call(func, lambda: _autocast.cross_entropy_autocast(args, kwargs, self._cast),
                                  None, False, args, kwargs)
            args, kwargs = _autocast.autocast_args(name, args, kwargs, self._eligible, self._cast)
        if b0 is not None and (variant := _functions.cuda_variant(func, name, args, kwargs, self._again)) is not None:
            return self._call(func, variant, None, False, args, kwargs)
        if name == "_nested_tensor_from_tensor_list" and _patches.strided_nested_on_gpu(
                (list(args) + [None] * 4)[3] if len(args) > 3 else kwargs.get("device"),
                args[0] if args else kwargs.get("list", []), lambda t: sim.seen_idx(t) is not None):
            raise NotImplementedError(_patches.STRIDED_NESTED)  # as_nested_tensor, strided layout
        if func is _SDPA and args and getattr(args[0], "is_nested", False) \
                and (q_idx := sim.seen_idx(getattr(args[0], "_values", None))) is not None:
            # a jagged nested tensor: torch/nested/_internal/sdpa.py with a CUDA GPU's kernel choice
            p, cc = _sdpa_choice.sdpa_args(args, kwargs), sim.props[q_idx]
            return self._call(func, lambda: _sdpa_jagged.jagged_sdpa(p, cc.major, cc.minor), None, False,
                              args, kwargs)
        if func is _SDPA and args and (q_idx := sim.seen_idx(args[0])) is not None:
            # a DTensor too: its wrapper's device is cuda on a GPU, so attention.cpp's CUDA
            # _fused_sdp_choice_stub picks the kernel and DTensor runs it on the local shards
            p, cc = _sdpa_choice.sdpa_args(args, kwargs), sim.props[q_idx]
            backend = _sdpa_choice.select_sdpa_backend
            return self._call(func, lambda: _sdpa.sdpa_cuda(p, backend(p, cc.major, cc.minor), func, cc.major,
                                                            cc.minor), None, False, args, kwargs)
        return self._placed(func, name, t0, b0, args, kwargs)

    def _property(self, func: Any, args: Any, kwargs: Any) -> Any:
        """``t.device``, ``t.is_cuda``…: a simulated tensor is a CUDA one, a lazy host one a CPU one."""
        sim = self.sim
        prop = getattr(getattr(func, "__self__", None), "__name__", "")
        if prop in ("device", "is_cuda", "is_meta", "is_cpu") and args:
            idx = sim.seen_idx(args[0])
            if idx is not None:
                return torch.device("cuda", idx) if prop == "device" else prop == "is_cuda"
            if sim.host.of(args[0]) is not None:  # a lazy host tensor: a CPU tensor to the script
                return torch.device("cpu") if prop == "device" else prop == "is_cpu"
        return func(*args, **kwargs)

    def _played_device(self, t: torch.Tensor) -> torch.device | None:
        """The device the script sees for a simulated (CUDA) or lazy host (CPU) tensor; None for others."""
        idx = self.sim.seen_idx(t)
        if idx is not None:
            return torch.device("cuda", idx)
        return torch.device("cpu") if self.sim.host.live and self.sim.host.of(t) is not None else None

    def _method(self, func: Any, name: str, t0: torch.Tensor | None, b0: ChargedStorage | None, args: Any,
                kwargs: Any) -> Any:
        """A method of a simulated or lazy host tensor the script sees as CUDA's or the CPU's:
        reads of values, ``data_ptr``, ``get_device``, ``record_stream``, ``cuda()``, copies to
        the host, ``pin_memory()``; `_UNHANDLED` for the rest."""
        sim = self.sim
        if name in ("__repr__", "__format__") and b0 is None and t0 is not None and t0.layout in _sparse.LAYOUTS \
                and (idx := sim.seen_idx(t0)) is not None:  # a sparse tensor: from its host copy
            return _reads.sparse_repr(t0, idx, args, kwargs)
        if b0 is not None and t0 is not None:
            if name in _CPU_COPY or (name in _SCALAR and t0.numel() == 1):
                return _reads.read(self.sim, func, name, t0, args, kwargs)
            if name == "data_ptr":  # the simulated address, as a CUDA tensor's would be
                return b0.ptr + t0.storage_offset() * t0.element_size() if b0.ptr else 0
            if name == "get_device":
                return b0.device
            if name in _cudnn.RNN_OPS:
                raise NotImplementedError(_cudnn.rnn_refusal(name))
            if name == "ctc_loss":
                self._ctc_loss(_ctc.arguments(args, kwargs))
            if name == "record_stream" and len(args) > 1:  # an empty storage has no block: nothing
                if b0.ptr:  # to do (CUDACachingAllocator.cpp, recordStream); never C++'s, which
                    _memory.get_allocator(b0.device).record_stream(b0.ptr, args[1].cuda_stream)
                return None  # rejects a simulated Stream (FSDP1's _free_unsharded_flat_param)
        elif t0 is not None and sim.host.live and sim.host.of(t0) is not None:
            if name in _CPU_COPY or name in _SCALAR or name in _HOST_READS:
                return _reads.host_read(self.sim, func, name, t0, args, kwargs)
            if name in ("new", "new_tensor"):  # legacy constructors: a real host tensor, as on the CPU
                with torch._C.DisableTorchFunction():
                    return getattr(torch.empty(0, dtype=t0.dtype), name)(*args[1:], **kwargs)
            if name == "to" and self._to_host(args, kwargs):  # already on the host: meta, as it is
                args = tuple(_META if (d := parse_device(a)) is not None and d[0] == "cpu" else a for a in args)
                kwargs = dict(kwargs, device=_META) if "device" in kwargs else kwargs
                return self._call(func, lambda: func(*args, **kwargs), None, False, args, kwargs)
        if name == "cuda" and t0 is not None:
            return self._cuda(t0, b0, args, kwargs)
        if name in ("copy_", "copy_.default") and b0 is None and t0 is not None and t0.device.type == "cpu" \
                and len(args) > 1 and isinstance(args[1], torch.Tensor) and sim.block_of(args[1]) is not None:
            return _reads.copy_to_host(self.sim, t0, args[1])
        if name == "pin_memory" and t0 is not None:  # page-locked host memory: not GPU memory
            return t0
        return _UNHANDLED

    def _ctc_loss(self, given: dict[str, Any]) -> None:
        """CUDA's CTC loss reads its lengths to the host (the longest target sizes ``log_alpha``):
        unknown ones are a data-dependent read; a call that takes cuDNN's kernel is refused."""
        def values(x: Any) -> list[int] | None:
            if not isinstance(x, torch.Tensor):
                return list(x) if isinstance(x, (list, tuple)) else None
            v = known.cpu_value(self.sim, x)
            return None if v is None or known.assumed(self.sim, x) else [int(n) for n in v.reshape(-1).tolist()]

        for key in ("input_lengths", "target_lengths"):
            if isinstance(given.get(key), torch.Tensor) and values(given[key]) is None:
                raise value_error("torch.ctc_loss()", f"its {key.replace('_', ' ')}, read by the CUDA kernel")
        if _ctc.takes_cudnn(given, torch.backends.cudnn.enabled, values):
            raise NotImplementedError(_ctc.cudnn_refusal())

    def _kernel(self, func: Any, name: str, b0: ChargedStorage | None, args: Any, kwargs: Any) -> Any:
        """Python-level functions whose inner calls this mode must see
        (`vram.run.kernels.functions.TRANSPARENT`) and the fused fast paths a GPU takes
        (`vram.run.kernels.fastpath`); `_UNHANDLED` for the rest."""
        sim = self.sim
        if func in _functions.TRANSPARENT and any(sim.block_of(t) for t in tree_leaves((args, kwargs))):
            return self._call(func, lambda: self._inside(func, args, kwargs), None, False, args, kwargs)
        if func in _fast.FUSED and (b0 := _fast.fused_device_block(sim, args)) is not None:
            cc = sim.props[b0.device]  # nn.MultiheadAttention / TransformerEncoderLayer in inference
            out = self._call(func, lambda: self._again(lambda: _fast.FUSED[func](args, kwargs, cc.major, cc.minor)),
                             None, False, args, kwargs)
            _fast.fused_values(sim, func, args, kwargs, out)
            return out
        return _UNHANDLED

    def _placed(self, func: Any, name: str, t0: torch.Tensor | None, b0: ChargedStorage | None, args: Any,
                kwargs: Any) -> Any:
        """Run `func` with CUDA devices sent to the engine's (`device_for`), ``"meta"`` kept for
        the script's own meta tensors and large CPU factories made lazy host tensors."""
        sim = self.sim
        target, explicit_meta = None, False
        default = torch._GLOBAL_DEVICE_CONTEXT.__dict__.get("device_context")  # set_default_device (a thread-local)
        if default is not None and kwargs.get("device") is None and func in _device_constructors():
            kwargs = dict(kwargs, device=default.device)  # its mode sits below this one: apply it here
        host_factory = False
        if func is _PARSE_TO:  # Module.to's argument parser: the device stays what it says
            return func(*args, **kwargs)
        if "device" in kwargs:
            d = parse_device(kwargs["device"])
            if d is not None and d[0] == "cuda":
                kwargs = dict(kwargs, device=self.device_for(d[1]))
                target = d[1]
            elif d is not None and d[0] == "meta":
                explicit_meta = True
        if name == "to" and t0 is not None and any(parse_device(a) == ("meta", None) for a in (
                *args[1:], kwargs.get("device")) if not isinstance(a, torch.Tensor)):
            explicit_meta = True  # Tensor.to("meta"), Module.to("meta"), accelerate's init_empty_weights
            if sim.host.of(t0) is not None or (b0 is not None and self.device_for(0).type == "meta"):
                kwargs = dict(kwargs, copy=True)  # meta inside (lazy host, meta engine): a copy, not itself
        if (target is None and not explicit_meta and name in LAZY_FACTORIES
                and "out" not in kwargs and func in _device_constructors()
                and ((n := factory_numel(name, args, kwargs)) is None or n > sim.host.limit)
                and self.host_factories()):
            # a CPU factory: lazy if large (one surely small is real at once, with no mode pushed)
            kwargs, host_factory = dict(kwargs, device=_META), True
        if name == "to" and t0 is not None:
            if b0 is not None and self._to_host(args, kwargs):
                return _reads.read(self.sim, func, "to", t0, args, kwargs)
            args, kwargs, target = self._to(t0, b0, args, kwargs, target)
        return self._call(func, lambda: func(*args, **kwargs), target, explicit_meta, args, kwargs, host_factory)

    def _call(self, func: Any, run: Callable[[], Any], target: int | None, explicit_meta: bool,
              args: Any = (), kwargs: Any = None, host_factory: bool = False) -> Any:
        """Run `run` (the op) with the redirect recorded for the dispatch mode; meta's "no data"
        errors on simulated tensors become `DataDependentError`."""
        sim = self.sim
        saved = (sim.target, sim.explicit_meta, sim.call, sim.host_factory, sim.host_call)
        sim.target, sim.explicit_meta, sim.call, sim.host_factory = target, explicit_meta, func, host_factory
        sim.host_call = bool(sim.host.live) and _host_only(sim, args, kwargs)
        try:
            out = run()
            if target is not None:  # torch.tensor(..., device=) builds its tensor below the modes
                for t in tree_leaves(out):
                    # a wrapper subclass (DTensor from empty_like, to_empty) has no storage of its
                    # own: its inner tensors were charged as they were made
                    if isinstance(t, torch.Tensor) and t.is_meta and sim.block_of(t) is None \
                            and not is_traceable_wrapper_subclass(t):
                        b = sim.track(t.untyped_storage(), target)
                        if func in _HOST_DATA and t.numel() <= sim.value_limit:
                            with torch._C.DisableTorchFunction():  # the same data, built on the host
                                host = func(*args, **dict(kwargs, device="cpu"))
                            b.value = host.untyped_storage()
            return out
        except (RuntimeError, NotImplementedError) as e:
            if (refusal := _sparse.sparse_refusal(e, describe(func))) is not None:
                raise NotImplementedError(refusal) from None
            if (isinstance(e, torch.OutOfMemoryError) or not needs_data(e)
                    or not any(sim.block_of(t) for t in tree_leaves((args, kwargs or {})))):
                raise
            raise value_error(describe(func)) from None
        finally:
            sim.target, sim.explicit_meta, sim.call, sim.host_factory, sim.host_call = saved

    def _set_data(self, t: Any, value: Any) -> bool:
        """``t.data = value`` between the host and a simulated GPU; False for any other pair.

        On a GPU, ``Module._apply`` (``.to``/``.cuda``/``.to_empty``/``.cpu``) and ``p.data =
        p.data.cuda()`` keep each Parameter object and swap its data in place (``set_data``), so
        identity, ties, attributes, hooks and optimizer references survive a move. Meta and CPU
        tensors cannot share a ``TensorImpl`` type, so here ``t`` swaps implementations with a
        fresh alias of `value` (same storage, sizes, strides) that has `t`'s ``requires_grad``:
        the Python object — its class, ``__dict__``, hooks — stays. A gradient moves with the data
        (``_apply`` then finds it already moved), as set_data would let ``_apply`` move it next.
        """
        sim = self.sim
        if not (isinstance(t, torch.Tensor) and isinstance(value, torch.Tensor)):
            return False
        on_sim = sim.block_of(t) is not None
        host = value if on_sim else t  # a lazy host tensor is meta: the same kind as meta GPU ones
        if on_sim == (sim.block_of(value) is not None) or not (host.device.type == "cpu" or (
                self.device_for(0).type != "meta" and sim.host.of(host) is not None)):
            return False
        alias = value.detach()
        if t.requires_grad:
            alias.requires_grad_(True)
        grad = t.grad
        if grad is not None:
            t.grad = None
        torch._C._swap_tensor_impl(t, alias)
        # Hooks registered from Python live in the implementation's autograd metadata: re-attach
        # the object's hook dicts to its new implementation.
        for hooks in ("_backward_hooks", "_post_accumulate_grad_hooks"):
            if getattr(t, hooks, None) is not None:
                setattr(t, hooks, getattr(t, hooks))
        if grad is not None:
            if sim.idx_of(grad) != sim.idx_of(t):
                target = torch.device("cpu") if on_sim else torch.device("cuda", sim.idx_of(t))
                with self:  # the move itself runs under the simulation, as the script's would
                    grad = grad.to(target)
            t.grad = grad
        return True

    def _to_host(self, args: Any, kwargs: Any) -> bool:
        """Does ``Tensor.to(...)`` name the CPU?"""
        for a in list(args[1:]) + [kwargs.get("device")]:
            d = parse_device(a) if not isinstance(a, torch.Tensor) else None
            if d is not None and d[0] == "cpu":
                return True
        return False

    def _inside(self, func: Any, args: Any, kwargs: Any) -> Any:
        return self._again(lambda: _functions.transparent(func)(*args, **kwargs))

    def _again(self, run: Callable[[], Any]) -> Any:
        """`run` with this mode pushed again (a torch-function mode runs with itself popped)."""
        with self:
            return run()

    def _cuda(self, t: torch.Tensor, b: ChargedStorage | None, args: Any, kwargs: Any) -> Any:
        """``Tensor.cuda(device=None, non_blocking=False, memory_format=...)``."""
        d = parse_device(args[1] if len(args) > 1 else kwargs.get("device"))
        idx = d[1] if d is not None and d[0] == "cuda" else _memory.current_device()
        if b is not None and b.device == idx:
            return t
        extra = {k: v for k, v in kwargs.items() if k in ("non_blocking", "memory_format")}
        if len(args) > 2:
            extra["non_blocking"] = args[2]
        copy = b is not None or self.sim.host.of(t) is not None  # meta to meta would alias
        to = self.device_for(idx)
        return self._call(torch.Tensor.cuda, lambda: torch.Tensor.to(t, to, copy=copy, **extra), idx, False)

    def _to(self, t: torch.Tensor, b: ChargedStorage | None, args: Any, kwargs: Any,
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
            d = parse_device(a)
            if d is None:
                continue
            if d[0] == "cuda":
                new[i], target = self.device_for(d[1]), d[1]
            elif d[0] == "cpu" and b is not None:
                raise value_error("Tensor.to('cpu')")
        kd = parse_device(kwargs.get("device")) if "device" in kwargs else None
        if kd is not None and kd[0] == "cpu" and b is not None:
            raise value_error("Tensor.to('cpu')")
        if target is not None and (b.device != target if b is not None else self.sim.host.of(t) is not None):
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


