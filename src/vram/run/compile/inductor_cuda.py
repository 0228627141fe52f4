"""Compile one Dynamo graph with Inductor for ``cuda`` in a process `cuda_process.prepare`d, and
return the Python wrappers Inductor generated (forward, and backward when the graph trains).

The graph is the one Dynamo traced (``torch.compile``'s backend receives it with its example
inputs); its device arguments are retargeted to ``cuda:0`` (`retarget`), and its
``scaled_dot_product_attention`` calls are routed to the fused CUDA kernel ``select_sdp_backend``
picks on the simulated card (`route_sdpa`), as the CUDA build's composite does
(aten/src/ATen/native/transformers/attention.cpp ``scaled_dot_product_attention``). Inductor then
runs as on a GPU: AOTAutograd's joint trace and ``min_cut_rematerialization_partition``, the
joint-graph and post-grad passes, lowering, fusion, memory planning (buffer reuse) and the Python
wrapper codegen. No Triton kernel is built (`cuda_process.UnbuiltKernel`).
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from vram.run.kernels.sdpa_choice import sdpa_args, select_sdpa_backend

from .graph_transport import module_of
from .max_autotune import MODE_OPTIONS, deterministic_choices
from .runtime_meta import inputs_to_detach, runtime_layout

_SDPA = torch._C._nn.scaled_dot_product_attention
_CUDA = torch.device("cuda", 0)


#: Inductor settings whose choices a GPU makes by benchmarking, or that compile for CUDA graphs
BENCHMARKED_SETTINGS = frozenset({"max_autotune", "max_autotune_gemm", "max_autotune_pointwise",
                                  "max_autotune_flex", "triton.cudagraphs", "triton.cudagraph_trees"})


class NotModelled(RuntimeError):
    """A compiled graph this model of Inductor's CUDA build does not reproduce (named reason)."""


def retarget(gm: torch.fx.GraphModule, from_type: str) -> None:
    """Every ``torch.device`` of type `from_type` among the graph's arguments becomes ``cuda:0``."""
    def swap(value: Any) -> Any:
        if isinstance(value, torch.device) and value.type == from_type:
            return _CUDA
        return value

    for node in gm.graph.nodes:
        node.args = torch.fx.node.map_aggregate(node.args, swap)
        node.kwargs = torch.fx.node.map_aggregate(node.kwargs, swap)
        if node.op == "get_attr" and isinstance(sub := getattr(gm, str(node.target), None), torch.fx.GraphModule):
            retarget(sub, from_type)  # a higher-order op's body
    gm.recompile()


def _example(value: Any, autocast_dtype: torch.dtype | None) -> Any:
    """A node's example value as the CUDA kernel sees it: under autocast, SDPA's floating inputs
    are cast to the autocast dtype (SDPA is on autocast's lower-precision list)."""
    example = value.meta.get("example_value", value.meta.get("val")) if isinstance(value, torch.fx.Node) else value
    if not isinstance(example, torch.Tensor):
        return example
    dtype = autocast_dtype if autocast_dtype is not None and example.is_floating_point() else example.dtype
    return torch.empty_strided(example.shape, example.stride(), dtype=dtype, device="meta").requires_grad_(
        example.requires_grad)


def _fused_call(backend: str, node: torch.fx.Node, p: dict[str, Any]) -> tuple[Callable[..., Any], tuple[Any, ...],
                                                                                dict[str, Any]]:
    """The fused kernel's call for `backend` (attention.cpp's composite; head dims already aligned)."""
    q, k, v = node.args[:3] if len(node.args) >= 3 else (p["query"], p["key"], p["value"])
    aten = torch.ops.aten
    if backend == "flash":
        return aten._scaled_dot_product_flash_attention.default, (q, k, v, p["dropout_p"], p["is_causal"], False), {
            "scale": p["scale"]}
    logsumexp = torch.is_grad_enabled() and any(t.requires_grad for t in (p["query"], p["key"], p["value"]))
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if backend == "cudnn":  # should_compute_logsumexp, as for the efficient kernel
        return aten._scaled_dot_product_cudnn_attention.default, (q, k, v, mask, logsumexp, p["dropout_p"],
                                                                  p["is_causal"], False), {"scale": p["scale"]}
    return aten._scaled_dot_product_efficient_attention.default, (q, k, v, mask, logsumexp, p["dropout_p"],
                                                                  p["is_causal"]), {"scale": p["scale"]}


