"""AOTAutograd's runtime around Inductor's wrappers on the simulated GPU (`vram.run.compile.compiled_graph`,
torch/_functorch/_aot_autograd/runtime_wrappers.py): inputs mutated outside the graph (the updated
value ``copy_``'d into the input, then freed), outputs aliasing an intermediate (made again from the
intermediate base, which lives as long as its views), unsafe views, tangents restrided to the traced
tangent's size and stride, and dynamic shapes (the wrapper's sizes as arguments).

The wrappers here are the ones torch 2.13's Inductor generates for CUDA for the functions named
(``call`` only, the Triton launches and asserts left out: a launch allocates nothing), the layouts
AOTAutograd's ``ViewAndMutationMeta`` for them (`vram.run.compile.runtime_meta.runtime_layout`).
"""
from __future__ import annotations

from importlib.util import find_spec
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from vram.run.compile.compiled_graph import CompiledGraph  # noqa: E402
from vram.run.runtime import simulated_cuda  # noqa: E402

_HEAD = "import torch\nreinterpret_tensor = torch._C._dynamo.guards._reinterpret_tensor\n"
F32_64x256 = 64 * 256 * 4


def _layout(**fields: Any) -> dict[str, Any]:
    layout = {"num_intermediate_bases": 0, "mutated": [], "aliased": [], "unsafe_views": [],
              "in_graph_seen_by_autograd": [], "grad_enabled_mutation": None, "saved": None,
              "saved_no_vc": [0, 0], "saved_symints": [0, 0], "tangents": None, "detach": [],
              "dynamic_dims": None}
    layout.update(fields)
    outputs = layout["outputs"]
    layout["num_outputs"] = len(outputs)
    layout["returns_require_grad"] = [m["requires_grad"] for m in layout["mutated"]] + [
        o["requires_grad"] for o in outputs]
    return layout


def _output(kind: str = "non_alias", base: int | None = None, views: Any = None) -> dict[str, Any]:
    return {"type": kind, "base": base, "requires_grad": True, "for_backward": True, "tensor": True, "views": views}


def _graph(forward: str, backward: str, layout: dict[str, Any]) -> CompiledGraph:
    return CompiledGraph({"sources": [_HEAD + forward, _HEAD + backward], "layout": layout}, 0)


# def f(x):  x.add_(1); return x * 3     (x: a non-leaf that requires grad)
_MUTATION_FORWARD = '''
def call(args):
    primals_1, = args
    args.clear()
    buf0 = empty_strided_cuda((64, 256), (256, 1), torch.float32)
    buf1 = empty_strided_cuda((64, 256), (256, 1), torch.float32)
    del primals_1
    return (buf0, buf1, )
'''
_MUTATION_BACKWARD = '''
def call(args):
    tangents_1, tangents_2 = args
    args.clear()
    buf0 = empty_strided_cuda((64, 256), (256, 1), torch.float32)
    del tangents_1
    del tangents_2
    return (buf0, )
'''


def test_an_input_mutated_outside_the_graph_takes_its_update_which_is_then_freed() -> None:
    """The forward returns x's updated value first; the runtime ``copy_``s it into x (autograd
    records the copy: ``CopyBackwards``) and drops it: both buffers live during the call, the
    output alone after it."""
    layout = _layout(num_forward_returns=2, outputs=[_output()], saved=[2, None],
                     mutated=[{"index": 0, "mutates_data": True, "mutates_metadata": False, "is_leaf": False,
                               "requires_grad": True}],
                     tangents=[[[64, 256], [256, 1]], [[64, 256], [256, 1]]])
    with simulated_cuda("H200"):
        graph = _graph(_MUTATION_FORWARD, _MUTATION_BACKWARD, layout)
        x0 = torch.zeros(64, 256, device="cuda", requires_grad=True)
        x = x0 * 1
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        (out,) = graph(x)
        assert torch.cuda.max_memory_allocated() == base + 2 * F32_64x256
        assert torch.cuda.memory_allocated() == base + F32_64x256
        assert type(x.grad_fn).__name__ == "CopyBackwards"
        assert type(out.grad_fn).__name__ == "_CompiledFunctionBackward"
        out.sum().backward()
        assert x0.grad is not None and x0.grad.shape == x0.shape


# def h(x, w):  y = (x @ w) * 2; return y.view(2, 32, 512)[1:], y.t()     (w requires grad)
_BASE_FORWARD = '''
def call(args):
    primals_1, primals_2 = args
    args.clear()
    buf0 = empty_strided_cuda((64, 512), (512, 1), torch.float32)
    del primals_2
    buf1 = buf0; del buf0  # reuse
    return (reinterpret_tensor(buf1, (1, 32, 512), (16384, 512, 1), 16384), reinterpret_tensor(buf1, (512, 64), (1, 512), 0), buf1, reinterpret_tensor(primals_1, (256, 64), (1, 256), 0), )
'''  # noqa: E501 - the generated line
_BASE_BACKWARD = '''
def call(args):
    permute_1, tangents_1 = args
    args.clear()
    buf0 = empty_strided_cuda((64, 512), (512, 1), torch.float32)
    del tangents_1
    buf1 = empty_strided_cuda((256, 512), (512, 1), torch.float32)
    del buf0
    del permute_1
    return (None, buf1, )
'''


