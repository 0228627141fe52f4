"""The model, inputs, optimizer and default training step of `vram.estimate` (layer 4; needs torch)."""
from __future__ import annotations

import copy
import os
import sys
from collections.abc import Iterable, Mapping
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn as nn

from vram.run.engine import BackendState

from .trace import Tracker, unpack


def meta_clone(model: nn.Module) -> nn.Module:
    """A deep copy of `model` whose parameters and buffers are empty meta tensors."""
    memo: dict[int, Any] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None and id(p) not in memo:
                memo[id(p)] = type(p)(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad) \
                    if isinstance(p, nn.Parameter) else torch.empty_like(p, device="meta")
        for b in m._buffers.values():
            if b is not None and id(b) not in memo:
                memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def to_gpu(model: nn.Module, sim: Any) -> nn.Module:
    """``model.to("cuda")`` for a model `build_model` made: each parameter and buffer not yet on
    the simulated GPU gets a GPU tensor of its shape, in ``Module._apply``'s order (children, then
    parameters, then buffers), one allocation each as ``.to`` makes. Under the meta engine a meta
    tensor *is* a simulated one and ``.to`` does it. The PrivateUse1 engine cannot copy out of a
    meta tensor, so there the move is ``torch.empty_like`` swapped into the same Python object
    (``torch._C._swap_tensor_impl``, as `vram.run.engine.function_mode.FunctionMode._set_data`
    moves a host tensor): ties, ``Parameter`` objects and hooks survive, and a tied parameter
    moves once, as ``.to`` finds it already moved on its second visit."""
    if not isinstance(sim, BackendState):
        return model.to("cuda")

    def move(t: torch.Tensor) -> torch.Tensor:
        if sim.block_of(t) is not None:
            return t
        moved = _empty_like_on_gpu(t).requires_grad_(t.requires_grad)
        torch._C._swap_tensor_impl(t, moved)
        return t

    _apply(model, move)
    return model


#: (sizes, strides) -> the permutation ``empty_like`` gives a tensor of that layout
_PERMUTATIONS: dict[tuple[Any, ...], list[int]] = {}


def _empty_like_on_gpu(t: torch.Tensor) -> torch.Tensor:
    """``torch.empty_like(t, device="cuda")`` for a meta `t`: its Meta kernel is torch's Python
    reference (``torch._refs.empty_like``), which calls ``torch.empty_permuted`` with the
    permutation ``compute_elementwise_output_logical_to_physical_perm`` finds from `t`'s sizes
    and strides alone; that permutation is worked out once per layout and the same call made."""
    if not t.is_meta or t.layout != torch.strided:
        return torch.empty_like(t, device="cuda")
    key = (tuple(t.shape), t.stride())
    perm = _PERMUTATIONS.get(key)
    if perm is None:
        from torch._prims_common import compute_elementwise_output_logical_to_physical_perm

        perm = _PERMUTATIONS[key] = compute_elementwise_output_logical_to_physical_perm(t)[0]
    return torch.empty_permuted(t.shape, perm, dtype=t.dtype, layout=t.layout, device="cuda", pin_memory=False)


def _apply(module: nn.Module, fn: Any) -> None:
    for child in module.children():
        _apply(child, fn)
    for store in (module._parameters, module._buffers):
        for t in store.values():
            if t is not None:
                fn(t)


def _on_sim(model: nn.Module, sim: Any) -> bool:
    return any(sim.block_of(t) is not None for t in (*model.parameters(), *model.buffers()))


def build_model(model: Any, sim: Any) -> nn.Module:
    """The model to train, before ``.to("cuda")``; called inside the simulation.

    A module is cloned onto meta (never modified). A factory is called under
    ``torch.device("meta")`` (if it fails there, as it is): parameters it creates on "cuda"
    itself are charged as it creates them and the model is used as built; otherwise the model
    is cloned onto meta, so a factory handing out a shared module cannot have it modified.
    """
    if isinstance(model, nn.Module):
        return meta_clone(model)
    if not callable(model):
        raise TypeError(f"model must be an nn.Module or a zero-argument callable, got {type(model).__name__}")
    try:
        with torch.device("meta"):
            built = model()
    except (RuntimeError, NotImplementedError):  # the factory needs values: build it for real
        built = model()
    if not isinstance(built, nn.Module):
        raise TypeError(f"the model factory returned {type(built).__name__}, not an nn.Module")
    return built if _on_sim(built, sim) else meta_clone(built)


