"""Reads of a simulated tensor's values by the script (``.cpu()``, ``.item()``, ``print``,
``.tolist()``, a host tensor's ``copy_``): exact where the values are known
(`vram.run.values.known`), else a placeholder recorded in the run's report, else
`vram.run.values.placeholders.DataDependentError`; and a lazy host tensor's bytes, computed when
read (`vram.run.memory.lazy_host`)."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from vram.run.memory.storages import SimState
from vram.run.values import known
from vram.run.values.placeholders import describe, value_error

__all__ = ["copy_to_host", "copy_values", "host_read", "read"]


def _repr_as(host: torch.Tensor, t: torch.Tensor, device: str | None = None) -> str:
    """``repr`` of the script's tensor `t` from `host`, a CPU tensor holding its values: torch's
    own formatter, with the suffixes `t` has and `host` lacks (``device='cuda:N'`` first, then
    ``grad_fn=`` or ``requires_grad=``) added where ``torch/_tensor_str.py`` puts them, so the
    lines wrap as they would."""
    import torch._tensor_str as tensor_str

    original = tensor_str._add_suffixes
    grad_fn = t.grad_fn
    grad_name = type(grad_fn).__name__ if grad_fn is not None else None
    if grad_name == "CppFunction":
        grad_name = grad_fn.name().rsplit("::", 1)[-1]  # type: ignore[union-attr]

    def add_suffixes(text: str, suffixes: list[str], indent: int, force_newline: bool) -> str:
        extra = list(suffixes)
        if device is not None:
            extra.insert(0, f"device='{device}'")
        if grad_name is not None:
            extra.append(f"grad_fn=<{grad_name}>")
        elif t.requires_grad:
            extra.append("requires_grad=True")
        return original(text, extra, indent, force_newline)

    tensor_str._add_suffixes = add_suffixes
    try:
        with torch._C.DisableTorchFunction():
            return torch.Tensor.__repr__(host)
    finally:
        tensor_str._add_suffixes = original


def _host_to(host: torch.Tensor, args: Any, kwargs: Any) -> torch.Tensor:
    """``simulated.to("cpu", ...)`` applied to `host`, its CPU copy: the call's other arguments
    (dtype, copy, memory format) as a GPU run would apply them."""
    with torch._C.DisableTorchFunction():
        return torch.Tensor.to(host, *args[1:], **kwargs)


def read(sim: SimState, func: Any, name: str, t: torch.Tensor, args: Any, kwargs: Any) -> Any:
    """A read of a simulated tensor's values: exact when they are known (`vram.run.values.known`);
    else, unless the run is strict, a placeholder recorded in the run's report; else
    `DataDependentError` naming the script's line."""
    what = describe(func) if name != "to" else "Tensor.to('cpu')"
    used: list[Any] = []
    try:
        value = known.to_cpu_assuming(sim, t, used)
        if name in ("cpu", "to", "numpy", "__repr__", "__format__"):
            with torch._C.DisableTorchFunction():
                host = value.clone()
            if name == "numpy":
                if t.requires_grad:
                    raise RuntimeError("Can't call numpy() on Tensor that requires grad. "
                                       "Use tensor.detach().numpy() instead.")
                result: Any = host.numpy()
            elif name == "to":
                result = _host_to(host, args, kwargs)
            elif name == "__format__" and t.dim() == 0:
                result = format(host.item(), *args[1:])
            elif name in ("__repr__", "__format__"):
                result = _repr_as(host, t, f"cuda:{sim.idx_of(t)}")
            else:
                result = host
        else:
            cpu_args, cpu_kwargs = tree_map(lambda x: known.to_cpu_assuming(sim, x, used), (args, kwargs))
            with torch._C.DisableTorchFunction():
                result = func(*cpu_args, **cpu_kwargs)
    except known.Unknown:
        if not sim.strict_values and name in ("cpu", "to", "numpy"):  # too large for a value copy
            host = known.placeholder(t)
            sim.report.record(what, f"zeros {list(t.shape)}{known.reason(sim, t)}")
            if name == "to":  # with its other arguments (``.to("cpu", torch.uint8)``: uint8 zeros)
                return _host_to(host, args, kwargs)
            return host.numpy() if name == "numpy" else host
        raise value_error(what) from None
    if used:
        placeholder = not known.known(sim, t)
        shown = f"zeros {list(t.shape)}" if isinstance(result, torch.Tensor) else repr(result)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        sim.report.record(what, shown + known.reason(sim, t), derived=not placeholder)
    return result