def test_views_of_an_intermediate_keep_its_base_alive() -> None:
    """Both outputs alias one intermediate: the forward returns it as an intermediate base, and
    each output is the view replayed on it (view then slice; t), so the buffer lives until the
    last view is dropped."""
    views = [["view_ViewMeta", [False, True, 2, [2, 32, 512]]],
             ["slice_Tensor_ViewMeta", [False, True, 2, 0, 1, 9223372036854775807, 1]]]
    layout = _layout(num_forward_returns=3, num_intermediate_bases=1, saved=[3, None], aliased=[0, 1],
                     outputs=[_output("alias_of_intermediate_save_as_output", 0, views),
                              _output("alias_of_intermediate", 0, [["t_ViewMeta", [False, True, 2]]])],
                     tangents=[[[64, 512], [512, 1]]])
    with simulated_cuda("H200"):
        graph = _graph(_BASE_FORWARD, _BASE_BACKWARD, layout)
        x = torch.zeros(64, 256, device="cuda")
        w = torch.zeros(256, 512, device="cuda", requires_grad=True)
        base = torch.cuda.memory_allocated()
        p, q = graph(x, w)
        assert p.shape == (1, 32, 512) and q.shape == (512, 64)
        assert (type(p.grad_fn).__name__, type(q.grad_fn).__name__) == ("SliceBackward0", "TBackward0")
        assert p._base is q._base and type(p._base.grad_fn).__name__ == "_CompiledFunctionBackward"
        assert torch.cuda.memory_allocated() == base + 64 * 512 * 4
        del p
        assert torch.cuda.memory_allocated() == base + 64 * 512 * 4
        (q * 1).sum().backward()
        assert w.grad is not None and w.grad.shape == w.shape
        del q
        assert torch.cuda.memory_allocated() == base + 256 * 512 * 4  # w.grad


# def g(x, w):  a, b = (x @ w).chunk(2, dim=1); return a, b     (w requires grad)
_CHUNK_FORWARD = '''
def call(args):
    primals_1, primals_2 = args
    args.clear()
    buf0 = empty_strided_cuda((64, 512), (512, 1), torch.float32)
    del primals_2
    return (reinterpret_tensor(buf0, (64, 256), (512, 1), 0), reinterpret_tensor(buf0, (64, 256), (512, 1), 256), reinterpret_tensor(primals_1, (256, 64), (1, 256), 0), )
'''  # noqa: E501 - the generated line
_CHUNK_BACKWARD = '''
def call(args):
    permute, tangents_1, tangents_2 = args
    args.clear()
    torch._C._dynamo.guards.assert_size_stride(tangents_1, (64, 256), (512, 1), 'input')
    torch._C._dynamo.guards.assert_size_stride(tangents_2, (64, 256), (512, 1), 'input')
    buf0 = empty_strided_cuda((64, 512), (512, 1), torch.float32)
    del tangents_1
    del tangents_2
    buf1 = empty_strided_cuda((256, 512), (512, 1), torch.float32)
    del buf0
    del permute
    return (None, buf1, )
'''


def test_unsafe_view_outputs_and_tangents_restrided_as_traced() -> None:
    """The chunks are unsafe views (``_unsafe_view``: not views to autograd); their gradients
    (``sum``'s expanded ones) are restrided to the traced tangents' (64, 256) with stride
    (512, 1): ``empty_strided`` of 1 + 63 * 512 + 255 floats each, before the backward wrapper's
    own buffers."""
    tangent = [[64, 256], [512, 1]]
    layout = _layout(num_forward_returns=2, saved=[2, None], unsafe_views=[0, 1],
                     outputs=[_output("unsafe_view_alias"), _output("unsafe_view_alias")], tangents=[tangent, tangent])
    with simulated_cuda("H200"):
        graph = _graph(_CHUNK_FORWARD, _CHUNK_BACKWARD, layout)
        x = torch.zeros(64, 256, device="cuda")
        w = torch.zeros(256, 512, device="cuda", requires_grad=True)
        a, b = graph(x, w)
        assert not a._is_view() and not b._is_view()
        loss = a.sum() + b.sum()
        torch.cuda.memory._record_memory_history(max_entries=1000)
        loss.backward()
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
    sizes = [e["size"] for e in trace if e["action"] == "alloc" and e["size"] > 512]
    restrided = (1 + 63 * 512 + 255) * 4
    assert sizes == [restrided, restrided, 64 * 512 * 4, 256 * 512 * 4]


def _mutate_and_scale(x: torch.Tensor) -> torch.Tensor:
    x.add_(1)
    return x * 3


