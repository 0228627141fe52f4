"""What pytorch/examples' distributed scripts (``distributed/FSDP2/example.py``,
``distributed/tensor_parallelism/*.py``; docs/corpus.md, "distributed") needed, each reduced to
the rule from PyTorch it exercises. In-process, rank 1 of 2 (``LOCAL_RANK=1``)."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from vram.run.runtime import simulated_cuda  # noqa: E402


@pytest.fixture
def rank1(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for k, v in {"RANK": 1, "WORLD_SIZE": 2, "LOCAL_RANK": 1, "LOCAL_WORLD_SIZE": 2,
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500}.items():
        monkeypatch.setenv(k, str(v))
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    yield


def test_device_mesh_selects_local_rank_while_cuda_is_not_initialised(rank1: None) -> None:
    """``DeviceMesh._setup_world_group_and_device`` calls ``set_device(LOCAL_RANK)`` only while
    ``torch.cuda.is_initialized()`` is False; ``torch.accelerator.is_available()`` /
    ``device_count()`` and ``init_process_group`` do not initialise CUDA, ``set_device`` and a
    CUDA tensor do (``THCPModule_setDevice_wrap``, ``device_lazy_init``). FSDP2/TP examples
    never call ``set_device``: their ``.to("cuda")`` lands on ``cuda:LOCAL_RANK``."""
    from torch.distributed.device_mesh import init_device_mesh
    with simulated_cuda(gpu="24GiB", device_count=2):
        assert torch.accelerator.is_available() and torch.accelerator.device_count() == 2
        assert not torch.cuda.is_initialized()
        dist.init_process_group("nccl")
        assert not torch.cuda.is_initialized()
        init_device_mesh("cuda", (2,))
        assert torch.cuda.is_initialized()
        assert torch.cuda.current_device() == 1
        assert torch.ones(4).to("cuda").device == torch.device("cuda", 1)
    with simulated_cuda(gpu="24GiB", device_count=2):
        torch.empty(4, device="cuda:0")     # a CUDA tensor initialises CUDA: the mesh keeps cuda:0
        assert torch.cuda.is_initialized()
        dist.init_process_group("nccl")
        init_device_mesh("cuda", (2,))
        assert torch.cuda.current_device() == 0


def test_nccl_default_timeout_is_a_cuda_builds(rank1: None) -> None:
    """``_get_default_timeout("nccl")``: ``_DEFAULT_PG_NCCL_TIMEOUT`` of a CUDA build
    (``kProcessGroupNCCLDefaultTimeout``, ProcessGroupNCCL.hpp: 10 minutes), without the CPU
    build's "NCCL support is not compiled" warning."""
    import warnings
    from datetime import timedelta

    import torch.distributed.distributed_c10d as c10d
    with simulated_cuda(gpu="24GiB", device_count=2), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert c10d._get_default_timeout("nccl") == timedelta(minutes=10)


def test_in_place_init_of_fsdp2_parameters_outside_the_function_mode(rank1: None) -> None:
    """``Linear.reset_parameters`` -> ``nn.init.kaiming_uniform_`` (a Python torch function: its
    body runs with the function mode off) -> ``uniform_`` on a DTensor, whose sharding propagation
    makes fake tensors on the mesh's device. It runs in place on the local shard: nothing is
    allocated (the GPU's ``uniform_`` writes its output)."""
    from torch.distributed.fsdp import fully_shard
    with simulated_cuda(gpu="24GiB", device_count=2):
        torch.cuda.set_device(1)
        dist.init_process_group("nccl")
        with torch.device("meta"):
            m = torch.nn.Linear(16, 64, bias=False)
        fully_shard(m)
        m.to_empty(device="cuda")
        before = torch.cuda.memory_allocated()
        m.reset_parameters()
        assert torch.cuda.memory_allocated() == before == 2048    # a 32 x 16 float32 shard, 512-rounded
        assert m.weight.to_local().shape == (32, 16)


def test_functional_collectives_values_and_no_unwaited_works(rank1: None) -> None:
    """The functional collectives' values follow the process group's rule (as if every rank held
    this rank's: all-reduce SUM = world x value, all-gather = world copies, reduce-scatter = this
    rank's chunk x world), as ``dist.all_reduce`` does; each Work registered by ``Functional.cpp``
    is unregistered by ``wait_tensor`` (a GPU run ends with an empty work registry)."""
    import torch.distributed._functional_collectives as funcol
    with simulated_cuda(gpu="24GiB", device_count=2):
        torch.cuda.set_device(1)
        dist.init_process_group("nccl")
        g = dist.group.WORLD
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        assert funcol.all_reduce(torch.ones(4, device="cuda"), "sum", g).tolist() == t.tolist() == [2.0] * 4
        assert funcol.all_gather_single(torch.arange(3.0, device="cuda"), 0, g).tolist() == [0, 1, 2, 0, 1, 2]
        assert funcol.reduce_scatter_tensor(torch.arange(4.0, device="cuda"), "sum", 0, g).tolist() == [4.0, 6.0]
        assert torch._C._distributed_c10d._get_work_registry_size() == 0


def test_sdpa_on_dtensors_runs_the_gpu_kernel_on_the_local_shards(rank1: None) -> None:
    """``ColwiseParallel(use_local_output=False)`` hands DTensors to SDPA (pytorch/examples'
    ``fsdp_tp_example.py``). On a GPU the wrapper's device is cuda, so attention.cpp's CUDA
    ``_fused_sdp_choice_stub`` picks the fused kernel and DTensor runs it on each local shard:
    the same allocations as SDPA on the local tensors themselves (the math path would build a
    plain causal mask and fail on the DTensor: "got mixed torch.Tensor and DTensor")."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    F = torch.nn.functional
    with simulated_cuda(gpu="H100", device_count=2):
        torch.cuda.set_device(1)
        mesh = init_device_mesh("cuda", (2,))
        qkv = [torch.empty(2, 4, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3)]

        def grown(run: Callable[[], torch.Tensor]) -> tuple[int, int]:
            """(peak, kept) above the start, the output still alive."""
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = run()
            kept = torch.cuda.memory_allocated() - base
            del out
            return torch.cuda.max_memory_allocated() - base, kept
        plain = grown(lambda: F.scaled_dot_product_attention(*qkv, is_causal=True))
        ds = [DTensor.from_local(t, mesh, [Shard(1)], run_check=False) for t in qkv]
        sharded = grown(lambda: F.scaled_dot_product_attention(*ds, is_causal=True).to_local())
        assert sharded == plain and plain[0] > 0
