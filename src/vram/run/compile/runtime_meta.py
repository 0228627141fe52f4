"""AOTAutograd's runtime metadata of one compiled graph (its ``ViewAndMutationMeta``,
torch/_functorch/_aot_autograd/schemas.py) as plain data: what the compile process reads as the
forward compiles (`runtime_layout`), and what `compiled_graph` runs by (``_create_runtime_wrapper``
and ``CompiledFunction`` in runtime_wrappers.py).

The layout (JSON, as the compile cache keeps it):

- ``num_forward_returns``, ``num_outputs`` (the user's outputs), ``num_intermediate_bases``;
- ``mutated``: each input the runtime mutates after the graph (``mutated_inp_runtime_indices``:
  ``MutationType.MUTATED_OUT_GRAPH``; the forward returns its updated value first), with
  ``mutates_data``, ``mutates_metadata``, ``is_leaf``, ``requires_grad``; inputs Inductor mutates
  itself (``MUTATED_IN_GRAPH``: ``keep_inference_input_mutations``, which ``compile_fx`` sets) are
  in ``in_graph_seen_by_autograd`` (their version counters bumped);
- ``outputs``: each user output's ``OutputType`` name, ``base_idx``, ``requires_grad``,
  ``requires_grad_for_backward``, whether it is a tensor, and its view replay (`view_metas`);
- ``aliased``, ``unsafe_views``: ``aliased_out_indices``, ``unsafe_view_out_indices``;
- ``returns_require_grad``: for the mutated inputs then the outputs, whether autograd sees them
  as differentiable (``_AutogradForwardEpilogue``);
- ``saved`` (with version-counter checks) and ``saved_no_vc`` (stashed on the context): slices
  of the forward's outputs; ``tangents``: each backward tangent's expected size and stride
  (``subclass_tangent_meta``'s ``MemoryFormatMeta``; with symbolic sizes, its memory format);
  ``saved_symints``: the sizes the backward reads (``ctx.symints``); ``detach``: the inputs the
  runtime detaches (``_compute_indices_of_inps_to_detach``); ``grad_enabled_mutation``;
  ``dynamic_dims``: each output's symbolic dimensions, marked on it for Dynamo's later graphs.
"""
from __future__ import annotations

from typing import Any

#: output types whose value is the forward's own (runtime_wrappers.py ``NoopAliasHandler``)
NOT_ALIASED = frozenset({"non_alias", "unsafe_view_alias", "custom_function_view"})


def view_metas(sequence: Any) -> list[list[Any]] | None:
    """A ``ViewMetaSequence`` as ``[[class name, fields], ...]`` (``ViewMeta.as_tuple``; the
    ``InverseReturnMode`` as its value); None when there is none, or it has symbolic inputs (then
    ``gen_alias_from_base`` does not replay it)."""
    if sequence is None or any(vm.has_symbolic_inputs for vm in sequence.sequence):
        return None
    out = []
    for vm in sequence.sequence:
        fields = list(vm.as_tuple())
        fields[2] = int(fields[2].value)
        out.append([type(vm).__name__, fields])
    return out


def rebuild_view_metas(encoded: list[list[Any]]) -> list[Any]:
    """The ``ViewMeta`` objects `view_metas` encoded, for ``apply_view_meta_sequence``."""
    import torch

    functionalization = torch._C._functionalization
    metas = []
    for name, fields in encoded:
        values = list(fields)
        values[2] = functionalization.InverseReturnMode(values[2])
        metas.append(getattr(functionalization, name)(tuple(values)))
    return metas


def _slice(s: slice) -> list[int | None]:
    return [s.start, s.stop]


def _unsupported(meta: Any) -> list[str]:
    problems = []
    if meta.is_rng_op_functionalized or meta.tokens or getattr(meta, "num_graphsafe_rng_states", 0):
        problems.append("functionalized RNG or effect tokens")
    if any(type(m).__name__ == "SubclassCreationMeta" for m in meta.subclass_inp_meta):
        problems.append("tensor subclasses")
    if any(meta.input_info[i].mutates_storage_metadata for i in meta.mutated_inp_runtime_indices):
        problems.append("an input's storage swapped (set_) outside the graph")
    if meta.num_opaque_objects_saved_for_bw or 0:
        problems.append("opaque objects saved for the backward")
    return problems