def _two_views(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = (x @ w) * 2
    return y.view(2, 32, 512)[1:], y.t()


def _scaled(x: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    return (x @ w) * scale


def _step(model: torch.nn.Module, batch: int) -> list[int]:
    """One training step of `model` on a new batch; the sizes (> 512 bytes) its backward allocates."""
    x = torch.zeros(batch, 256, device="cuda")
    loss = model(x).sum()
    torch.cuda.memory._record_memory_history(max_entries=10_000)
    loss.backward()
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(enabled=None)
    for p in model.parameters():
        p.grad = None
    return [e["size"] for e in trace if e["action"] == "alloc" and e["size"] > 512]


@pytest.mark.skipif(find_spec("triton") is None, reason="needs triton (the 'compile' extra)")
@pytest.mark.slow  # a compile process and six graphs compiled: about a minute
def test_compiled_programs_the_runtime_used_to_run_eagerly(capsys: pytest.CaptureFixture[str]) -> None:
    """Through Dynamo and the compile process, the three kinds of graph that ran eagerly before:
    an input mutated outside the graph (the wrapper writes x + 1 and (x + 1) * 3 in one kernel:
    both live in the call, the update freed after the copy-back; eagerly ``add_`` writes in place),
    outputs aliasing an intermediate (one buffer, ``mm`` then an in-place scale, kept by its views;
    eagerly the product and the scaled copy), a float argument whose value changes (a 0-d CPU
    tensor input: ``mm``'s buffer scaled in place; eagerly the product and its scaled copy), and
    the MLP's third batch size, which Dynamo compiles
    with a symbolic batch ``s``: its backward wrapper allocates (s, 1024), (256, 1024) and (1, 256)
    floats, then (1, 1024), (1024, 256) (buf3 reuses buf0), after the tangent made contiguous
    (``sum``'s expanded gradient, (s, 256))."""
    nbytes = 64 * 256 * 4
    with simulated_cuda("H200"):
        torch.ones(2, 2, device="cuda") @ torch.ones(2, 2, device="cuda")  # cuBLAS's workspace, once
        mutate = torch.compile(_mutate_and_scale)
        x0 = torch.zeros(64, 256, device="cuda", requires_grad=True)
        for first in (True, False):  # the second call: no autotuning
            x = x0 * 1
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = mutate(x)
            if first:
                del out, x
        assert torch.cuda.max_memory_allocated() == base + 2 * nbytes
        assert torch.cuda.memory_allocated() == base + nbytes
        assert type(x.grad_fn).__name__ == "CopyBackwards"
        del out, x

        views = torch.compile(_two_views)
        x, w = torch.zeros(64, 256, device="cuda"), torch.zeros(256, 512, device="cuda", requires_grad=True)
        for first in (True, False):
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            p, q = views(x, w)
            if first:
                del p, q
        assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated() == base + 64 * 512 * 4
        del p
        assert torch.cuda.memory_allocated() == base + 64 * 512 * 4
        del q
        assert torch.cuda.memory_allocated() == base

        scaled = torch.compile(_scaled)
        w = torch.zeros(256, 256, device="cuda", requires_grad=True)
        for scale in (0.5, 0.7, 0.9):  # from the second, the float is a 0-d CPU tensor input (a host kernel casts it)
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = scaled(x, w, scale)
            del out
        assert torch.cuda.max_memory_allocated() == base + 64 * 256 * 4  # mm, then scaled in place
        del w

        mlp = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda()
        model = torch.compile(mlp)
        _step(model, 64)
        _step(model, 48)  # Dynamo recompiles with a symbolic batch (autotuning its kernels)
        s = 32
        assert _step(model, s) == [s * 256 * 4, s * 1024 * 4, 256 * 1024 * 4, 256 * 4, 1024 * 4, 1024 * 256 * 4]
    err = capsys.readouterr().err
    assert "runs eagerly" not in err and "not modelled" not in err


def test_cuda_graph_trees_make_one_function_per_set_of_sizes() -> None:
    """``mode="reduce-overhead"`` with symbolic sizes: ``cudagraphify_impl`` keeps a tree function
    per value of the partition's int inputs (its ``fn_cache``), each warmed up and recorded on its
    own; a graph without sizes keeps one."""
    from vram.run.compile.cudagraph_trees import Trees

    class Manager:
        def __init__(self) -> None:
            self.functions: list[int] = []

        def run(self, function: Any, inputs: list[Any]) -> None:
            self.functions.append(function.id)

    trees = Trees(None, print)
    trees.managers[0] = manager = Manager()  # type: ignore[assignment]
    dynamic = trees.cudagraphify(lambda inputs: None, [0], "forward", 0)
    static = trees.cudagraphify(lambda inputs: None, [0], "forward", 0)
    for size in (48, 48, 32, 48):
        dynamic(["weight", size, "x"])
    static(["weight", "x"])
    static(["weight", "x"])
    first, _, second, _, third, _ = manager.functions
    assert manager.functions == [first, first, second, first, third, third] and len({first, second, third}) == 3
