"""``mode="max-autotune"`` / ``"max-autotune-no-cudagraphs"``: the kernel choice and the memory its
benchmarking takes.

On a GPU, Inductor lowers each matmul (and convolution) with several choices, the extern ATen
kernel (cuBLAS) and Triton templates, and ``AlgorithmSelectorCache.__call__``
(torch/_inductor/select_algorithm.py) benchmarks them while compiling, in the compiling process
(``autotune_in_subproc`` off by default): ``get_inputs`` makes one example tensor per distinct
input node and one output (``benchmark_example_value`` -> ``rand_strided``: the storage up to the
largest offset), then ``benchmark_choices`` runs each choice through ``benchmark_gpu`` (a warm-up
call, an L2-flush buffer of ``L2_cache_size`` bytes over the timed calls), an extern choice's
first cuBLAS call allocating the thread's workspaces; the example tensors are freed when the
selection returns. Timings cannot be measured without a GPU, so the choice made here is the one
Inductor makes when it does not benchmark (``config.deterministic``: ``pick_deterministic_choice``,
the first extern kernel: the cuBLAS call default mode makes); the rest of the graph compiles as
the mode compiles it. The benchmarking's allocations are modelled (`benchmark_footprint`) in the
order above, one flush buffer per choice.

What the choice can change, against the kernel a GPU's timings pick (`bound`, said once per
graph; docs/estimate-accuracy.md §8): every choice writes the selection's fixed output layout, in
the buffer the wrapper allocates (``empty_strided_cuda``; the extern kernel's ``out=``), so
a Triton template can only take less where it fuses an epilogue (that matmul's output buffer is
then not made: at most the matmul outputs) and where it makes no cuBLAS call (the backward
thread's workspaces: the compiling thread's are allocated by the benchmarking anyway); a
subgraph choice can take more inside its call (``decompose_k``'s float32 split product,
``contiguous_mm``'s copy of the second matrix), one call at a time.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: Inductor's options per mode (torch/_inductor/__init__.py ``list_mode_options``)
MODE_OPTIONS = {"max-autotune": {"max_autotune": True, "coordinate_descent_tuning": True},
                "max-autotune-no-cudagraphs": {"max_autotune": True, "coordinate_descent_tuning": True}}


def _storage_bytes(node: Any) -> int:
    """``rand_strided``'s allocation for an IR node or layout (``benchmark_example_value``)."""
    from torch._inductor import ir
    from torch._inductor.select_algorithm import get_strides_with_layout_constraints
    from torch._inductor.virtualized import V

    if isinstance(node, ir.Layout):
        node = ir.Buffer(name="fake", layout=node)
    if isinstance(node, ir.BaseView):
        node = node.unwrap_view()
    sizes = V.graph.sizevars.optimization_hints(node.get_size())
    strides = V.graph.sizevars.optimization_hints(get_strides_with_layout_constraints(node))
    offset = V.graph.sizevars.optimization_hint(node.layout.offset)
    elements = offset + (1 + sum((s - 1) * st for s, st in zip(sizes, strides)) if all(s > 0 for s in sizes) else 0)
    return int(elements) * node.get_dtype().itemsize


def _temporaries(choice: Any, layout: Any, inputs: list[int]) -> int:
    """Bytes a choice allocates inside its call beyond the output (kernel/mm.py): ``decomposeK``
    (its ``bmm`` product in float32, ``k_splits`` x M x N, and the float32 sum), ``contiguous_mm``
    (a contiguous copy of the second matrix); 0 for the others."""
    from torch._inductor.virtualized import V

    name = getattr(choice, "name", "")
    if name.startswith("decompose_k_mm_") and name.endswith("_split"):
        splits = int(name.removeprefix("decompose_k_mm_").removesuffix("_split"))
        elements = 1
        for size in V.graph.sizevars.optimization_hints(layout.size):
            elements *= int(size)
        return (splits + 1) * elements * 4
    if name == "contiguous_mm" and inputs:
        return inputs[-1]
    return 0


def bound(selections: list[dict[str, Any]], workspaces: int) -> tuple[int, int]:
    """How much a GPU's own choices could change the compiled graphs' memory at any moment
    (module docstring): at most the largest temporary one choice makes more (the calls run one
    at a time), at most every matmul's output plus the backward thread's workspaces less."""
    more = max((s["temporaries"] for s in selections), default=0)
    less = sum(s["output"] for s in selections) + (workspaces if selections else 0)
    return more, less


@contextmanager
def deterministic_choices(selections: list[dict[str, Any]]) -> Iterator[None]:
    """Inside: each selection with several choices takes Inductor's choice without benchmarks
    (``pick_deterministic_choice``) and is recorded in `selections`: the bytes of its example
    inputs (one per distinct input node) and output, and per choice whether it is extern."""
    from torch._inductor.select_algorithm import AlgorithmSelectorCache, ExternKernelCaller

    original = AlgorithmSelectorCache.__call__

    def call(self: Any, name: str, choices: list[Any], input_nodes: list[Any], layout: Any,
             *args: Any, **kwargs: Any) -> Any:
        if len(choices) < 2:
            return original(self, name, choices, input_nodes, layout, *args, **kwargs)
        distinct = {node.get_name(): node for node in input_nodes}
        inputs = [_storage_bytes(n) for n in distinct.values()]
        selections.append({"name": name, "inputs": inputs, "output": _storage_bytes(layout),
                           "extern": [isinstance(c, ExternKernelCaller) for c in choices],
                           "temporaries": max((_temporaries(c, layout, inputs) for c in choices), default=0)})
        choice = self.pick_deterministic_choice(choices)
        return choice.output_node(), choice

    AlgorithmSelectorCache.__call__ = call  # type: ignore[method-assign]
    try:
        yield
    finally:
        AlgorithmSelectorCache.__call__ = original  # type: ignore[method-assign]


def benchmark_footprint(selections: list[dict[str, Any]], device: int, l2_bytes: int, workspace: Any) -> None:
    """The benchmarking's allocations on simulated GPU `device` (its allocator, the current
    stream: Dynamo's backend runs outside the run's function mode), selection by selection: the
    example inputs and output, per choice the extern kernel's cuBLAS workspaces (`workspace(name)`)
    and one L2-flush buffer (`l2_bytes`) held over the timed calls, then the examples freed."""
    from vram.frontend import memory as _memory

    allocator = _memory.get_allocator(device)
    stream = _memory.current_stream(device).cuda_stream
    for selection in selections:
        examples = [allocator.malloc(n, stream) for n in (*selection["inputs"], selection["output"]) if n]
        for extern in selection["extern"]:
            if extern:
                workspace(selection["name"])
            allocator.free(allocator.malloc(l2_bytes, stream))
        for ptr in examples:
            allocator.free(ptr)
