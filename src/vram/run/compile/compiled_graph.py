"""A compiled Dynamo graph run on the simulated GPU as AOTAutograd's runtime runs Inductor's output
(torch/_functorch/_aot_autograd/runtime_wrappers.py), by its runtime metadata (`runtime_meta`).

``_create_runtime_wrapper`` (`CompiledGraph.__call__`): the inputs the epilogue needs are kept
(``orig_inputs``), the version counters of inputs Inductor mutated bumped; then inference runs the
forward wrapper with grad off on a list nothing else holds (inputs freed where its ``del`` drops
them), training runs ``CompiledFunction`` with grad on and view replay enabled, the inputs that get
no gradient detached. Its forward outputs are: the updated values of the inputs mutated outside the
graph, the user's outputs, the intermediate bases of aliased outputs; then (training) what the
backward saves. The epilogue copies each updated value into its input (``copy_``;
``as_strided_`` for metadata mutations) and drops it, and makes each aliased output again from its
base (``gen_alias_from_base``: the functionalization's view replay on the input or intermediate
base; the base, if an intermediate, lives as long as its views).

``CompiledFunction`` (`_CompiledFunction`): the forward saves the backward's tensors
(``ctx.save_for_backward``, views detached; those without version-counter checks on the context),
wraps aliased outputs and metadata-only mutations as ``TensorAlias`` (hidden from autograd),
``_unsafe_view``s the unsafe-view outputs, marks non-differentiable outputs. The backward takes its
gradients as one list (``boxed_grads_call``) and clears it, keeps the ones the backward graph reads,
restrides each tangent to the traced one's size and stride (``coerce_to_expected_memory_format``:
``empty_strided`` and ``copy_`` when they differ), drops the context's saved tensors and calls the
backward wrapper with ``[*saved, *tangents]``, a list nothing else holds, so each saved tensor is
freed where the wrapper's ``del`` drops it.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from .runtime_meta import NOT_ALIASED, rebuild_view_metas
from .wrapper_run import call, load_wrapper

_NAMES = itertools.count()
#: called with each tensor a compiled forward saves for the backward and the innermost module of
#: the graph node that made it (Dynamo's source of the module and its class's name; None: a graph
#: input, or made outside every module): how `vram.estimate` names the activations of a compiled model
saved_observers: list[Callable[[torch.Tensor, tuple[str, str] | None], None]] = []


def on_device(source: str, index: int) -> str:
    """A wrapper compiled for ``cuda:0`` (the compile process's one card) as Inductor writes it for
    ``cuda:index``: its device guard, ``set_device``, streams and the devices it names."""
    if index == 0:
        return source
    for name in ("torch.cuda._DeviceGuard", "torch.cuda.set_device", "get_raw_stream"):
        source = source.replace(f"{name}(0)", f"{name}({index})")
    return source.replace("device(type='cuda', index=0)", f"device(type='cuda', index={index})")


class TensorAlias:
    """An output hidden from ``autograd.Function`` (schemas.py ``TensorAlias``)."""

    def __init__(self, alias: Any) -> None:
        self.alias = alias


class CompiledGraph:
    """The callable Dynamo's backend returns for one graph (`answer`: the compile process's) whose
    tensors are on the simulated ``cuda:device_index``."""

    def __init__(self, answer: dict[str, Any], device_index: int = 0, trees: Any = None) -> None:
        sources = [on_device(source, device_index) for source in answer["sources"]]
        layout = answer["layout"]
        self.meta: dict[str, Any] = layout
        self.num_mutated: int = len(layout["mutated"])
        self.views = [rebuild_view_metas(o["views"]) if o["views"] is not None else None for o in layout["outputs"]]
        self.epilogue_inputs = [m["index"] for m in layout["mutated"]] + [
            o["base"] for o in layout["outputs"] if o["type"] in ("alias_of_input", "is_input")]
        n = next(_NAMES)
        kernels = answer.get("kernels", {})
        self.forward = load_wrapper(sources[0], f"inductor_forward_{n}", kernels)
        self.backward = load_wrapper(sources[1], f"inductor_backward_{n}", kernels) if len(sources) > 1 else None
        self.trace_joint = self.backward is not None and layout["saved"] is not None
        if trees is not None:
            for i, module in enumerate((self.forward, self.backward)):
                calls = [c for c in layout.get("cudagraphs", []) if c["wrapper"] == i]
                if module is not None and calls:
                    in_trees(module, calls, trees, device_index)

    def __call__(self, *args: Any) -> Any:
        """``_runtime_wrapper`` (runtime_wrappers.py ``_create_runtime_wrapper``)."""
        orig_inputs = {i: args[i] for i in self.epilogue_inputs}
        seen = self.meta["in_graph_seen_by_autograd"]
        if seen:
            torch.autograd.graph.increment_version([args[i] for i in seen])
        if self.trace_joint:
            args_ = list(args)
            for i in self.meta["detach"]:
                if isinstance(args_[i], torch.Tensor):
                    args_[i] = args_[i].detach()
            replay = torch._C._is_view_replay_enabled()
            try:
                torch._C._set_view_replay_enabled(True)
                with torch.enable_grad():  # args_ lives until the epilogue ends, as the runtime's local
                    all_outs = list(_CompiledFunction.apply(self, *args_))
            finally:
                torch._C._set_view_replay_enabled(replay)
        else:
            with torch.no_grad():
                all_outs = list(call(self.forward, list(args)))
        del args
        updated, fw_outs = all_outs[:self.num_mutated], all_outs[self.num_mutated:]
        if updated:
            self._apply_mutations(orig_inputs, updated)
        del updated
        ret_outs = self._replay_aliases(orig_inputs, fw_outs) if self.meta["aliased"] else fw_outs
        for out, dims in zip(ret_outs, self.meta.get("dynamic_dims") or ()):
            if dims is not None:  # mark_dynamo_propagated_dynamic_indices
                out._dynamo_propagated_dynamic_indices = getattr(out, "_dynamo_propagated_dynamic_indices",
                                                                 set()) | set(dims)
        if self.meta["grad_enabled_mutation"] is not None:
            torch._C._set_grad_enabled(self.meta["grad_enabled_mutation"])
        return ret_outs

    def _apply_mutations(self, orig_inputs: dict[int, Any], updated: list[Any]) -> None:
        """``_apply_mutations``: each mutated input takes its updated value (runtime_wrappers.py
        ``_create_runtime_wrapper``'s mutation epilogue)."""
        for m, new in zip(self.meta["mutated"], updated):
            if not m["mutates_data"] and not m["mutates_metadata"]:
                continue
            old = orig_inputs[m["index"]]
            if m["mutates_metadata"] and not m["mutates_data"]:
                new = new.alias if isinstance(new, TensorAlias) else new
                old.as_strided_(new.size(), new.stride(), new.storage_offset())
                continue
            if m["mutates_metadata"]:
                old.as_strided_(new.size(), new.stride(), new.storage_offset())
            if m["is_leaf"] and old.requires_grad:
                old.detach().copy_(new)
            else:
                old.copy_(new)

    def _replay_aliases(self, orig_inputs: dict[int, Any], fw_outs: list[Any]) -> list[Any]:
        """``_alias_fn``: each user output, aliased ones made again from their base."""
        num_outputs = self.meta["num_outputs"]
        outs = []
        for i, o in enumerate(self.meta["outputs"]):
            kind = o["type"]
            if kind in NOT_ALIASED:
                outs.append(fw_outs[i])
                continue
            if kind == "is_input":
                outs.append(orig_inputs[o["base"]])
                continue
            if kind == "alias_of_input":
                base = orig_inputs[o["base"]]
            elif kind == "alias_of_intermediate_base_is_user_output":
                base = fw_outs[o["base"]]
                base = base.alias if isinstance(base, TensorAlias) else base
            else:  # alias_of_intermediate(_save_as_output): an intermediate base after the outputs
                base = fw_outs[o["base"] + num_outputs]
            out = fw_outs[i].alias if isinstance(fw_outs[i], TensorAlias) else fw_outs[i]
            outs.append(alias_from_base(base, out, o["requires_grad"], self.views[i]))
        return outs


def alias_from_base(base: torch.Tensor, target: torch.Tensor, requires_grad: bool, views: list[Any] | None) -> Any:
    """``gen_alias_from_base`` (functional_utils.py): the functionalization's views replayed on
    `base` (``view_replay_for_aliased_outputs``), else `target`'s own view function on `base`
    (restrided as `target`'s base if they differ), else ``as_strided``."""
    def patch(out: torch.Tensor) -> torch.Tensor:
        if base.requires_grad and not requires_grad:
            return out.detach()
        if not base.requires_grad and requires_grad:
            out.requires_grad_(True)
        return out

    if views is not None:
        out = torch._C._functionalization.apply_view_meta_sequence(base, views)
        if out.shape != target.shape:
            raise AssertionError(f"view replay made {tuple(out.shape)}, the graph's output is {tuple(target.shape)}")
        return patch(out)
    if target._base is not None:
        b = target._base
        reshaped = base
        if base is not b and (base.size() != b.size() or base.stride() != b.stride()
                              or base.storage_offset() != b.storage_offset()):
            reshaped = base.as_strided(b.size(), b.stride(), b.storage_offset())
        out = target._view_func(reshaped)
        if out is not None and out.shape == target.shape:
            return patch(out)
    if base.is_complex() and not target.is_complex():
        aliased = torch.view_as_real(base).as_strided(target.size(), target.stride(), target.storage_offset())
    elif not base.is_complex() and target.is_complex():
        aliased = torch.view_as_complex(base).as_strided(target.size(), target.stride(), target.storage_offset())
    else:
        aliased = base.as_strided(target.size(), target.stride(), target.storage_offset())
    aliased = patch(aliased)
    return aliased.view(target.dtype) if aliased.dtype != target.dtype else aliased


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


def _restrided(x: Any, expected: Any) -> Any:
    """``coerce_to_expected_memory_format``: to a memory format (symbolic sizes: its name), or to a
    static size and stride."""
    if not isinstance(x, torch.Tensor) or expected is None:
        return x
    if isinstance(expected, str):
        memory_format = getattr(torch, expected)
        return x if x.is_contiguous(memory_format=memory_format) else x.contiguous(memory_format=memory_format)
    size, stride = expected
    if list(x.shape) == size and list(x.stride()) == stride:
        return x
    restrided = x.new_empty_strided(size, stride, requires_grad=x.requires_grad)
    restrided.copy_(x)
    return restrided


class _CompiledFunction(torch.autograd.Function):
    """AOTAutograd's ``CompiledFunction`` over the two wrappers (see the module docstring)."""

    boxed_grads_call = True

    @staticmethod
    def forward(ctx: Any, graph: CompiledGraph, *args: Any) -> Any:  # type: ignore[override]
        meta = graph.meta
        fw_outs = call(graph.forward, list(args))
        start, stop = meta["saved"]
        ctx.save_for_backward(*(t.detach() if t._is_view() else t for t in fw_outs[start:stop]))
        start_no_vc, stop_no_vc = meta["saved_no_vc"]
        ctx._tensors_no_vc_check = [t.detach() if t._is_view() else t for t in fw_outs[start_no_vc:stop_no_vc]]
        if saved_observers:
            outs = range(len(fw_outs))
            _observe_saved(fw_outs, [*outs[start:stop], *outs[start_no_vc:stop_no_vc]], meta)
        start, stop = meta["saved_symints"] or (0, 0)
        ctx.symints = fw_outs[start:stop]
        ctx.graph = graph
        raw = list(fw_outs[:meta["num_forward_returns"]])
        del fw_outs
        num_mutated = graph.num_mutated
        for i, m in enumerate(meta["mutated"]):
            if m["mutates_metadata"] and not m["mutates_data"]:
                raw[i] = TensorAlias(raw[i])
        for i in meta["unsafe_views"]:
            o = raw[num_mutated + i]
            raw[num_mutated + i] = torch.ops.aten._unsafe_view(o, o.shape)
        for i in meta["aliased"]:
            raw[num_mutated + i] = TensorAlias(raw[num_mutated + i])
        ctx.mark_non_differentiable(*(raw[i] for i, grad in enumerate(meta["returns_require_grad"])
                                      if not grad and isinstance(raw[i], torch.Tensor)))
        ctx._materialize_non_diff_grads = False
        return tuple(raw)

    @staticmethod
    def backward(ctx: Any, grads: list[Any]) -> Any:  # type: ignore[override]
        """``_compiled_backward`` with ``_backward_prologue`` (grads: the engine's list)."""
        graph: CompiledGraph = ctx.graph
        meta = graph.meta
        saved = (*ctx.symints, *ctx.saved_tensors, *ctx._tensors_no_vc_check)
        all_args = _backward_args(meta, saved, grads, graph.num_mutated)
        del saved
        ctx.maybe_clear_saved_tensors()
        outs = call(graph.backward, all_args)  # type: ignore[arg-type]
        return (None, *outs)


def _observe_saved(fw_outs: list[Any], indices: list[int], meta: dict[str, Any]) -> None:
    """Each `saved_observers` told of each saved tensor (`indices` into the forward's outputs) and
    its module (the layout's ``output_modules``; None for all in a layout without them)."""
    modules = meta.get("output_modules") or []
    for i in indices:
        module = modules[i] if i < len(modules) else None
        for observe in saved_observers:
            observe(fw_outs[i], tuple(module) if module is not None else None)


def _backward_args(meta: dict[str, Any], saved: tuple[Any, ...], grads: list[Any], num_mutated: int) -> list[Any]:
    """``_backward_prologue``: the gradients the backward graph reads (mutated inputs' that require
    grad, outputs' that are not aliases and need one, every intermediate base's), the list the
    engine passed cleared, each tangent restrided as traced."""
    surviving = [i for i, m in enumerate(meta["mutated"]) if m["mutates_data"] and m["requires_grad"]]
    surviving += [num_mutated + i for i, o in enumerate(meta["outputs"])
                  if o["type"] in NOT_ALIASED and o["tensor"] and o["for_backward"]]
    surviving += list(range(num_mutated + meta["num_outputs"], len(grads)))
    bw_grads = [grads[i] for i in surviving]
    grads.clear()
    all_args = [*saved, *bw_grads]
    del saved
    start = len(all_args) - len(bw_grads)
    if len(meta["tangents"]) != len(bw_grads):
        raise AssertionError(f"expected {len(meta['tangents'])} tangents, got {len(bw_grads)}")
    for j, expected in enumerate(meta["tangents"]):
        all_args[start + j] = _restrided(all_args[start + j], expected)
    del bw_grads
    return all_args