def materialize(x: Any) -> Any:
    """New simulated CUDA tensors shaped like the example inputs (same structure)."""
    if isinstance(x, torch.Tensor):
        t = torch.empty(x.shape, dtype=x.dtype, device="cuda")
        return t.requires_grad_() if x.requires_grad else t
    if isinstance(x, torch.Size):
        return torch.empty(x, device="cuda")
    if isinstance(x, Mapping):
        return {k: materialize(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        items = [materialize(v) for v in x]
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
    return x


def call_model(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _float_leaves(out: Any) -> Iterable[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        if out.is_floating_point() and out.requires_grad:
            yield out
    elif isinstance(out, Mapping):
        for v in out.values():
            yield from _float_leaves(v)
    elif isinstance(out, (list, tuple)):
        for v in out:
            yield from _float_leaves(v)


def sum_outputs(out: Any) -> torch.Tensor:
    """The default loss: a ``loss`` the model returns in a mapping (Hugging Face's ``ModelOutput``
    when given ``labels``) — what its users call ``backward()`` on; else the sum of every
    floating-point output's sum."""
    if isinstance(out, Mapping) and isinstance(out.get("loss"), torch.Tensor) and out["loss"].requires_grad:
        return out["loss"]
    leaves = list(_float_leaves(out))
    if not leaves:
        raise ValueError("the model's output has no floating-point tensor that requires grad; pass loss=")
    loss = leaves[0].sum()
    for t in leaves[1:]:
        loss = loss + t.sum()
    return loss


def make_optimizer(optimizer: Any, model: nn.Module) -> Any:
    if optimizer is None:
        return None
    if callable(optimizer) and not isinstance(optimizer, str):
        return optimizer(model.parameters())
    makers = {"adam": lambda p: torch.optim.Adam(p, lr=1e-3), "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
              "sgd": lambda p: torch.optim.SGD(p, lr=1e-2)}
    key = str(optimizer).lower()
    if key not in makers:
        raise ValueError(f"unknown optimizer {optimizer!r}: expected adam, adamw, sgd, a callable or None")
    return makers[key](model.parameters())


def default_step(m: nn.Module, inputs: Any, opt: Any, tr: Tracker, loss_fn: Any, amp_dtype: Any,
                  scaler: Any, grad_accum: int) -> None:
    """forward + loss (under autocast), backward, ×grad_accum; optimizer step; zero_grad(set_to_none)."""
    for micro in range(grad_accum):
        if micro:
            tr.set_phase("forward")
        with torch.autograd.graph.saved_tensors_hooks(tr.pack, unpack):
            with torch.autocast("cuda", dtype=amp_dtype) if amp_dtype is not None else nullcontext():
                out = call_model(m, inputs)
                loss = loss_fn(out) if loss_fn is not None else sum_outputs(out)
                del out
            if grad_accum > 1:
                loss = loss / grad_accum
        tr.set_phase("backward")
        (scaler.scale(loss) if scaler is not None else loss).backward()
        del loss
        tr.mark_grads(m)
    if opt is None:
        m.zero_grad(set_to_none=True)
        return
    tr.set_phase("optimizer")
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)


def describe_inputs(x: Any, prefix: str = "") -> list[str]:
    if isinstance(x, torch.Tensor):
        return [f"{prefix}{'x'.join(map(str, x.shape)) or 'scalar'} {str(x.dtype).replace('torch.', '')}"]
    if isinstance(x, torch.Size):
        return [f"{prefix}{'x'.join(map(str, x)) or 'scalar'} float32"]
    if isinstance(x, Mapping):
        return [s for k, v in x.items() for s in describe_inputs(v, f"{k}=")]
    if isinstance(x, (list, tuple)):
        return [s for v in x for s in describe_inputs(v, prefix)]
    return []


def micro_inputs(x: Any, n: int) -> Any:
    """One of `n` micro-batches of example inputs `x` (meta tensors of the first chunk's shape)."""
    if isinstance(x, torch.Tensor):
        if x.dim() == 0 or x.shape[0] % n:
            raise ValueError(f"the batch ({x.shape[0] if x.dim() else 'a scalar'}) must split into {n} "
                             "micro-batches of equal size")
        return torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)):
        return tuple(micro_inputs(v, n) for v in x)
    raise ValueError("pipeline parallel needs tensor inputs (a tensor or a tuple of them)")


def load_factory(target: str, what: str = "model") -> Any:
    """MODULE:FUNC (or path/to/file.py:FUNC) -> the callable; the current directory is searched first.
    PyPI's CUDA-built torchvision is made importable first, as under ``vram run``
    (`vram.run.cuda.compat`): factories from torchvision and timm import it."""
    import importlib
    import importlib.util

    from vram.run.cuda.compat import define_torchvision_ops

    define_torchvision_ops()

    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        form = "MODULE:FACTORY, e.g. mymodels:gpt2_small" if what == "model" else "MODULE:FUNC"
        raise ValueError(f"invalid {what} {target!r}: expected {form}")
    if module_name.endswith(".py"):
        if not os.path.isfile(module_name):
            raise OSError(f"can't open file {module_name!r}: no such file")
        spec = importlib.util.spec_from_file_location(os.path.basename(module_name)[:-3], module_name)
        if spec is None or spec.loader is None:
            raise ValueError(f"cannot import {module_name!r}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"cannot import {module_name!r}: {e}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{target} is not callable")
    return obj
