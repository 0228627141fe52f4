"""``torch.compile`` under ``vram run``: Dynamo traces the script as on a GPU and each graph is
compiled by Inductor for CUDA in a compile process (`vram.run.compile`), then run on the simulated
GPU. Without triton (the ``compile`` extra), or for another backend, the program runs eagerly and
says so once. What is not modelled (reduce-overhead's CUDA graph pools, max-autotune's kernel
choice) is said once on stderr. The compiled GPT against the H200 recording:
tests/test_compile_inductor.py."""
from __future__ import annotations

from importlib.util import find_spec

import pytest

torch = pytest.importorskip("torch")

from vram.run.compile import backend as compile_backend  # noqa: E402
from vram.run.runtime import simulated_cuda  # noqa: E402

needs_triton = pytest.mark.skipif(find_spec("triton") is None, reason="needs triton (the 'compile' extra)")


@pytest.fixture
def no_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compile_backend, "find_spec", lambda name: None if name == "triton" else find_spec(name))


def test_compile_without_triton_runs_eagerly_and_says_so_once(no_triton: None,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    with simulated_cuda("24GiB"):
        m = torch.nn.Linear(8, 8).cuda()
        assert torch.compile(m) is m
        assert torch.compile(mode="max-autotune")(m) is m  # the decorator form
        m(torch.zeros(2, 8, device="cuda"))
        f = torch.compile(lambda x: x * 2)
        assert f(torch.ones(4, device="cuda")).is_cuda
    err = capsys.readouterr().err
    assert err.count("torch.compile runs eagerly") == 1 and "triton is not installed" in err


def test_another_backend_runs_eagerly_and_says_which(capsys: pytest.CaptureFixture[str]) -> None:
    with simulated_cuda("24GiB"):
        m = torch.nn.Linear(8, 8).cuda()
        assert torch.compile(m, backend="aot_eager") is m
    err = capsys.readouterr().err
    if find_spec("triton") is not None:
        assert "backend='aot_eager' is not modelled" in err


@needs_triton
def test_modes_say_what_is_not_measured_once(capsys: pytest.CaptureFixture[str]) -> None:
    """reduce-overhead (CUDA graph trees, `vram.run.compile.cudagraph_trees`) is modelled: nothing
    said; max-autotune's choice without a GPU's timings is said when compiled (nothing is traced
    until the first call), once per mode."""
    with simulated_cuda("24GiB"):
        m = torch.nn.Linear(8, 8).cuda()
        compiled = torch.compile(m, mode="reduce-overhead")
        assert compiled is not m and compiled._orig_mod is m
        torch.compile(m, mode="reduce-overhead")
        torch.compile(m, mode="max-autotune-no-cudagraphs")
        torch.compile(m, mode="max-autotune-no-cudagraphs")
    err = capsys.readouterr().err
    assert "reduce-overhead" not in err and "not modelled" not in err
    assert err.count("pick_deterministic_choice") == 1
    assert torch.compile.__module__ == "torch"  # the run's patch is gone


def test_dynamo_handler_table_builds_under_the_simulation() -> None:
    """Dynamo keys its torch-function handlers by function and refuses one registered twice
    (torch/_dynamo/variables/torch.py ``TorchInGraphFunctionVariable._get_handlers``, which
    registers ``torch.cuda._exchange_device`` and ``torch.cuda._maybe_exchange_device``): the
    simulated ``torch.cuda`` must give them distinct functions, else any Dynamo trace under
    ``vram run`` fails with "Handler already registered"."""
    from torch._dynamo.variables.torch import TorchInGraphFunctionVariable

    get = TorchInGraphFunctionVariable._get_handlers
    with simulated_cuda("24GiB"):
        assert torch.cuda._exchange_device is not torch.cuda._maybe_exchange_device
        get.cache_clear()
        try:
            handlers = get()
        finally:
            get.cache_clear()  # built again, outside the simulation, by the next trace
        assert torch.cuda._maybe_exchange_device in handlers
        assert torch.cuda._exchange_device(-1) == 0 and torch.cuda._maybe_exchange_device(-1) == 0


def test_a_library_compiling_its_helpers_says_nothing(tmp_path, monkeypatch, no_triton: None,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """DeepSpeed and litgpt decorate helper functions with ``torch.compile`` when imported; the
    script never compiles its model, so the notice (about a compiled model's memory) is not said."""
    lib = tmp_path / "site-packages" / "helperlib"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text("import torch\n\n@torch.compile\ndef gelu(x):\n    return x * 2\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site-packages"))
    with simulated_cuda("24GiB"):
        import helperlib

        assert helperlib.gelu(torch.ones(2, device="cuda")).is_cuda
    assert "torch.compile runs eagerly" not in capsys.readouterr().err
    with simulated_cuda("24GiB"):
        torch.compile(torch.nn.Linear(2, 2).cuda())   # a model, whoever compiles it
    assert capsys.readouterr().err.count("torch.compile runs eagerly") == 1


def _graph_break_function(x: torch.Tensor) -> torch.Tensor:
    y = (x * 2).sin()
    torch._dynamo.graph_break()
    return (y + 1).cos()


def _graph_ops(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


@needs_triton
@pytest.mark.slow  # a compile process and two graphs compiled: about a minute
def test_compiled_graphs_are_dynamos_and_fuse_as_inductor_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the run, Dynamo traces the same graphs as on the CPU (the run's function mode is not
    traced into: no graph break at every op), breaks where Dynamo breaks, and each graph runs as
    Inductor's wrapper: the elementwise chain is one fused kernel writing one buffer, where eager
    PyTorch keeps an intermediate alive."""
    cpu_graphs: list[list[str]] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        cpu_graphs.append(_graph_ops(gm))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(_graph_break_function, backend=capture)(torch.zeros(1024, 1024))
    torch._dynamo.reset()
    run_graphs: list[list[str]] = []
    request = compile_backend.graph_request

    def spy(gm: torch.fx.GraphModule, example_inputs: list, card: dict, cudagraphs: bool = False) -> dict:
        run_graphs.append(_graph_ops(gm))
        return request(gm, example_inputs, card, cudagraphs)

    monkeypatch.setattr(compile_backend, "graph_request", spy)
    nbytes = 1024 * 1024 * 4
    with simulated_cuda("H100", device_count=2):
        x = torch.zeros(1024, 1024, device="cuda")
        compiled = torch.compile(_graph_break_function)
        l2_flush = torch.cuda.get_device_properties(0).L2_cache_size
        for first in (True, False):
            torch.cuda.reset_peak_memory_stats()
            out = compiled(x)
            assert out.device.type == "cuda" and out.shape == x.shape
            # each graph: one fused kernel, one output buffer; the first graph's output (y) lives
            # until the second graph has read it: input, y and the result at the peak, and at each
            # kernel's first launch the autotuning's L2-flush buffer (a pointwise kernel: 2 configs)
            assert torch.cuda.max_memory_allocated() == 3 * nbytes + (l2_flush if first else 0)
            del out
            assert torch.cuda.memory_allocated() == nbytes
        # on the second GPU (Dynamo recompiles for the device): the wrapper's buffers are there too
        out = compiled(torch.zeros(1024, 1024, device="cuda:1"))
        assert out.device == torch.device("cuda", 1) and torch.cuda.memory_allocated(1) == nbytes
        assert torch.cuda.memory_allocated(0) == nbytes
    assert run_graphs[:2] == cpu_graphs and len(cpu_graphs) == 2


@needs_triton
@pytest.mark.slow  # a compile process and a CNN compiled: about a minute
def test_a_choice_inductor_benchmarks_while_compiling_is_said(capsys: pytest.CaptureFixture[str]) -> None:
    """pad_mm times the padded and unpadded matmul on the GPU when its rules leave the choice open
    (a 14,400 x 10 linear: n not aligned, compute bound): the graph is compiled unpadded and the run
    says so; BatchNorm's running statistics (inputs the graph mutates) stay in the compiled graph."""
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                            torch.nn.Flatten(), torch.nn.Linear(16 * 30 * 30, 10))
    with simulated_cuda("H100"):
        compiled = torch.compile(m.cuda())
        out = compiled(torch.zeros(8, 3, 32, 32, device="cuda"))
        assert type(out.grad_fn).__name__ == "_CompiledFunctionBackward"
        out.sum().backward()
    err = capsys.readouterr().err
    assert err.count("pad_mm") == 1 and "not modelled (" not in err and "runs eagerly" not in err


def test_a_device_constant_in_a_graph_becomes_a_per_call_buffer_in_the_compile_process() -> None:
    """``torch.tensor(data, device="cuda")`` inside a graph (Hugging Face's ``DynamicCache`` starts
    each layer with ``torch.tensor([], device=...)``): on a GPU AOTAutograd's trace copies the
    constant on each call (``lift_fresh_copy``); the graph the compile process builds makes that
    buffer as ``empty`` + ``copy_`` from the host data (a host tensor under FakeTensorMode's
    constant propagation there, which a ``cat`` with CUDA tensors refused). Data-free constants
    say nothing; one with data names the block the compiled graph holds on a GPU."""
    from vram.run.compile.cuda_process import GUESSED
    from vram.run.compile.graph_transport import CONSTANTS_HELD, graph_module, graph_nodes

    cuda = torch.device("cuda", 0)
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    k = graph.call_function(torch.tensor, ([],), {"dtype": torch.float16, "device": cuda})
    c = graph.call_function(torch.tensor, ([1.0, 2.0],), {"device": cuda})
    graph.output((graph.call_function(torch.cat, ([k, x],)), c))
    GUESSED.clear()
    gm = graph_module(graph_nodes(graph))
    calls = [(n.op, n.target, n.args, n.kwargs) for n in gm.graph.nodes if n.op.startswith("call")]
    assert calls[:3] == [("call_function", torch.tensor, ([],), {"dtype": torch.float16}),
                         ("call_function", torch.empty, ((0,),), {"dtype": torch.float16, "device": cuda}),
                         ("call_method", "copy_", calls[2][2], {})]
    assert calls[3][1] is torch.tensor and calls[4][2:] == (((2,),), {"dtype": torch.float32, "device": cuda})
    assert GUESSED == {CONSTANTS_HELD}


@needs_triton
@pytest.mark.slow  # a compile process: about 40 s
def test_a_graph_making_an_empty_device_tensor_compiles() -> None:
    """The constant's path under ``vram run``: the graph compiles (it ran eagerly before) and
    allocates what Inductor's one fused kernel writes (cat with a 0-element tensor, then a
    multiply): x's block and the output's (128 B each, 512-byte blocks); the 0-element buffer
    takes no block (the caching allocator returns no block for size 0)."""
    def f(x: torch.Tensor) -> torch.Tensor:
        k = torch.tensor([], dtype=x.dtype, device=x.device)
        return torch.cat([k, x], dim=-2) * 2

    with simulated_cuda("H200"):
        x = torch.randn(4, 8, device="cuda")
        torch.cuda.reset_peak_memory_stats()
        out = torch.compile(f)(x)
        assert out.shape == (4, 8) and torch.cuda.max_memory_allocated() == 1024
