"""A compiled Dynamo graph run on the simulated GPU as AOTAutograd's runtime runs Inductor's output.

Inference (no backward wrapper): the forward wrapper's first ``num_forward_returns`` outputs are the
graph's. Training: the forward runs inside an ``autograd.Function`` (AOTAutograd's
``CompiledFunction``, torch/_functorch/_aot_autograd/runtime_wrappers.py): its outputs are the
user's outputs, then the tensors saved for the backward (``_AutogradSavedState.save_from_forward``:
``ctx.save_for_backward``, views detached); the backward drops the context's saved tensors
(``ctx.maybe_clear_saved_tensors``) and calls the backward wrapper with ``[*saved, *tangents]``,
a list nothing else holds, so each saved tensor is freed where the wrapper's ``del`` drops it.
"""
from __future__ import annotations

import itertools
from typing import Any

import torch

from .wrapper_run import call, load_wrapper

_NAMES = itertools.count()


def on_device(source: str, index: int) -> str:
    """A wrapper compiled for ``cuda:0`` (the compile process's one card) as Inductor writes it for
    ``cuda:index``: its device guard, ``set_device``, streams and the devices it names."""
    if index == 0:
        return source
    for name in ("torch.cuda._DeviceGuard", "torch.cuda.set_device", "get_raw_stream"):
        source = source.replace(f"{name}(0)", f"{name}({index})")
    return source.replace("device(type='cuda', index=0)", f"device(type='cuda', index={index})")


class CompiledGraph:
    """The callable Dynamo's backend returns for one graph (`answer`: the compile process's) whose
    tensors are on the simulated ``cuda:device_index``."""

    def __init__(self, answer: dict[str, Any], device_index: int = 0, trees: Any = None) -> None:
        sources = [on_device(source, device_index) for source in answer["sources"]]
        layout = answer["layout"]
        self.num_returns: int = layout["num_forward_returns"]
        self.grad_outputs: list[bool] = layout["grad_outputs"]
        self.saved: tuple[int, int] | None = tuple(layout["saved"]) if layout["saved"] else None
        n = next(_NAMES)
        kernels = answer.get("kernels", {})
        self.forward = load_wrapper(sources[0], f"inductor_forward_{n}", kernels)
        self.backward = load_wrapper(sources[1], f"inductor_backward_{n}", kernels) if len(sources) > 1 else None
        if trees is not None:
            for i, module in enumerate((self.forward, self.backward)):
                calls = [c for c in layout.get("cudagraphs", []) if c["wrapper"] == i]
                if module is not None and calls:
                    in_trees(module, calls, trees, device_index)

    def __call__(self, *args: Any) -> Any:
        if self.backward is None or self.saved is None:
            outs = call(self.forward, list(args))
            return tuple(outs[:self.num_returns])
        return _CompiledFunction.apply(self, *args)


def in_trees(module: Any, calls: list[dict[str, Any]], trees: Any, device_index: int) -> None:
    """A wrapper's graph partitions run in CUDA graph trees (`cudagraph_trees.Trees`), as
    ``cudagraph_partition_post_compile`` applies ``cudagraphify`` to each
    (``recursively_apply_fns``); a wrapper without partitions is wrapped whole."""
    def mode(call: dict[str, Any]) -> str:
        return "backward" if call["is_backward"] else "inference" if call["is_inference"] else "forward"

    fns = [lambda model, c=c: trees.cudagraphify(model, c["static"], mode(c), device_index) for c in calls]
    runner = getattr(module, "runner", None)
    if runner is not None and hasattr(runner, "recursively_apply_fns"):
        runner.recursively_apply_fns(fns)
    else:
        module.call = fns[0](module.call)


def _fresh_list(values: Any) -> list[Any]:
    return list(values)


class _CompiledFunction(torch.autograd.Function):
    """AOTAutograd's ``CompiledFunction`` over the two wrappers (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, graph: CompiledGraph, *args: Any) -> Any:  # type: ignore[override]
        outs = call(graph.forward, _fresh_list(args))
        start, stop = graph.saved  # type: ignore[misc]
        ctx.save_for_backward(*(t.detach() if t._is_view() else t for t in outs[start:stop]))
        ctx.graph = graph
        ctx.num_inputs = len(args)
        returns = tuple(outs[:graph.num_returns])
        del outs
        ctx.mark_non_differentiable(*(t for t, grad in zip(returns, graph.grad_outputs)
                                      if not grad and isinstance(t, torch.Tensor)))
        return returns

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        graph: CompiledGraph = ctx.graph
        tangents = [g.contiguous() for g, needed in zip(grads, graph.grad_outputs) if needed]
        args = [*ctx.saved_tensors, *tangents]
        del tangents, grads
        ctx.maybe_clear_saved_tensors()
        outs = call(graph.backward, args)  # type: ignore[arg-type]
        return (None, *outs[:ctx.num_inputs])
