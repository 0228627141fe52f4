"""What unmodified third-party scripts met under ``vram run``, each as a
minimal reproduction: torch.cuda's replacements take torch's own parameter names (timm's loader
calls ``torch.cuda.stream(stream=...)``), DataLoader's pin-memory thread runs (minGPT's trainer:
``pin_memory=True, num_workers=4``), and ``torch.profiler`` with CUDA activity profiles the CPU
instead of warning once per op with a C++ stack trace (nanoGPT's ``bench.py --profile=True``).
"""
from __future__ import annotations

import inspect
import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.nn.parallel import comm  # noqa: E402  (torch.cuda.comm)

from vram.frontend import memory as _memory  # noqa: E402
from vram.run.cuda import api as cuda_api  # noqa: E402
from vram.run.runtime import simulated_cuda  # noqa: E402

_REAL_CUDA = {name: getattr(torch.cuda, name) for name in dir(torch.cuda)}


def _keyword_names(fn: Any) -> tuple[set[str], bool]:
    params = inspect.signature(fn).parameters.values()
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names, any(p.kind == p.VAR_KEYWORD for p in params)


def _replaced_functions() -> dict[str, Any]:
    table = dict(cuda_api._replacements([None]))  # type: ignore[list-item]
    table.update({name: getattr(_memory, name) for name in cuda_api._MEMORY_NAMES})
    return {name: fn for name, fn in table.items() if not isinstance(fn, type) and name in _REAL_CUDA}


@pytest.mark.parametrize("name", sorted(_replaced_functions()))
def test_replacements_accept_torch_cudas_keyword_arguments(name: str) -> None:
    try:
        theirs, _ = _keyword_names(_REAL_CUDA[name])
    except (TypeError, ValueError):  # a builtin without a signature: positional use only
        pytest.skip("no Python signature")
    ours, any_keyword = _keyword_names(_replaced_functions()[name])
    assert any_keyword or theirs <= ours, f"torch.cuda.{name} takes {sorted(theirs - ours)} by keyword"


def test_stream_by_keyword_makes_it_current() -> None:
    with simulated_cuda():
        s = torch.cuda.Stream()
        with torch.cuda.stream(stream=s):  # timm.data.loader.PrefetchLoader
            assert torch.cuda.current_stream() == s
        assert torch.cuda.current_stream() == torch.cuda.default_stream()


def test_pin_memory_in_another_thread_keeps_the_host_tensor() -> None:
    """DataLoader's pin-memory thread has no torch-function mode; a CPU build cannot pin."""
    out: list[Any] = []
    with simulated_cuda():
        batch = torch.arange(6)
        worker = threading.Thread(target=lambda: out.append(batch.pin_memory()))
        worker.start()
        worker.join()
        x = out[0].to("cuda", non_blocking=True)
        assert x.is_cuda and torch.cuda.memory_allocated() == 512  # 48 bytes in one block
    assert len(out) == 1 and out[0] is batch


def test_dataloader_with_pinning_workers_runs() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(8.0).reshape(4, 2))
    with simulated_cuda():
        loader = torch.utils.data.DataLoader(data, batch_size=2, num_workers=1, pin_memory=True)
        shapes = [tuple(x.cuda().shape) for (x,) in loader]
    assert shapes == [(2, 2), (2, 2)]


def test_profiler_with_cuda_activity_profiles_the_cpu_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    from torch.autograd.profiler import ProfilerState
    from torch.profiler import ProfilerActivity, profile

    with simulated_cuda():
        for _ in range(2):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                x = torch.ones(64, 64, device="cuda")
                (x @ x).sum()
            assert prof.profiler is not None and prof.profiler.profiler_kind == ProfilerState.KINETO
            assert "aten::mm" in prof.key_averages().table(sort_by="cuda_time_total")
    err = capsys.readouterr().err
    assert err.count("profiler records CPU activity only") == 1
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # restored outside the run
        torch.ones(2).sum()


@pytest.mark.parametrize("make", [lambda: torch.nn.LSTM(8, 16), lambda: torch.nn.GRU(8, 16),
                                  lambda: torch.nn.RNN(8, 16), lambda: torch.nn.LSTMCell(8, 16)])