def host_read(sim: SimState, func: Any, name: str, t: torch.Tensor, args: Any, kwargs: Any) -> Any:
    """A lazy host tensor's bytes are needed: computed now (`vram.run.memory.lazy_host`), and the
    read runs on them. ``.cpu()`` of a host tensor is the tensor itself."""
    if name == "cpu":
        return t
    if name == "numpy" and t.requires_grad:
        raise RuntimeError("Can't call numpy() on Tensor that requires grad. "
                           "Use tensor.detach().numpy() instead.")
    host = sim.host
    real_args, real_kwargs = tree_map(lambda x: host.real(x) if host.of(x) is not None else x, (args, kwargs))
    if name == "__repr__":  # the view has no autograd state: say what the script's tensor has
        return _repr_as(real_args[0], t)
    with torch._C.DisableTorchFunction():
        return func(*real_args, **real_kwargs)


def copy_to_host(sim: SimState, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``host.copy_(simulated)`` (a device-to-host copy, also from C++: DDP's bucket indices):
    the source's known values, else a placeholder as for any read (`read`)."""
    value = read(sim, torch.Tensor.cpu, "cpu", src, (src,), {})
    with torch._C.DisableTorchFunction():
        return dst.copy_(value)


def sparse_repr(t: torch.Tensor, idx: int, args: Any, kwargs: Any) -> str:
    """``repr``/``format`` of a simulated sparse tensor: its host copy's (``t.cpu()``: the components'
    known values, or placeholders recorded as reads), with the CUDA device it is on."""
    host = t.cpu()
    if len(args) > 1 and args[1]:  # format(t, spec): as torch, the repr unless t is a scalar
        with torch._C.DisableTorchFunction():
            return torch.Tensor.__format__(host, *args[1:], **kwargs)
    return _repr_as(host, t, f"cuda:{idx}")


def copy_values(sim: SimState, src: torch.Tensor, dst: torch.Tensor) -> None:
    """``_copy_from(src, dst)`` between the host and a simulated GPU (``copy_impl`` in
    ``ATen/native/Copy.cpp`` hands cross-device copies of PrivateUse1 tensors to it): a simulated
    `dst` learns `src`'s values when they are known (else they become unknown); a host `dst`
    gets them, or a placeholder recorded as a read."""
    if sim.block_of(dst) is not None:
        value = known.cpu_value(sim, src)
        if value is None or known.assumed(sim, src):
            b = sim.block_of(dst)
            if b is not None:
                b.forget()
            if value is None:
                return
        derived = sim.block_of(src) is not None  # a copy between simulated tensors: a derived constant
        known.define(sim, dst, value.to(dst.dtype).expand(dst.shape), known.assumed(sim, src),
                     max(sim.value_limit, known.DERIVED_LIMIT) if derived else None)
        return
    used: list[Any] = []
    try:
        value = known.to_cpu_assuming(sim, src, used)
    except known.Unknown:
        if sim.strict_values:
            raise value_error(describe(sim.call) if sim.call is not None else "a copy to the host") from None
        value = known.placeholder(src)
        used.append(True)
    if used:
        what = describe(sim.call) if sim.call is not None else "a copy to the host"
        sim.report.record(what, f"zeros {list(src.shape)}{known.reason(sim, src)}", derived=known.known(sim, src))
    dst.copy_(value)
