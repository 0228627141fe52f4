"""Compiled programs as PyTorch users write them (torchvision, timm, Hugging Face models; compiled
optimizer steps and loss functions) under ``vram run``: what each needs of the compile process,
checked against PyTorch's source and Inductor's generated wrappers."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from importlib.util import find_spec

import pytest

torch = pytest.importorskip("torch")

from paths import REPO  # noqa: E402
from vram.run.compile.graph_transport import graph_module, graph_nodes  # noqa: E402

needs_triton = pytest.mark.skipif(find_spec("triton") is None, reason="needs triton (the 'compile' extra)")


def test_a_function_made_inside_another_travels_by_its_modules_name() -> None:
    """``F.max_pool2d`` is ``boolean_dispatch``'s inner ``fn`` (its ``__qualname__``
    ``boolean_dispatch.<locals>.fn``, which pickle cannot name; torchvision's ResNet calls it): the
    node is rebuilt with the function ``torch.nn.functional`` holds under its ``__name__``, as FX's
    code names it (``_get_qualified_name``). A local function no module holds is refused by name."""
    F = torch.nn.functional
    assert "<locals>" in F.max_pool2d.__qualname__
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(F.max_pool2d, (x, 2))
    graph.output(graph.call_function(F.adaptive_max_pool2d, (y, 1)))
    gm = graph_module(pickle.loads(pickle.dumps(graph_nodes(graph))))  # noqa: S301 - made here
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets[0] is F.max_pool2d and targets[1] is F.adaptive_max_pool2d

    def scaled(t: torch.Tensor) -> torch.Tensor:
        return t * 2

    graph = torch.fx.Graph()
    graph.output(graph.call_function(scaled, (graph.placeholder("x"),)))
    with pytest.raises(ValueError, match=r"a function defined inside another \(.*scaled\)"):
        graph_nodes(graph)


def test_an_operator_in_a_graph_travels_by_its_path_under_torch_ops() -> None:
    """Dynamo's graph of a ``torch.export``-made module (a pipeline stage's ``InterpreterModule``s,
    whose code calls ``torch.ops.aten.linear.default``) has operator overloads as targets, which do
    not pickle (``OpOverload`` holds its schema's pybind11 functions): each is sent by its path
    under ``torch.ops`` and is the same operator on the other side; so is an overload packet."""
    aten = torch.ops.aten
    with pytest.raises(Exception, match="not pickleable"):
        pickle.dumps(aten.linear.default)
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    y = graph.call_function(aten.linear.default, (x, w))
    graph.output(graph.call_function(aten.relu, (graph.call_function(aten.add.Tensor, (y, x)),)))
    gm = graph_module(pickle.loads(pickle.dumps(graph_nodes(graph))))  # noqa: S301 - made here
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [aten.linear.default, aten.add.Tensor, aten.relu]
    assert all(a is b for a, b in zip(targets, [aten.linear.default, aten.add.Tensor, aten.relu], strict=True))


def test_a_torch_cuda_stand_in_in_a_graph_travels_as_torch_cudas_function() -> None:
    """``torch.cuda.get_device_capability`` is a graph node on a GPU
    (``trace_rules.torch_non_c_binding_in_graph_functions``); under the run it is the run's
    stand-in, a lambda pickle cannot name: it is sent by its name in ``torch.cuda``, which the
    compile process answers for the simulated card."""
    from vram.run.compile.graph_transport import FunctionRef
    from vram.run.runtime import simulated_cuda

    with simulated_cuda("H200"):
        stand_in = torch.cuda.get_device_capability
        assert "<locals>" in stand_in.__qualname__
        graph = torch.fx.Graph()
        graph.output(graph.call_function(stand_in, ()))
        sent = pickle.loads(pickle.dumps(graph_nodes(graph)))  # noqa: S301 - made here
    target = sent["nodes"][0][2]
    assert isinstance(target, FunctionRef) and target.qualified == "torch.cuda.get_device_capability"
    assert target.resolve() is torch.cuda.get_device_capability


def test_inductor_settings_are_those_the_script_changed() -> None:
    """What the compile process is given of ``torch._inductor.config``: the settings whose value
    is not the default (``config.py``: ``deterministic`` defaults to False, which a library may
    set explicitly; sent, it changed the compile's key and compiled an identical graph again),
    without the caches' and threads' settings, which the compile process keeps."""
    from vram.run.compile.backend import inductor_settings

    config = torch._inductor.config
    with config.patch({"deterministic": False, "fx_graph_cache": False, "coordinate_descent_tuning": True}):
        assert inductor_settings() == ({"coordinate_descent_tuning": True}, [])


_CONV_CHOICES = """
from vram.run.compile import cuda_process
cuda_process.prepare(major={major})
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
cl = torch.channels_last
with FakeTensorMode():
    x = torch.empty(4, 3, 16, 16, device="cuda").to(memory_format=cl)
    w = torch.empty(64, 3, 3, 3, device="cuda").to(memory_format=cl)
    args = (None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    print(torch._C._select_conv_backend(x, w, *args), torch.ops.aten.convolution(x, w, *args).stride())
    xb, wb = x.contiguous().bfloat16(), w.contiguous().bfloat16()
    print(torch._C._select_conv_backend(xb, wb, *args))
    dw = torch.empty(32, 1, 3, 3, device="cuda").to(memory_format=cl)
    xd = torch.empty(4, 32, 16, 16, device="cuda").to(memory_format=cl)
    print(torch._C._select_conv_backend(xd, dw, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 32))
"""


@pytest.mark.parametrize("major, bf16", [(9, "Cudnn"), (7, "Slow2d")])
def test_the_compile_process_chooses_convolutions_as_a_cudnn_build(major: int, bf16: str) -> None:
    """Inductor's layout optimization makes a ResNet's convolution inputs channels-last; the output
    layout it expects is the fake kernel's, which follows ``_select_conv_backend``
    (``Convolution.cpp``): on a CUDA build with cuDNN, ``Cudnn``, whose output is channels-last when
    the input or weight is (``cudnn_conv_suggest_memory_format``), as the simulated GPU runs it. A
    CPU build's hooks say no cuDNN (``Slow2d``: contiguous, and the wrapper's stride check failed
    on the simulated GPU). bf16 takes cuDNN from major 8 (``supportsBFloat16ConvolutionWithCuDNNv8``),
    a channels-last depthwise one from major 7 (``use_cudnn_depthwise``)."""
    done = subprocess.run([sys.executable, "-c", _CONV_CHOICES.format(major=major)], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(REPO / "src")), timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "_ConvBackend.Cudnn (16384, 1, 1024, 64)"
    assert lines[1] == f"_ConvBackend.{bf16}"
    assert lines[2] == "_ConvBackend.Cudnn"


@needs_triton
@pytest.mark.slow  # a compile process and two graphs compiled: about a minute
def test_a_channels_last_convolution_and_max_pool_compile_as_on_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    """A 3 -> 128 convolution in training takes Inductor's layout optimization
    (``GraphLowering.decide_layout_opt``: a convolution, not grouped, not all channels <= 64, out
    channels not <= half the in channels); the forward wrapper, by hand: the weight and the input
    copied channels-last (``buf0`` 128x3x3x3 floats, 13,824 B; ``buf1`` 2x3x8x8, 1,536 B), cuDNN's
    channels-last output (``buf2``, 65,536 B), copied to the contiguous layout eager gives the user
    (``buf3``, 65,536 B), ``buf2`` deleted; ``buf0`` and ``buf1`` saved for the backward. Each
    kernel has one config: no autotuning. Then ``F.max_pool2d`` (``boolean_dispatch``'s function)
    under ``no_grad``: Inductor's kernel writes the (2, 128, 4, 4) output alone (16,384 B), where
    eager CUDA's ``max_pool2d_with_indices`` also makes the int64 indices; a 1-D pointwise kernel
    has two configs (``triton_heuristics.pointwise``), so its first launch benchmarks both with the
    H200's L2-flush buffer (62,914,560 B) held over the output."""
    from vram.run.runtime import simulated_cuda

    with simulated_cuda("H200"):
        conv = torch.nn.Conv2d(3, 128, 3, padding=1, bias=False).cuda()
        x = torch.randn(2, 3, 8, 8, device="cuda")
        base = torch.cuda.memory_allocated()
        assert base == 13_824 + 1_536
        out = torch.compile(conv)(x)
        assert torch.cuda.max_memory_allocated() - base == 13_824 + 1_536 + 2 * 65_536
        assert torch.cuda.memory_allocated() - base == 13_824 + 1_536 + 65_536
        assert out.stride() == (8192, 64, 8, 1) and type(out.grad_fn).__name__ == "_CompiledFunctionBackward"
        out = out.detach()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        pool = torch.compile(lambda t: torch.nn.functional.max_pool2d(t, 2))
        for flush in (62_914_560, 0):
            with torch.no_grad():
                pooled = pool(out)
            assert pooled.shape == (2, 128, 4, 4)
            assert torch.cuda.max_memory_allocated() - before == flush + 16_384
            del pooled
            torch.cuda.reset_peak_memory_stats()
    err = capsys.readouterr().err
    assert "eagerly" not in err and "not modelled" not in err, err


@needs_triton
@pytest.mark.slow  # a compile process: about 40 s
def test_a_compiled_optimizer_step_updates_in_place_with_its_state_on_the_gpu(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``torch.compile`` of ``opt.step`` (PyTorch's "compiling the optimizer" recipe: Adam, a
    tensor learning rate). Dynamo makes the state capturable, its ``step`` counters on the GPU
    (``OptimizerVariable._set_capturable``: every parameter ``is_cuda``), and reads parameters and
    state as module attributes, which AOTAutograd lifts into inputs (``aot_module_simplified``).
    Inductor's wrapper runs the whole update in place (two ``triton_for_fused`` combo kernels, one
    config each: no buffer of its own). So the first step allocates the state alone while tracing
    (``_init_group``): ``exp_avg`` and ``exp_avg_sq`` of the 256 x 512 weight (524,288 B each) and
    of the bias (2,048 B each), and two float32 ``step`` tensors (512-byte blocks); later steps
    allocate nothing. (Eagerly, the foreach step makes temporaries as large as the parameters.)"""
    from vram.run.runtime import simulated_cuda

    with simulated_cuda("H200"):
        m = torch.nn.Linear(256, 512).cuda()
        opt = torch.optim.Adam(m.parameters(), lr=torch.tensor(0.01))

        @torch.compile
        def step() -> None:
            opt.step()

        x = torch.randn(16, 256, device="cuda")
        for expected in (2 * (524_288 + 2_048) + 2 * 512, 0, 0):
            m(x).sum().backward()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            assert torch.cuda.max_memory_allocated() - base == expected
            assert torch.cuda.memory_allocated() - base == expected
            opt.zero_grad()
        assert opt.param_groups[0]["capturable"] and opt.state[m.weight]["step"].is_cuda
    err = capsys.readouterr().err
    assert "eagerly" not in err and "not modelled" not in err, err


@needs_triton
@pytest.mark.slow  # a compile process: about 40 s
def test_compiled_code_sees_the_simulated_tensors_on_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    """Code Dynamo traces that asks a tensor's device takes a GPU's branch: ``x.is_cuda`` and
    ``x.device.type == "cuda"`` are True, ``torch.autocast(device_type=x.device.type)`` is CUDA's
    (Hugging Face's rotary embeddings; ``vramsim`` has no autocast: Dynamo failed), and tensors
    the code makes on ``"cuda"`` (``device="cuda"``, ``.to("cuda")``, ``.cuda()``) are on the script's device
    (Dynamo's fake run refused two devices).
    All in one graph: Inductor's one kernel writes the (4, 8) float32 result, 128 B, a 512-byte
    block, beside ``x``'s."""
    from vram.run.runtime import simulated_cuda

    def f(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
        on_gpu = x.is_cuda and x.device.type == "cuda"
        with torch.autocast(device_type=x.device.type, enabled=False):
            y = x.float() * 2
        y = y + torch.ones(4, 8, device="cuda") + torch.zeros(4, 8).to("cuda")
        return y + torch.full((4, 8), 3.0).cuda(), on_gpu

    with simulated_cuda("H200"):
        x = torch.randn(4, 8, device="cuda")
        torch.cuda.reset_peak_memory_stats()
        out, on_gpu = torch.compile(f)(x)
        assert on_gpu is True and out.device == torch.device("cuda", 0)
        assert torch.cuda.max_memory_allocated() == 2 * 512
    err = capsys.readouterr().err
    assert "eagerly" not in err and "not modelled" not in err, err


@needs_triton
@pytest.mark.slow  # a compile process, two graphs: about a minute
def test_the_scripts_inductor_settings_are_compiled_with(capsys: pytest.CaptureFixture[str]) -> None:
    """``torch._inductor.config.coordinate_descent_tuning = True`` (gpt-fast sets it) is in force
    in the compile process: the row sum of a (4, 8) tensor is a persistent reduction with one
    config (``triton_heuristics.persistent_reduction``: XBLOCK 1 only, 8 > xnumel 4), so by
    default its first launch benchmarks nothing; with the setting, coordinate descent benchmarks
    it (``CachingAutotuner.run`` -> ``coordinate_descent_tuning``) with the H200's L2-flush buffer
    (62,914,560 B) over the output (512-byte block). ``max_autotune`` set in the config (chosen
    by benchmarks on a GPU) runs eagerly, said once."""
    from vram.run.runtime import simulated_cuda

    def f(x: torch.Tensor) -> torch.Tensor:
        return x.sum(dim=1)

    with simulated_cuda("H200"):
        x = torch.randn(4, 8, device="cuda")
        for coordesc, flush in ((False, 0), (True, 62_914_560)):
            torch._dynamo.reset()
            torch.cuda.reset_peak_memory_stats()
            with torch._inductor.config.patch(coordinate_descent_tuning=coordesc):
                assert torch.compile(f)(x).shape == (4,)
            assert torch.cuda.max_memory_allocated() == 512 + 512 + flush
        torch._dynamo.reset()
        with torch._inductor.config.patch(max_autotune=True):
            torch.compile(f)(x)
    err = capsys.readouterr().err
    assert err.count("torch._inductor.config.max_autotune set by the script") == 1, err