def test_recurrent_layers_on_the_gpu_stop_with_a_clear_message(make: Any) -> None:
    """pytorch/examples word_language_model: cuDNN's RNN memory is not modelled, so vram stops
    rather than print the CPU decomposition's figures; on the host the layer still runs."""
    with simulated_cuda():
        cpu_out = make()(torch.zeros(3, 8))  # a CPU model: real, as without vram
        assert not cpu_out[0].is_cuda
        rnn = make().cuda()
        with pytest.raises(NotImplementedError, match=r"^vram run: torch\.\w+ on the simulated GPU is not modelled"):
            rnn(torch.zeros(3, 8, device="cuda"))


def test_estimate_loads_a_torchvision_factory_in_a_fresh_process() -> None:
    """``vram estimate torchvision.models:resnet18``: PyPI's CUDA-built torchvision imports, as under run."""
    import subprocess
    import sys
    from importlib.util import find_spec

    if find_spec("torchvision") is None:
        pytest.skip("torchvision not installed")
    code = ("from vram.estimate.model import load_factory; "
            "print(sum(p.numel() for p in load_factory('torchvision.models:resnet18')().parameters()))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["11689512"]  # torchvision's documented resnet18 size (11.7M, IMAGENET1K_V1)


def test_a_placeholder_read_keeps_the_calls_dtype() -> None:
    """torchvision's ``save_image`` (pytorch/examples dcgan): ``grid....to("cpu", torch.uint8)`` of
    values the simulation does not know gave float zeros, which PIL refused."""
    with simulated_cuda():
        grid = torch.randn(3, 4, 5, device="cuda")
        host = grid.mul(255).add_(0.5).clamp_(0, 255).permute(1, 2, 0).to("cpu", torch.uint8)
        assert host.dtype == torch.uint8 and host.shape == (4, 5, 3) and not host.is_cuda
        assert grid.to("cpu", dtype=torch.float16).dtype == torch.float16


@pytest.mark.parametrize("backend", ["privateuse1", "meta"])
def test_a_move_to_meta_gives_meta_tensors(backend: str) -> None:
    """accelerate's ``init_empty_weights`` (``param.to("meta")``), ``Module.to("meta")`` and
    ``to_empty(device="meta")``: a CPU-built tensor (lazy when large) or a GPU one moved to meta is
    a meta tensor, as on a GPU, and holds no GPU memory; a lazy one gave a CPU tensor that kept the
    lazy-host mode alive for the whole run."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    with simulated_cuda(backend=backend):
        lin = torch.nn.Linear(512, 512)  # 262,144 weights: a lazy host tensor
        w = lin.weight.to("meta")
        assert (w.device.type, w.is_meta, w.is_cpu, lin.weight.device.type) == ("meta", True, False, "cpu")
        lin.to("meta")
        assert all(p.is_meta and p.device.type == "meta" for p in lin.parameters())
        del w
        if backend == "privateuse1":  # no lazy host tensor lives: autograd sees no dispatch mode
            torch.ones(2).add(1)
            assert _get_current_dispatch_mode_stack() == []
        x = torch.empty(1000, 1000, device="cuda")
        before = torch.cuda.memory_allocated()
        for m in (x.to("meta"), x.to(device=torch.device("meta")), torch.empty_like(x, device="meta")):
            assert m.is_meta and m.device.type == "meta" and m.shape == x.shape
        gpu = torch.nn.Linear(1000, 1000, device="cuda")
        blocks = [-(-n // 512) * 512 for n in (1000 * 1000 * 4, 1000 * 4)]  # weight, bias: 512-byte rounding
        assert torch.cuda.memory_allocated() == before + sum(blocks)
        gpu.to_empty(device="meta")
        assert gpu.weight.is_meta and torch.cuda.memory_allocated() == before


def test_an_oom_in_backward_with_a_cpu_dataset_alive_is_catchable(tmp_path: Any) -> None:
    """A large CPU tensor (a dataset of token ids) kept the lazy-host dispatch mode on the stack;
    the backward's graph task took it to the autograd device thread, and an OOM raised there
    aborted the process ("terminate called without an active exception") instead of reaching
    the script, where ``accelerate.find_executable_batch_size`` and Trainer's
    ``auto_find_batch_size`` catch it and retry smaller. A subprocess: an abort must fail here.
    Why it runs out on a 100 MiB card (sm90: 32 MiB cuBLAS workspace per thread): w 4 MiB, the
    saved input 16, relu's saved output 16, the main thread's workspace 32, filler 10 = 78 MiB;
    backward adds relu's 16 MiB gradient, then mm's backward on the autograd thread needs that
    thread's own 32 MiB workspace."""
    import subprocess
    import sys

    script = tmp_path / "s.py"
    script.write_text(
        "import torch\n"
        "data = torch.randint(0, 1000, (1000, 512))\n"
        "w = torch.nn.Parameter(torch.randn(1024, 1024, device='cuda'))\n"
        "y = (torch.randn(4096, 1024, device='cuda') @ w).relu().sum()\n"
        "filler = torch.empty(10 * 2**20 // 4, device='cuda')\n"
        "try:\n    y.backward()\nexcept torch.OutOfMemoryError as e:\n"
        "    print('caught', str(e).startswith('CUDA out of memory'))\n"
        "print('done', data.shape)\n")
    r = subprocess.run([sys.executable, "-m", "vram", "run", "--gpu", "100MiB", "--context", "0", str(script)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[:2] == ["caught True", "done torch.Size([1000, 512])"]


@pytest.mark.parametrize("backend", ["privateuse1", "meta"])
def test_a_cuda_generator_is_made_on_the_simulated_gpu(backend: str) -> None:
    """diffusers' ``train_unconditional.py`` (``torch.Generator(device=pipeline.device).manual_seed(0)``)
    stopped: a CPU build cannot make a CUDA generator. On a GPU its device is the given index, else
    the current device (torch/csrc/Generator.cpp), ``manual_seed`` returns it, random ops take it,
    a copy keeps device and state, and ``isinstance(_, torch.Generator)`` holds for every
    generator; CPU generators are the real ones."""
    import copy

    with simulated_cuda(device_count=2, backend=backend):
        g = torch.Generator(device="cuda")
        assert g.manual_seed(0) is g and g.device == torch.device("cuda", 0)
        x = torch.randn(2, 3, device="cuda", generator=g)
        assert x.device == torch.device("cuda", 0) and x.shape == (2, 3)
        twin = copy.deepcopy(g)
        assert twin.device == g.device
        assert torch.randn(4, device="cuda", generator=twin).tolist() == \
            torch.randn(4, device="cuda", generator=g).tolist()  # the same state, the same draws
        torch.cuda.set_device(1)
        assert torch.Generator("cuda").device == torch.device("cuda", 1)
        assert torch.Generator(device=torch.device("cuda", 0)).device == torch.device("cuda", 0)
        assert torch.Generator(device=x.device).device == torch.device("cuda", 0)
        cpu = torch.Generator()
        assert type(cpu) is torch._C.Generator and cpu.device == torch.device("cpu")
        assert all(isinstance(o, torch.Generator) for o in (g, cpu, torch.default_generator))
    assert torch.Generator is torch._C.Generator  # put back after the run


def test_a_cuda_tensor_sent_to_another_process_stops_with_one_line() -> None:
    """pytorch/examples mnist_hogwild: ``mp.Process(target=train, args=(model,))`` pickles the CUDA
    model for CUDA IPC (torch/multiprocessing/reductions.py ``reduce_tensor``); the child would be
    a GPU process of its own, which a `vram run` child is not. CPU tensors still travel."""
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch

    with simulated_cuda(gpu="24GiB"):
        model = torch.nn.Linear(8, 8).cuda()
        with pytest.raises(RuntimeError, match="^vram run: a CUDA tensor sent to another process") as e:
            ForkingPickler(io.BytesIO()).dump(model.weight)
        assert "\n" not in str(e.value)
        ForkingPickler(io.BytesIO()).dump(torch.zeros(4))  # a host tensor: shared memory as usual
    ForkingPickler(io.BytesIO()).dump(torch.zeros(4))


def test_warnings_name_the_scripts_line(tmp_path: Any) -> None:
    """A warning from inside an intercepted call names the script's line, as on a GPU: a Python
    torch function's ``stacklevel=2`` (F.softmax without dim) and C++'s ``TORCH_WARN``
    (``new_tensor`` of a tensor) — not the simulation's own frame."""
    import subprocess
    import sys

    script = tmp_path / "warns.py"
    script.write_text("import torch, torch.nn.functional as F\n"
                      "x = torch.randn(4, 4, device='cuda')\n"
                      "y = F.softmax(x)\n"
                      "z = x.new_tensor(x)\n")
    err = subprocess.run([sys.executable, "-m", "vram", "run", str(script)], capture_output=True,
                         text=True, timeout=120).stderr
    assert f"{script}:3: UserWarning: Implicit dimension choice for softmax" in err
    assert f"{script}:4: UserWarning: To copy construct from a tensor" in err
    assert "vram/run" not in err


@pytest.mark.parametrize("backend", ["privateuse1", "meta"])
def test_data_parallel_on_one_gpu_runs_the_module_on_a_view_of_the_input(backend: str) -> None:
    """pytorch/examples ``imagenet/main.py`` wraps the model in ``nn.DataParallel`` even on one GPU;
    its forward scatters the input with ``torch._C._scatter``, which a CPU build lacks. comm.cpp's
    ``scatter``: ``tensor.chunk(len(devices))`` and a copy only for a chunk on another device, so on
    one GPU the module gets a view of the input and nothing is allocated for it."""
    with simulated_cuda(backend=backend):
        model = torch.nn.DataParallel(torch.nn.Linear(8, 4)).cuda()
        x = torch.randn(6, 8, device="cuda")
        before = torch.cuda.memory_allocated()
        (chunk,) = comm.scatter(x, [0])
        assert chunk.shape == (6, 8) and chunk.untyped_storage().nbytes() == 6 * 8 * 4
        assert torch.cuda.memory_allocated() == before
        y = model(x)
        assert y.shape == (6, 4) and y.is_cuda
        y.sum().backward()
        assert model.module.weight.grad.shape == (4, 8)


def test_comm_scatter_from_the_host_and_gather_allocate_as_comm_cpp() -> None:
    """A host tensor scattered to GPU 0 is copied there (``.to(cuda:0, non_blocking)``); ``gather``
    allocates its result with ``at::empty`` on the destination and copies each input into a slice."""
    with simulated_cuda():
        host = torch.zeros(10, 100)
        (dev,) = comm.scatter(host, [0])
        assert dev.is_cuda and dev.shape == (10, 100)
        assert torch.cuda.memory_allocated() == 4096  # 4,000 B rounded up to 512 B
        a, b = torch.ones(3, 5, device="cuda"), torch.ones(4, 5, device="cuda")
        before = torch.cuda.memory_allocated()
        out = comm.gather([a, b], dim=0, destination=0)
        assert out.shape == (7, 5) and out.is_cuda
        assert torch.cuda.memory_allocated() - before == 512  # 140 B rounded up
        with pytest.raises(RuntimeError, match="Expected at least one device to scatter to"):
            comm.scatter(host, [])
        with pytest.raises(RuntimeError, match="Input tensor at index 1 has invalid shape"):
            comm.gather([a, torch.ones(4, 6, device="cuda")], dim=0, destination=0)


def test_data_parallel_over_two_gpus_stops_at_the_nccl_broadcast() -> None:
    """Replicating a module over two GPUs broadcasts with NCCL (``nccl::is_available``), whose
    single-process communicators vram does not model: one line, and nothing allocated for it."""
    with simulated_cuda(device_count=2):
        model = torch.nn.DataParallel(torch.nn.Linear(8, 4)).cuda()
        before = [torch.cuda.memory_allocated(d) for d in range(2)]
        with pytest.raises(NotImplementedError, match=r"^vram run: a broadcast between 2 simulated GPUs"):
            comm.broadcast_coalesced(list(model.parameters()), [0, 1])
        assert [torch.cuda.memory_allocated(d) for d in range(2)] == before


@pytest.mark.parametrize("backend", ["privateuse1", "meta"])
def test_deepcopy_of_a_gpu_model_copies_each_storage_once(backend: str) -> None:
    """timm's ``--model-ema`` (``ModelEmaV3``: ``deepcopy(model)`` after ``.cuda()``) crashed the
    process: ``Tensor.__deepcopy__`` clones a storage with ``UntypedStorage(nbytes, device=...)``,
    which the PrivateUse1 engine could not allocate. On a GPU the copy allocates every storage once
    more (``deepcopy``'s memo keeps a tied weight tied) and ``UntypedStorage(n, device="cuda")``
    allocates `n` bytes."""
    import copy

    with simulated_cuda(backend=backend):
        model = torch.nn.Sequential(torch.nn.Embedding(10, 16), torch.nn.Linear(16, 10, bias=False),
                                    torch.nn.BatchNorm1d(10)).cuda()
        model[1].weight = model[0].weight
        once = torch.cuda.memory_allocated()
        assert once == 1024 + 5 * 512  # the 640 B table and the norm's five tensors, rounded up to 512 B
        twin = copy.deepcopy(model)
        assert torch.cuda.memory_allocated() == 2 * once
        assert twin[1].weight is twin[0].weight and twin[0].weight is not model[0].weight
        assert twin[0].weight.is_cuda and isinstance(twin[0].weight, torch.nn.Parameter)
        torch.UntypedStorage(1000, device="cuda")  # dies at once: allocated, then cached
        assert torch.cuda.memory_allocated() == 2 * once and torch.cuda.max_memory_allocated() == 2 * once + 1024


def _collate_into_zeros(batch: list[int]) -> Any:
    """timm's ``fast_collate``: a large ``torch.zeros`` batch written in place from NumPy."""
    import numpy as np

    out = torch.zeros((len(batch), 3, 100, 100), dtype=torch.uint8)  # over the lazy-host limit
    for i, b in enumerate(batch):
        out[i] += torch.from_numpy(np.full((3, 100, 100), b, dtype=np.uint8))
    return out


def test_a_large_host_batch_from_a_dataloader_worker_arrives_with_its_bytes() -> None:
    """timm ``train.py --aug-splits 3`` (workers > 0): a batch collated into a large ``torch.zeros``
    in a worker process is a lazy host tensor there; it crossed to the main process as a bare meta
    tensor and ``.to("cuda")`` failed ("Cannot copy out of meta tensor"). It is the CPU tensor a
    plain run sends: same values, and it moves to the GPU as a batch of its size."""
    expected = [int(_collate_into_zeros(list(range(k, k + 3))).sum()) for k in (0, 3)]  # plain CPU torch
    with simulated_cuda():
        loader = torch.utils.data.DataLoader(list(range(6)), batch_size=3, collate_fn=_collate_into_zeros,
                                             num_workers=1)
        sums = []
        for x in loader:
            assert x.device.type == "cpu" and x.shape == (3, 3, 100, 100)
            sums.append(int(x.sum()))
            before = torch.cuda.memory_allocated()
            y = x.to("cuda", non_blocking=True)
            assert torch.cuda.memory_allocated() - before == 90112  # 90,000 B rounded up to 512
            del y
    assert sums == expected == [90000, 360000]


@pytest.mark.parametrize("backend", ["privateuse1", "meta"])
def test_storage_device_is_the_gpu(backend: str) -> None:
    """On a GPU build ``tensor.untyped_storage().device`` is the tensor's CUDA device and
    ``is_cuda`` holds (``UntypedStorage.is_cuda``: ``self.device.type == "cuda"``, torch/storage.py);
    a host tensor's storage stays on the CPU, small or large."""
    with simulated_cuda(gpu="24GiB", backend=backend):
        t = torch.ones(4, device="cuda")
        s = t.untyped_storage()
        assert (s.device, s.is_cuda) == (torch.device("cuda", 0), True)
        for n in (3, 1 << 20):
            h = torch.zeros(n)
            assert not h.untyped_storage().is_cuda
            assert torch.equal(h.cuda().cpu(), torch.zeros(n))
    assert torch.ones(2).untyped_storage().device == torch.device("cpu")  # restored


@pytest.mark.parametrize("backend", ["privateuse1", "meta"])
def test_factories_asked_for_pinned_memory_make_host_tensors(backend: str) -> None:
    """``torch.empty(n, pin_memory=True)`` / ``randn(..., pin_memory=True)`` allocate page-locked
    *host* memory on a CUDA build (nothing from the caching allocator); a CPU build refuses to
    pin, and under the PrivateUse1 engine asked for PrivateUse1's pinned allocator."""
    with simulated_cuda(gpu="24GiB", backend=backend):
        a = torch.empty(1000, pin_memory=True)
        c = torch.randn(100, 100, pin_memory=True)
        assert a.device.type == c.device.type == "cpu" and a.shape == (1000,)
        assert torch.cuda.memory_allocated() == 0
        on_gpu = c.to("cuda", non_blocking=True)
        assert on_gpu.device == torch.device("cuda", 0)
        assert torch.cuda.memory_allocated() == 40_448   # 40,000 B rounded up to 512
