"""``torch.compile`` under ``vram run``: Dynamo traces the script's code as on a GPU, and each graph
it hands to the backend is compiled by Inductor for ``cuda`` in the compile process
(`client.CompileClient`) and run on the simulated GPU (`compiled_graph.CompiledGraph`). Graph
breaks, guards and recompiles are Dynamo's own.

The run's function mode (which plays ``cuda`` to the script) is on the torch-function mode stack
while the script runs. Dynamo would trace *into* it (its ``__torch_function__`` is Python) and
break the graph at every op, so the tracer is given the stack without it
(``convert_frame.trace_frame``'s ``tf_mode_stack``), while the guard on the mode stack keeps the
whole stack, as the compiled code runs with the mode on.

``mode="reduce-overhead"`` (and ``max-autotune``, which records CUDA graphs too) compiles with
CUDA graphs and runs each graph partition in `cudagraph_trees`. What is not modelled is said once
on stderr and runs eagerly or as default mode, named: another ``backend=``, ``max-autotune``'s
kernel choice (Inductor's choice without benchmarks, `max_autotune`), graphs with CPU tensor inputs
other than 0-d scalars (a Python float Dynamo passes as a tensor) or inputs on several GPUs, what
`runtime_meta.runtime_layout` names, and choices Inductor benchmarks while compiling
(`cuda_process.GUESSED`). Graphs with symbolic sizes (dynamic shapes) are compiled over Dynamo's
symbols (`worker.example_inputs`).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import torch

from . import dynamo_view
from .client import CompileClient, CompileUnavailable
from .cudagraph_trees import Trees
from .max_autotune import MODE_OPTIONS, benchmark_footprint, bound

_REAL_COMPILE = torch.compile  # this module is imported before any run patches it
#: modes whose graphs run in CUDA graph trees (``torch._inductor.list_mode_options``: ``triton.cudagraphs``)
_CUDAGRAPH_MODES = frozenset({"reduce-overhead", "max-autotune"})
_MODES = {mode: f"{mode}: Triton templates are not benchmarked against cuBLAS without a GPU; each matmul takes "
                 "Inductor's choice without benchmarks (pick_deterministic_choice: the cuBLAS kernel), the "
                 "benchmarking's example tensors, flush buffers and workspaces are charged"
          for mode in MODE_OPTIONS}


class Notices:
    """Each notice said once per run, on stderr."""

    def __init__(self) -> None:
        self.said: set[str] = set()

    def say(self, text: str) -> None:
        if text not in self.said:
            self.said.add(text)
            sys.stdout.flush()
            sys.stderr.write(f"vram run: {text}\n")


def _symbolic(value: Any) -> Any:
    """A size or stride: an int, or (symbolic) its sympy expression."""
    return value.node.expr if isinstance(value, torch.SymInt) else int(value)


def _input_spec(value: Any, traced: Any) -> tuple[Any, ...]:
    """One graph input for the compile process: a size (``SymInt``: ``("symint", expression, hint)``)
    or a tensor's sizes, strides, dtype, ``requires_grad``, whether a parameter and a leaf, when
    Dynamo traced it with symbolic sizes (`traced`, its example value) the sizes' and strides'
    expressions, and whether it is a host (CPU) tensor."""
    if isinstance(value, torch.SymInt):
        return ("symint", value.node.expr, int(value.node.hint))
    symbolic = None
    if isinstance(traced, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in (*traced.shape, *traced.stride())):
        symbolic = (tuple(_symbolic(s) for s in traced.shape), tuple(_symbolic(s) for s in traced.stride()))
    return (tuple(value.shape), tuple(value.stride()), str(value.dtype).removeprefix("torch."),
            bool(value.requires_grad), isinstance(value, torch.nn.Parameter), bool(value.is_leaf), symbolic,
            value.device.type == "cpu")


def graph_request(gm: torch.fx.GraphModule, example_inputs: list[Any], card: dict[str, Any],
                  cudagraphs: bool = False) -> dict[str, Any]:
    """What the compile process needs for `gm` (`worker.compile_request`): a copy of the graph with
    the simulated devices retargeted to ``cuda:0``, its nodes pickled (`graph_transport`); the
    inputs' sizes, strides, dtypes, ``requires_grad``, whether each is a parameter and a leaf; the ambient
    CUDA autocast and grad mode, cuBLAS's float32 matmul precision (TF32: what pad_mm's cost model
    and learned heuristic read); with `cudagraphs`, compiled for CUDA graphs, the inputs Dynamo
    marked static."""
    import pickle

    from .graph_transport import graph_nodes
    from .inductor_cuda import retarget

    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    copy = torch.fx.GraphModule(gm, graph)
    retarget(copy, "vramsim")
    lifted = lift_attributes(copy, gm)
    placeholders = gm.graph.find_nodes(op="placeholder")
    inputs = [_input_spec(t, None) for t in lifted.values()] + [
        _input_spec(t, node.meta.get("example_value")) for t, node in zip(example_inputs, placeholders)]
    autocast = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
    static = list(range(len(lifted))) + [len(lifted) + i for i, node in enumerate(placeholders)
                                         if node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")]
    try:
        sent = pickle.dumps(graph_nodes(copy.graph, copy))
    except (pickle.PicklingError, AttributeError, TypeError) as e:  # what the compile process cannot rebuild
        raise ValueError(f"a graph node that cannot be sent to the compile process: {e}") from e
    settings, unsent = inductor_settings()
    if unsent:
        raise ValueError(f"torch._inductor.config.{unsent[0]} is set to a Python object the compile process "
                         "cannot be given")
    return {"graph": sent, "code": copy.code, "inputs": inputs, "inductor_config": settings,
            "autocast": str(autocast).removeprefix("torch.") if autocast is not None else None,
            "grad": torch.is_grad_enabled(), "major": card["major"], "minor": card["minor"], "cudagraphs": cudagraphs,
            "fp32_precision": torch.backends.cuda.matmul.fp32_precision,
            "static_inputs": static if cudagraphs else None}


#: Inductor settings the compile process keeps its own: its threads and the caches of compiled
#: artefacts (a first run on empty caches is modelled)
_OWN_SETTINGS = frozenset({"compile_threads", "fx_graph_cache", "fx_graph_remote_cache", "autotune_local_cache",
                           "autotune_remote_cache", "bundled_autotune_remote_cache", "force_disable_caches"})


def inductor_settings() -> tuple[dict[str, Any], list[str]]:
    """The script's own ``torch._inductor.config`` settings (those not at their defaults:
    ``coordinate_descent_tuning``, ``triton.unique_kernel_names``...), for the compile process,
    and the names of those whose values cannot be sent (a Python object: a custom pass)."""
    import pickle

    config = sys.modules.get("torch._inductor.config")
    if config is None:  # never imported: nothing set
        return {}, []
    settings, unsent = {}, []
    for name, value in config._get_dict(skip_default=True).items():
        entry = config._config.get(name)
        if name in _OWN_SETTINGS or (entry is not None and value == entry.default):  # set to its default
            continue
        try:
            pickle.dumps(value)
        except (pickle.PicklingError, AttributeError, TypeError):
            unsent.append(name)
            continue
        settings[name] = value
    return settings, unsent


def graph_attributes(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    """The parameters and buffers of a Dynamo graph's module, in ``aot_module_simplified``'s order."""
    return {**dict(gm.named_parameters(remove_duplicate=False)), **dict(gm.named_buffers(remove_duplicate=False))}


def lift_attributes(copy: torch.fx.GraphModule, gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    """The tensors a Dynamo graph reads as module attributes (``get_attr``: what Dynamo registers
    as parameters and buffers of the graph's module, e.g. a compiled optimizer step's parameters and
    state) made the graph's first inputs in `copy`, as ``aot_module_simplified``
    (torch/_functorch/aot_autograd.py) lifts them on a GPU: ``named_parameters`` then
    ``named_buffers`` (``remove_duplicate=False``), ahead of Dynamo's inputs, static
    (``_try_get_metadata_from_dynamo``). Returns them by name, in that order."""
    lifted = graph_attributes(gm)
    if not lifted:
        return {}
    first = next(iter(copy.graph.nodes))
    with copy.graph.inserting_before(first):
        placeholders = {name: copy.graph.placeholder(name.replace(".", "_")) for name in lifted}
    for node in list(copy.graph.find_nodes(op="get_attr")):
        if str(node.target) in placeholders:
            node.replace_all_uses_with(placeholders[str(node.target)])
            copy.graph.erase_node(node)
    copy.recompile()
    return lifted


def make_backend(client: CompileClient, notices: Notices, trees: Any = None, sim: Any = None) -> Callable[..., Any]:
    """The Dynamo backend: each graph compiled in the compile process, else run as traced (eagerly),
    with the reason said. With `trees` (`cudagraph_trees.Trees`), graphs are compiled with CUDA
    graphs (``mode="reduce-overhead"``) and their partitions run in the trees. With `sim` (the
    run's `SimState`), graphs are compiled as ``max-autotune`` (`max_autotune`), the benchmarking's
    allocations made as a graph is first compiled."""
    from .compiled_graph import CompiledGraph

    graphs: dict[str, CompiledGraph] = {}

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        tensors = [t for t in (*example_inputs, *gm.parameters(), *gm.buffers()) if isinstance(t, torch.Tensor)]
        if not all(isinstance(t, (torch.Tensor, torch.SymInt)) for t in example_inputs):
            notices.say("a compiled graph with inputs other than tensors and sizes is not modelled: it runs eagerly")
            return gm.forward
        if any(t.device.type != "vramsim" and not (t.device.type == "cpu" and t.dim() == 0) for t in tensors):
            notices.say("a compiled graph with CPU tensors (other than scalars) among its inputs is not modelled: "
                        "it runs eagerly")
            return gm.forward
        indices = {t.device.index or 0 for t in tensors if t.device.type == "vramsim"}
        if len(indices) > 1:
            notices.say("a compiled graph with inputs on several GPUs is not modelled: it runs eagerly")
            return gm.forward
        try:
            request = graph_request(gm, example_inputs, client.card, trees is not None)
            request["max_autotune"] = sim is not None
        except ValueError as e:
            notices.say(f"a compiled graph is not modelled ({e}): it runs eagerly")
            return gm.forward
        try:
            answer = client.compile(request)
        except CompileUnavailable as e:
            notices.say(f"torch.compile runs eagerly on the simulated GPU ({e}), so memory is eager PyTorch's")
            return gm.forward
        if "sources" not in answer:
            reason = answer.get("not_modelled") or answer.get("error")
            notices.say(f"a compiled graph is not modelled ({reason}): it runs eagerly")
            return gm.forward
        for guess in answer.get("guessed", []):
            notices.say(guess)
        index = indices.pop() if indices else torch.cuda.current_device()
        key = request["code"] + repr((request["inputs"], request["autocast"], request["grad"], index,
                                      sorted(request["inductor_config"].items())))
        if key not in graphs:
            graphs[key] = CompiledGraph(answer, index, trees)
            if sim is not None:  # the compile's benchmarks, on the graph's device and the current stream
                selections = answer["layout"].get("selections", [])
                benchmark_footprint(selections, index, sim.props[index].L2_cache_size, _workspace(sim, index))
                _say_bound(notices, selections, sim.props[index])
        compiled, lifted = graphs[key], list(graph_attributes(gm).values())
        # aot_module_simplified's forward: the lifted tensors, then Dynamo's inputs
        return compiled if not lifted else (lambda *args: compiled(*lifted, *args))

    return backend


def _workspace(sim: Any, index: int) -> Callable[[str], None]:
    """The compiling thread's cuBLAS workspace on the current stream, and for ``addmm`` (the extern
    kernel benchmarked with the 1-D bias: cuBLASLt's ``gemm_and_bias``) the cuBLASLt one
    (`vram.run.kernels.blas`)."""
    from vram.frontend import memory as _memory
    from vram.run.kernels import blas

    def workspace(name: str) -> None:
        props = sim.props[index]
        stream = _memory.current_stream(index).cuda_stream
        size = blas.cublas_workspace_size(props.major, props.minor)
        sim.workspace((index, stream, "main", "cublas"), size)
        lt = blas.cublaslt_workspace_size(size) if name == "addmm" else None
        if lt:
            sim.workspace((index, stream, "main", "cublaslt"), lt)

    return workspace


def _say_bound(notices: Notices, selections: list[dict[str, Any]], props: Any) -> None:
    """`max_autotune.bound` of a compiled graph, said once."""
    from vram.run.kernels import blas

    if not selections:
        return
    size = blas.cublas_workspace_size(props.major, props.minor)
    more, less = bound(selections, size + (blas.cublaslt_workspace_size(size) or 0))
    notices.say(f"max-autotune: a compiled graph with {len(selections)} benchmarked matmul(s): a GPU's own "
                f"choices could make its memory at most {more:,} bytes more and {less:,} bytes less at any moment")


def _import_dynamo() -> None:
    """``torch._dynamo`` imported as on a GPU: its tables of constant types name the real
    ``torch.device`` (the run plays a stand-in class, `vram.run.cuda.stand_ins`)."""
    stand_ins = torch.device, torch.Generator
    torch.device, torch.Generator = torch._C.device, torch._C.Generator  # type: ignore[misc]
    try:
        from torch._dynamo import utils
    finally:
        torch.device, torch.Generator = stand_ins  # type: ignore[misc]
    utils.common_constant_types.add(torch._C.device)  # in case it was imported earlier in the run


def _untraced_mode_stack(put: Callable[[Any, str, Any], None], mode: Any) -> None:
    """Dynamo's tracer without the run's function mode (see the module docstring)."""
    _import_dynamo()
    from torch._dynamo import convert_frame

    original = convert_frame.trace_frame

    def trace_frame(code: Any, globals_: Any, locals_: Any, builtins: Any, closure: Any, compiler_fn: Any,
                    tf_mode_stack: list[Any], *args: Any, **kwargs: Any) -> Any:
        kept = [m for m in tf_mode_stack if m is not mode]
        stand_ins = torch.device, torch.Generator
        torch.device, torch.Generator = torch._C.device, torch._C.Generator  # Dynamo knows the real classes
        try:
            output = original(code, globals_, locals_, builtins, closure, compiler_fn, kept, *args, **kwargs)
        finally:
            torch.device, torch.Generator = stand_ins  # type: ignore[misc]
        if output.output_graph is not None:
            output.output_graph.torch_function_mode_stack = list(tf_mode_stack)  # guarded as it runs
        return output

    put(convert_frame, "trace_frame", trace_frame)
    dynamo_view.install(put)
    # the simulation's own frames (the mode, the stand-ins), entered from code Dynamo runs eagerly,
    # are not the script's: Dynamo leaves them alone, as it does torch's (trace_rules.SKIP_DIRS)
    from torch._dynamo import trace_rules

    skipped = [*trace_rules.SKIP_DIRS, str(Path(__file__).parents[2]) + os.sep]
    put(trace_rules, "SKIP_DIRS", skipped)
    trace_rules._recompile_re()


def install(mode: Any, props: Any) -> Callable[[], None]:
    """Put the modelled ``torch.compile`` in place for a run whose function mode is `mode` on a card
    of properties `props`; returns what ends it (the patches, the compile process, Dynamo's caches
    of the graphs compiled for this run)."""
    import vram.frontend.memory as frontend

    from ..cuda.stand_ins import attribute_patches

    put, restore = attribute_patches()
    card = {"major": props.major, "minor": props.minor, "name": props.name, "total_memory": props.total_memory,
            "multi_processor_count": props.multi_processor_count, "l2_cache_size": props.L2_cache_size}
    real_compile = _REAL_COMPILE
    client, notices = CompileClient(card), Notices()
    ready: dict[tuple[bool, bool], Callable[..., Any]] = {}  # by (CUDA graphs, max-autotune)
    trees: list[Trees] = []

    def compile(model: Any = None, **kwargs: Any) -> Any:  # noqa: A001 - torch.compile's name
        caller = sys._getframe(1).f_code.co_filename
        library = any(f"{os.sep}{d}{os.sep}" in caller for d in ("site-packages", "dist-packages"))
        said = isinstance(model, torch.nn.Module) or not library  # a library's helpers: not a compiled model
        backend = kwargs.pop("backend", "inductor")
        reason = ("triton is not installed (pip install 'vram[compile]')" if find_spec("triton") is None else
                  None if backend == "inductor" else f"backend={backend!r} is not modelled")
        if reason is not None:
            if said:
                notices.say(f"torch.compile runs eagerly on the simulated GPU ({reason}), so memory is eager "
                            "PyTorch's (a compiled graph fuses ops and usually needs less)")
            return model if model is not None else (lambda m: m)
        compile_mode = kwargs.pop("mode", None)
        if compile_mode in _MODES:
            notices.say(_MODES[compile_mode])
        if kwargs.pop("options", None):
            notices.say("torch.compile's options= are not modelled: the compiled graphs are default mode's")
        if not ready:
            _untraced_mode_stack(put, mode)
            put(frontend.Stream, "device", property(lambda s: torch.device("cuda", s.device_index)))
            ready[(False, False)] = make_backend(client, notices)
        flavour = (compile_mode in _CUDAGRAPH_MODES, compile_mode in MODE_OPTIONS)
        if flavour[0] and not trees:
            trees.append(Trees(mode.sim, notices.say))  # one tree manager per device, whatever the mode
        if flavour not in ready:
            ready[flavour] = make_backend(client, notices, trees[0] if flavour[0] else None,
                                          mode.sim if flavour[1] else None)
        backend = ready[flavour]
        return real_compile(model, backend=backend, **kwargs) if model is not None else (
            lambda m: real_compile(m, backend=backend, **kwargs))

    put(torch, "compile", compile)

    def end() -> None:
        restore()
        if ready:
            from torch._dynamo import trace_rules

            trace_rules._recompile_re()
        client.close()
        if ready:
            torch._dynamo.reset()

    return end