def _tangents(meta: Any) -> list[Any]:
    """Each tangent's expected size and stride (static shapes) or memory format's name (symbolic
    sizes: ``MemoryFormatMeta.memory_format``); None where nothing is expected."""
    out: list[Any] = []
    for tangent in meta.subclass_tangent_meta:
        fmt = getattr(tangent, "memory_format", None)
        if fmt is not None and fmt.memory_format is not None:
            out.append(str(fmt.memory_format).removeprefix("torch."))
        elif fmt is None or fmt.size is None or fmt.stride is None:
            out.append(None)
        else:
            out.append([[int(s) for s in fmt.size], [int(s) for s in fmt.stride]])
    return out


def runtime_layout(meta: Any) -> dict[str, Any]:
    """The layout of `meta` (see the module docstring); ``not_modelled`` names what the runtime
    model does not reproduce."""
    inputs = meta.input_info
    mutated = [{"index": i, "mutates_data": bool(inputs[i].mutates_data),
                "mutates_metadata": bool(inputs[i].mutates_metadata), "is_leaf": bool(inputs[i].is_leaf),
                "requires_grad": bool(inputs[i].requires_grad)} for i in meta.mutated_inp_runtime_indices]
    outputs = [{"type": info.output_type.name, "base": info.base_idx, "requires_grad": bool(info.requires_grad),
                "for_backward": bool(info.requires_grad_for_backward),
                "tensor": _is_tensor_type(info.raw_type),
                "views": view_metas(info.view_meta_sequence)} for info in meta.output_info]
    layout: dict[str, Any] = {
        "num_forward_returns": meta.num_forward_returns, "num_outputs": meta.num_outputs,
        "num_intermediate_bases": meta.num_intermediate_bases, "mutated": mutated, "outputs": outputs,
        "aliased": list(meta.aliased_out_indices), "unsafe_views": list(meta.unsafe_view_out_indices),
        "returns_require_grad": [m["requires_grad"] for m in mutated] + [o["requires_grad"] for o in outputs],
        "in_graph_seen_by_autograd": list(meta.mutated_graph_handled_indices_seen_by_autograd),
        "grad_enabled_mutation": meta.grad_enabled_mutation, "not_modelled": _unsupported(meta),
        "saved": None, "saved_no_vc": None, "saved_symints": None, "tangents": None, "detach": [],
        "dynamic_dims": [sorted(o.dynamic_dims) if o.dynamic_dims is not None else None for o in meta.output_info]
        if meta.dynamic_outputs else None}
    if meta.num_symints_saved_for_bw is not None:  # a training graph, partitioned
        layout["saved"] = _slice(meta.tensors_saved_for_backwards_with_vc_check_slice)
        layout["saved_no_vc"] = _slice(meta.tensors_saved_for_backwards_no_vc_check_slice)
        layout["saved_symints"] = _slice(meta.symints_saved_for_backwards_slice)
        layout["tangents"] = _tangents(meta)
    return layout


def _is_tensor_type(raw_type: Any) -> bool:
    import torch

    return isinstance(raw_type, type) and issubclass(raw_type, torch.Tensor)


def inputs_to_detach(meta: Any, backward_outputs: list[Any]) -> list[int]:
    """Inputs that require grad, are not leaves and get no gradient from the backward (its
    outputs, one per input): the runtime detaches them before the forward
    (graph_compile.py ``_compute_indices_of_inps_to_detach``)."""
    detach = []
    for i, out in enumerate(backward_outputs[:len(meta.input_info)]):
        info = meta.input_info[i]
        in_graph_set = info.mutation_type.name == "MUTATED_IN_GRAPH" and info.mutates_storage_metadata
        if out is None and not in_graph_set and info.requires_grad and not info.is_leaf:
            detach.append(i)
    return detach
