"""What Dynamo sees of the simulated GPU while it traces the script's code under ``vram run``.

Dynamo traces with the run's function mode off (`backend._untraced_mode_stack`), so the real
tensors it reads are on the simulated device (``vramsim``) and its fake tensors too. Where code
Dynamo traces branches on the device, it must take a GPU's branch:

* a tensor's ``device`` (``x.device.type == "cuda"``, ``x.is_cuda``, ``torch.autocast(x.device.type)``:
  Hugging Face's rotary embeddings) is ``cuda:N`` in Dynamo's view of it
  (``TensorVariable.specialize``, whence ``method_attr_device`` and ``method_attr_is_cuda``);
* a tensor the traced code makes on ``cuda`` (``torch.ones(..., device="cuda")``, ``.to("cuda")``,
  ``.cuda()``)
  is a fake tensor on the simulated device, where the script's tensors are: Dynamo's fake run of
  each node (``utils.run_node``) gets the simulated device for a ``cuda`` one (this process's
  only GPU), so fake propagation finds one device, as on a GPU; the graph keeps the ``cuda``
  argument, which the compile process compiles as written;
* a compiled optimizer step's state is made capturable when every parameter is on a GPU
  (``OptimizerVariable._set_capturable`` asks ``p.is_cuda`` of the real parameters).
"""
from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

_SIMULATED = "vramsim"


def _as_cuda(device: Any) -> Any:
    """``vramsim:N`` as ``cuda:N``; any other device as it is."""
    if isinstance(device, torch.device) and device.type == _SIMULATED:
        return torch.device("cuda", device.index or 0)
    return device


def _as_simulated(device: Any) -> Any:
    """A ``cuda[:N]`` device (or its name) as the simulated ``vramsim:N`` (no index: the current
    device); any other value as it is."""
    if isinstance(device, str) and (device == "cuda" or device.startswith("cuda:")):
        device = torch.device(device)
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device(_SIMULATED, torch.cuda.current_device() if device.index is None else device.index)
    return device


def _simulated_device(value: Any) -> Any:
    """A ``cuda`` ``torch.device`` as the simulated one; any other value (a string too) as it is."""
    return _as_simulated(value) if isinstance(value, torch.device) else value


class _CudaNamesSimulated(torch.overrides.TorchFunctionMode):
    """``cuda`` named as a ``device=`` or ``Tensor.to``'s target, inside a call Dynamo runs whole
    on fake tensors, is the simulated device."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            args = tuple(_as_simulated(a) for a in args)
        if "device" in kwargs:
            kwargs = dict(kwargs, device=_as_simulated(kwargs["device"]))
        return func(*args, **kwargs)


def install(put: Callable[[Any, str, Any], None]) -> None:
    """Put the views in place (`put`: the run's attribute patches, undone at its end)."""
    from torch._dynamo.variables import optimizer
    from torch._dynamo.variables.tensor import TensorVariable

    specialize = TensorVariable.specialize

    def specialize_on_cuda(value: torch.Tensor) -> dict[str, Any]:
        props = specialize(value)
        props["device"] = _as_cuda(props.get("device"))
        return props

    put(TensorVariable, "specialize", staticmethod(specialize_on_cuda))
    from torch._dynamo import utils

    run_node = utils.run_node

    def run_node_on_simulated_device(tracer: Any, node: Any, args: Any, kwargs: Any, nnmodule: Any) -> Any:
        # a device anywhere; a device's name as a ``device=`` argument or ``Tensor.to``'s
        moves = node.target in ("to", torch.Tensor.to)
        args = torch.fx.node.map_aggregate(args, _as_simulated if moves else _simulated_device)
        kwargs = {k: torch.fx.node.map_aggregate(v, _as_simulated if k == "device" or moves else _simulated_device)
                  for k, v in kwargs.items()}
        if node.op == "call_function" and isinstance(node.target, types.FunctionType):
            # a Python function run whole (DTensor.from_local moves its input to the device
            # mesh's ``cuda``): the ``cuda`` it names inside is the simulated device too
            with _CudaNamesSimulated():
                return run_node(tracer, node, args, kwargs, nnmodule)
        if node.op == "call_method" and node.target == "cuda" and isinstance(args[0], torch.Tensor):
            # Tensor.cuda(device=None, non_blocking=False): a copy to the (simulated) GPU
            device = args[1] if len(args) > 1 else kwargs.get("device")
            device = _as_simulated(torch.device("cuda") if device is None else
                                   torch.device("cuda", device) if isinstance(device, int) else device)
            return args[0].to(device, non_blocking=bool(kwargs.get("non_blocking", False)))
        return run_node(tracer, node, args, kwargs, nnmodule)

    put(utils, "run_node", run_node_on_simulated_device)
    set_capturable = optimizer.OptimizerVariable._set_capturable

    def set_capturable_on_gpu(self: Any, tx: Any) -> None:
        torch.Tensor.is_cuda = property(  # type: ignore[method-assign,assignment]
            lambda t: t.device.type in ("cuda", _SIMULATED))
        try:
            set_capturable(self, tx)
        finally:
            del torch.Tensor.is_cuda  # TensorBase's own again

    put(optimizer.OptimizerVariable, "_set_capturable", set_capturable_on_gpu)
