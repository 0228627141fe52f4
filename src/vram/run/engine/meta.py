"""The meta engine, a debugging aid (``vram run --backend meta``): simulated tensors live on
``meta`` and `DispatchMode` charges every new output storage of every aten op, with the shared
`vram.run.engine.function_mode.FunctionMode` sending CUDA devices to meta. A dispatch mode and
meta tensors are both "subclass-like" to ``at::isTensorSubclassLike``
(``ATen/TensorSubclassLikeUtils.h``), so backward formulas take PyTorch's out-of-place paths,
which a GPU does not: the figures differ from the PrivateUse1 engine's (`vram.run.engine`), whose
are the GPU's. Useful to tell an engine's fault from a kernel rule's: the same script on both."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from vram.frontend import memory as _memory
from vram.run.kernels import blas as _blas
from vram.run.kernels import cudnn as _cudnn
from vram.run.kernels import plan as _plan
from vram.run.memory.lazy_host import seeded
from vram.run.memory.storages import SimState
from vram.run.values import known
from vram.run.values.placeholders import describe, needs_data, value_error

from .dynamo_guard import import_dynamo_when_compiling
from .function_mode import draws_host_default, parse_device
from .outputs import cublas_if_device, data_dependent, mask_counts

__all__ = ["DispatchMode"]

_META = torch.device("meta")
_FAKE = torch._C._TorchDispatchModeKey.FAKE
_NATIVE_BN = torch.ops.aten.native_batch_norm.default


@import_dynamo_when_compiling
class DispatchMode(TorchDispatchMode):
    """Charges every new output storage of every aten op to the simulated allocator."""

    def __init__(self, sim: SimState) -> None:
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(hasattr(t, "__tensor_flatten__") for t in types):
            return NotImplemented  # a wrapper subclass (DTensor): its ops on inner tensors come here
        if torch._C._get_dispatch_mode(_FAKE) is not None:
            return func(*args, **(kwargs or {}))  # fake tensors (DTensor's sharding propagation)
        if func in self.sim.ops:  # with this mode on: what the replacement allocates is charged
            with self:
                replaced = self.sim.ops[func](*args, **(kwargs or {}))
            if replaced is not NotImplemented:  # declined: the op's own kernel, as below
                return replaced
        kwargs = kwargs or {}
        sim = self.sim
        direct: int | None = None
        if isinstance(kwargs.get("device"), torch.device) and kwargs["device"].type == "cuda":
            # an aten op asked for CUDA without the function mode seeing it (called while that
            # mode is off: inside a __torch_function__ or a subclass's __torch_dispatch__, e.g.
            # DTensor's RNG tracker copying get_rng_state() to the GPU): meta, on that device
            direct = parse_device(kwargs["device"])[1]  # type: ignore[index]
            kwargs = dict(kwargs, device=_META)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        host = sim.host
        if sim.host_factory and not inputs:  # a large CPU factory: lazy (vram.run.memory.lazy_host)
            return host.factory(func, args, kwargs)
        lazy = bool(host.live) and any(host.of(t) is not None for t in inputs)
        if lazy:
            if direct is None and sim.target is None and not any(sim.block_of(t) for t in inputs):
                return host.on_host(func, args, kwargs, inputs, sim.explicit_meta)  # no GPU in it
        elif host.ledger.owing and seeded(func) and draws_host_default(func, kwargs, inputs, sim):
            host.ledger.settle()  # the CPU generator is about to be used: pay the deferred draws
        computed, computed_assumed = None, False
        try:
            run = _plan.CUDA_META.get(func, func)  # a meta kernel that is not the CUDA kernel: CUDA's
            out = run(*host.on_meta(args), **host.on_meta(kwargs)) if lazy else run(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as e:
            if needs_data(e) and any(sim.block_of(t) for t in inputs):
                computed, computed_assumed = data_dependent(sim, func, args, kwargs)
                if computed is None:
                    what = describe(sim.call) if sim.call is not None else f"{func}"
                    no_kernel = "no fake impl or Meta kernel" in str(e)
                    raise value_error(what, f"{func} has no meta kernel" if no_kernel else "") from None
                out = known.meta_outputs(computed)
            else:
                raise
        idx: int | None = sim.target if direct is None else direct
        if idx is None and not (sim.explicit_meta and kwargs.get("device") == _META):  # .to("meta"): no GPU
            for t in inputs:
                b = sim.block_of(t)
                if b is not None:
                    idx = b.device
                    break
            else:
                if not sim.explicit_meta and not any(t.is_meta for t in inputs):
                    idx = _memory.current_device()
        if idx is None:
            if lazy:  # a copy the script asked to have on meta is a meta tensor, not a lazy host one
                host.record(func, args, kwargs, out, new_outputs=not sim.explicit_meta)
            return out
        if lazy:  # e.g. a copy from the GPU into a lazy host buffer: the buffer's recipe grows
            host.record(func, args, kwargs, out, new_outputs=False)
        if func is _NATIVE_BN:  # inference on cuDNN: only the output (as the PrivateUse1 engine)
            out = _cudnn.cudnn_batch_norm_outputs("native_batch_norm", args, out)
        if func._schema.is_mutable:
            for t in inputs:
                b = sim.block_of(t)
                if b is not None:
                    sim.resize(t.untyped_storage(), b)
        self._charge(func, args, kwargs, out, idx)
        known.propagate(sim, func, args, kwargs, out, inputs, computed, computed_assumed)
        return out

    def _charge(self, func: Any, args: Any, kwargs: Any, out: Any, idx: int) -> None:
        sim = self.sim
        outs = out if isinstance(out, (tuple, list)) else [out]
        name = func.overloadpacket.__name__
        props = sim.props[idx]
        plan = _plan.op_plan(name, args, outs, props.multi_processor_count, props.max_threads_per_multi_processor,
                             (props.major, props.minor), kwargs, mask_counts(sim, name, args, kwargs))
        done: list[Any] = []
        seen: set[int] = set()

        def on_out(arg: int) -> None:
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

        try:
            sim.run_plan(idx, plan, name in _blas.CUBLAS_OPS, on_out,
                         lambda: cublas_if_device(sim, idx, name, args, kwargs, outs[0]))
        except torch.OutOfMemoryError:
            for st in reversed(done):
                sim.untrack(st)
            del done, outs, out
            raise