def route_sdpa(gm: torch.fx.GraphModule, autocast_dtype: torch.dtype | None, major: int, minor: int) -> list[str]:
    """Replace each SDPA call by the fused kernel the simulated card picks (math stays composite);
    returns the backends, in graph order."""
    chosen = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        args = tuple(_example(a, autocast_dtype) for a in node.args)
        kwargs = {key: _example(value, autocast_dtype) for key, value in node.kwargs.items()}
        p = sdpa_args(args, kwargs)
        backend = select_sdpa_backend(p, major, minor)
        chosen.append(backend)
        if backend == "math":
            continue
        if (p.get("enable_gqa") or p["query"].size(-1) % 8 or p["value"].size(-1) % 8
                or (backend == "cudnn" and p["attn_mask"] is not None)):
            raise NotModelled(f"scaled_dot_product_attention on the {backend} kernel with these arguments "
                              "(GQA, head dims padded to a multiple of 8, or cuDNN with a mask)")
        target, call_args, call_kwargs = _fused_call(backend, node, p)
        with gm.graph.inserting_after(node):
            fused = gm.graph.call_function(target, call_args, call_kwargs)
        with gm.graph.inserting_after(fused):
            out = gm.graph.call_function(operator.getitem, (fused, 0))
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
    gm.recompile()
    return chosen


def fake_inputs(example_inputs: Sequence[Any], mode: Any) -> list[Any]:
    """Fake CUDA tensors with the example inputs' sizes, strides, dtypes and ``requires_grad``;
    parameters stay parameters (AOTAutograd treats them as such); an input that requires grad and
    is not a leaf stays one (a clone, as Dynamo's fakification makes it: meta_utils.py), which
    AOTAutograd's runtime reads (``InputAliasInfo.is_leaf``, the inputs it detaches); a host
    scalar the compile process made (a fake CPU tensor: a Python float Dynamo passes as a tensor)
    stays on the host."""
    from torch._subclasses.fake_tensor import FakeTensor

    fakes: list[Any] = []
    with mode, torch.enable_grad():
        for t in example_inputs:
            if not isinstance(t, torch.Tensor):  # a size (dynamic shapes), in the inputs' shape env
                fakes.append(t)
                continue
            host = isinstance(t, FakeTensor) and t.device.type == "cpu"  # the compile process's host scalar
            device = t.device if host else _CUDA
            fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            if isinstance(t, torch.nn.Parameter):
                fake = torch.nn.Parameter(fake)
            elif t.requires_grad and not t.is_leaf:
                fake = fake.requires_grad_(True).clone()
            else:
                fake = fake.requires_grad_(t.requires_grad)
            fakes.append(fake)
    return fakes


def compile_for_cuda(gm: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor],
                     autocast_dtype: torch.dtype | None = None, layout: dict[str, Any] | None = None,
                     cudagraphs: bool = False, static_inputs: Sequence[int] | None = None,
                     max_autotune: bool = False, settings: dict[str, Any] | None = None) -> list[str]:
    """Inductor's wrappers for `gm` on CUDA, in the order Inductor generated them (forward first).
    `autocast_dtype`: the CUDA autocast the graph was traced under (Dynamo leaves an enclosing
    ``torch.autocast`` out of the graph: it is ambient state, so it is entered here). `layout`, if
    given, receives `runtime_layout` of the forward (AOTAutograd's metadata, read as the forward
    is compiled) and ``output_modules``: for each of the forward graph's outputs, the innermost
    module of the node that makes it (`graph_transport.module_of`). `cudagraphs`: compiled as
    ``mode="reduce-overhead"`` compiles (``triton.cudagraphs``: graph partitions),
    `layout["cudagraphs"]` receiving `cudagraph_calls`;
    `static_inputs`: the graph inputs Dynamo marked static (``_dynamo_static_input_type``:
    parameters and buffers), what AOTAutograd's ``static_input_indices`` are on a GPU
    (frontend_utils.py ``_try_get_metadata_from_dynamo``; the graph sent here lost the marks).
    `max_autotune`: compiled with ``max_autotune`` and Inductor's choice without benchmarks
    (`max_autotune.deterministic_choices`), `layout["selections"]` receiving each selection.
    `settings`: the script's own ``torch._inductor.config`` settings, in force as it compiles (the
    mode's options over them); NotModelled for those that choose by benchmarks on the GPU or
    compile for CUDA graphs (`BENCHMARKED_SETTINGS`), which ``mode=`` models."""
    from torch._inductor import codecache
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._subclasses.fake_tensor import FakeTensorMode

    sources: list[str] = []
    load = codecache.PyCodeCache.load_by_key_path

    def spy(key: str, path: str, *args: Any, **kwargs: Any) -> Any:
        with open(path, encoding="utf-8") as f:
            sources.append(f.read())
        return load(key, path, *args, **kwargs)

    metas: list[Any] = []

    def inner_compile(graph: torch.fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
        context = torch._guards.TracingContext.try_get()
        if layout is not None and not kwargs.get("is_backward") and context is not None and context.fw_metadata:
            metas.append(context.fw_metadata)
            layout.update(runtime_layout(context.fw_metadata))
            outputs = next(reversed(graph.graph.find_nodes(op="output"))).args[0]
            layout["output_modules"] = [module_of(o) for o in outputs]
        elif layout is not None and kwargs.get("is_backward") and metas:
            outputs = next(reversed(graph.graph.find_nodes(op="output"))).args[0]
            layout["detach"] = inputs_to_detach(metas[-1], list(outputs))
        if static_inputs is not None and not kwargs.get("is_backward"):
            kwargs["static_input_idxs"] = list(static_inputs)
        return compile_fx_inner(graph, inputs, **kwargs)

    from torch._guards import detect_fake_mode

    inputs = fake_inputs(example_inputs, detect_fake_mode(example_inputs) or FakeTensorMode())
    codecache.PyCodeCache.load_by_key_path = spy  # type: ignore[method-assign]
    calls: list[dict[str, Any]] = []
    selections: list[dict[str, Any]] = []
    refused = sorted(name for name, value in (settings or {}).items() if name in BENCHMARKED_SETTINGS and value)
    if refused:
        raise NotModelled(f"torch._inductor.config.{refused[0]} set by the script (compile with mode= for the "
                          "modelled max-autotune and CUDA graphs)")
    options = {**(settings or {}), "triton.cudagraphs": cudagraphs,
               **(MODE_OPTIONS["max-autotune"] if max_autotune else {})}
    try:
        with torch.autocast("cuda", dtype=autocast_dtype, enabled=autocast_dtype is not None), \
                inductor_config.patch(options), cudagraph_calls(calls, sources), \
                (deterministic_choices(selections) if max_autotune else nullcontext()):
            compile_fx(gm, inputs, inner_compile=inner_compile)
    finally:
        codecache.PyCodeCache.load_by_key_path = load  # type: ignore[method-assign]
    if layout is not None and cudagraphs:
        layout["cudagraphs"] = calls
    if layout is not None:
        layout["selections"] = selections
    return [s for s in sources if "def call(" in s]


@contextmanager
def cudagraph_calls(calls: list[dict[str, Any]], sources: list[str]) -> Iterator[None]:
    """Each ``compile_fx.cudagraphify`` call Inductor's post-compile makes (output_code.py
    ``cudagraph_partition_post_compile``: one per graph partition; ``cudagraph_post_compile``: one
    per graph) recorded in `calls`, the function left unwrapped: which wrapper (its index among
    the sources loaded so far), ``static_input_idxs``, ``mutated_input_idxs``, ``is_backward``,
    ``is_inference``. A graph Inductor runs without CUDA graphs makes none."""
    from torch._inductor import compile_fx as module

    original = module.cudagraphify

    def cudagraphify(model: Any, static_input_idxs: Sequence[int] = (), **kwargs: Any) -> Any:
        wrappers = [s for s in sources if "def call(" in s]
        calls.append({"wrapper": len(wrappers) - 1, "static": sorted(int(i) for i in static_input_idxs),
                      "mutated": sorted(int(i) for i in kwargs.get("mutated_input_idxs", ())),
                      "is_backward": bool(kwargs.get("is_backward")),
                      "is_inference": bool(kwargs.get("is_inference"))})
        return model

    module.cudagraphify = cudagraphify  # type: ignore[assignment]
    try:
        yield
    finally:
        module.cudagraphify = original  # type: ignore[assignment]
