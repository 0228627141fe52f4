"""torch.distributed ranks and several GPUs in one process on the PrivateUse1 engine: its C++
device guard (`vram.run.engine.native`) counts the simulation's GPUs, so the autograd engine has a
ready queue for each (engine.cpp ``start_device_threads``), and its hooks give DDP pinned host
memory (reducer.cpp ``all_reduce_local_used_map``); every backward takes the GPU's formulas.

Expected counts come from tests/test_subclass_formulas.py's families (the in-place formulas of
derivatives.yaml / ``InputBuffer::accumulate`` a GPU runs); a rank's figures must be the
single-GPU step's plus DDP's bucket (reducer.cpp: one flat bucket of every gradient, 512-byte
rounded, spec §4) and, with ``find_unused_parameters`` or ``static_graph``, the used-parameter
map on the GPU (reducer.cpp ``initialize_local_used_map``: ``at::zeros({n}, kInt)`` on the
parameters' device).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch._C, "_acc"):
    pytest.skip("needs torch's experimental Python PrivateUse1 backend (torch._C._acc)", allow_module_level=True)

from test_subclass_formulas import FAMILIES  # noqa: E402
from vram.run.engine import native  # noqa: E402
from vram.run.memory.storage_api import raw_device  # noqa: E402
from vram.run.runtime import active_sim, simulated_cuda  # noqa: E402

pytestmark = pytest.mark.skipif(not native.load(1), reason=f"needs the engine's C++ device guard: {native.why_not()}")

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "tests" / "distributed_programs" / "ddp_formulas.py"
ENV = {k: v for k, v in os.environ.items() if k not in ("VRAM_RUN_BACKEND", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
ENV.update(PYTHONPATH=str(ROOT / "src"), PYTHONWARNINGS="ignore")
N, M = 48, 40
FULL = N * M * 4


def _vram(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vram", "run", "--gpu", "24GiB", *args], capture_output=True,
                          text=True, env=ENV, timeout=600, cwd=str(ROOT))


def _printed(out: str, rank: int | None) -> dict[str, int]:
    prefix = re.escape(f"[rank{rank}]:") if rank is not None else ""
    return {k: int(v) for k, v in re.findall(rf"^{prefix}(full|peak) (\d+)$", out, re.M)}


@pytest.fixture(scope="module")
def single() -> dict[str, int]:
    r = _vram(str(PROGRAM), "--single")
    assert r.returncode == 0, r.stderr
    return _printed(r.stdout, None)


@pytest.mark.slow
def test_a_ddp_rank_takes_the_gpus_formulas(single: dict[str, int]) -> None:
    """Rank 1 of 2 (its own GPU cuda:1 is engine device 0): the backward allocates what the
    in-place formulas do, as the same step on one GPU, and its peak is that step's plus DDP's
    one bucket."""
    in_place = sum(FAMILIES[f][3] for f in FAMILIES)          # 6 + 1 + 1 + 1
    assert single["full"] == in_place
    r = _vram("--nproc-per-node", "2", "--ranks", "1", str(PROGRAM))
    assert r.returncode == 0, r.stdout + r.stderr
    rank = _printed(r.stdout, 1)
    assert rank == {"full": in_place, "peak": single["peak"] + FULL}   # FULL is a multiple of 512
    assert re.search(r"^\s+1\s+0\s+cuda:1\s+" + f"{single['peak'] + FULL:,}", r.stdout, re.M)


@pytest.mark.slow
def test_the_meta_engine_stays_selectable_and_takes_the_subclass_formulas(single: dict[str, int]) -> None:
    r = _vram("--backend", "meta", "--nproc-per-node", "2", "--ranks", "1", str(PROGRAM))
    assert r.returncode == 0, r.stdout + r.stderr
    assert _printed(r.stdout, 1)["full"] > single["full"]   # out-of-place add/scatter/index_put


@pytest.fixture
def rank1(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {"RANK": 1, "WORLD_SIZE": 2, "LOCAL_RANK": 1, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500}.items():
        monkeypatch.setenv(k, str(v))
    monkeypatch.delenv("VRAM_RUN_BACKEND", raising=False)


def test_a_rank_sees_its_own_gpu_and_is_charged_there(rank1: Any) -> None:
    with simulated_cuda(gpu="24GiB", device_count=2) as _:
        torch.cuda.set_device(1)
        w = torch.randn(256, 256, device="cuda", requires_grad=True)
        assert w.device == torch.device("cuda", 1) and w.get_device() == 1 and torch.cuda.current_device() == 1
        shown, engine = w.untyped_storage().device, raw_device(w.untyped_storage())
        assert shown == torch.device("cuda", 1)          # what a GPU build says
        assert engine == torch.device("vramsim", 1)      # the engine's device 1
        (w * 2).sum().backward()
        assert w.grad is not None and w.grad.device == torch.device("cuda", 1)
        assert torch.cuda.memory_allocated(1) == 2 * 256 * 256 * 4 and torch.cuda.memory_allocated(0) == 0
        other = torch.ones(128, device="cuda:0")     # another GPU: forward ops run and are charged there
        assert other.device == torch.device("cuda", 0) and torch.cuda.memory_allocated(0) == 512
        x = torch.randn(128, device="cuda:0", requires_grad=True)
        (x * 2).sum().backward()                     # and its backward runs on that GPU's autograd queue
        assert x.grad is not None and x.grad.device == torch.device("cuda", 0)
        assert torch.cuda.memory_allocated(0) == 3 * 512   # other, x, x.grad


def test_a_backward_across_the_gpus_of_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--devices 2`` in one process: a model split over two GPUs trains on the PrivateUse1 engine
    (no dispatch mode); each gradient is made on its parameter's GPU (``AccumulateGrad`` steals
    the incoming gradient: accumulate_grad.h), the copy's backward sends the gradient back to
    cuda:0 (``CopyBackwards``: ``grad.to(src device)``), so each GPU holds its own layer, input
    or activation, and gradients, and nothing else."""
    monkeypatch.delenv("VRAM_RUN_BACKEND", raising=False)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    n = 256
    with simulated_cuda(gpu="24GiB", device_count=2):
        assert type(active_sim()).__name__ == "BackendState"
        from torch.utils._python_dispatch import _get_current_dispatch_mode
        assert _get_current_dispatch_mode() is None
        a = torch.empty(n, n, device="cuda:0", requires_grad=True)
        b = torch.empty(n, n, device="cuda:1", requires_grad=True)
        x = torch.empty(n, device="cuda:0")
        (((a * x).to("cuda:1")) * b).sum().backward()
        assert a.grad is not None and a.grad.device == torch.device("cuda", 0)
        assert b.grad is not None and b.grad.device == torch.device("cuda", 1)
        del x
        assert torch.cuda.memory_allocated(0) == 2 * n * n * 4       # a, a.grad
        assert torch.cuda.memory_allocated(1) == 2 * n * n * 4       # b, b.grad
def test_storage_resize_allocates_then_frees_as_cuda(rank1: Any) -> None:
    """FSDP2's free/alloc of unsharded parameters: ``resize_`` to n bytes allocates a new block
    before the old one is freed (``resize_bytes_cuda``); to 0 frees it; views keep their sizes."""
    with simulated_cuda(gpu="24GiB", device_count=2):
        t = torch.empty(1 << 20, device="cuda:1")                    # 4 MiB
        s = t.untyped_storage()
        s.resize_(0)
        assert torch.cuda.memory_allocated(1) == 0 and s.nbytes() == 0 and t.shape == (1 << 20,)
        s.resize_(4 << 20)
        assert torch.cuda.memory_allocated(1) == 4 << 20 and t.data_ptr() == s.data_ptr()
        torch.cuda.reset_peak_memory_stats(1)
        s.resize_(8 << 20)
        assert torch.cuda.memory_allocated(1) == 8 << 20 and torch.cuda.max_memory_allocated(1) == 12 << 20
        del t, s
        assert torch.cuda.memory_allocated(1) == 0


@pytest.mark.slow
def test_ddp_find_unused_parameters_runs_on_the_gpus_formulas_and_prints_once(tmp_path: Path,
                                                                               single: dict[str, int]) -> None:
    """``find_unused_parameters=True`` on the default engine, no rerun: the backward allocates what
    the in-place formulas do, the peak is the plain DDP step's (single step + bucket) plus the
    used-parameter map on the GPU (one int32 per parameter: 512 bytes), and each line the script
    prints appears once."""
    script = tmp_path / "unused.py"
    script.write_text(PROGRAM.read_text().replace("device_ids=[local])", "device_ids=[local], "
                                                  "find_unused_parameters=True)"))
    r = _vram("--nproc-per-node", "2", "--ranks", "0", str(script))
    assert r.returncode == 0, r.stdout + r.stderr
    assert _printed(r.stdout, 0) == {"full": sum(FAMILIES[f][3] for f in FAMILIES), "peak": single["peak"] + FULL + 512}
    assert len(re.findall(r"^\[rank0\]:full ", r.stdout, re.M)) == 1
    assert len(re.findall(r"^\[rank0\]:peak ", r.stdout, re.M)) == 1
    assert "meta engine" not in r.stderr and "Traceback" not in r.stderr


def _ddp_step(**ddp: Any) -> tuple[int, int]:
    """Memory allocated on cuda:1 once DDP is built, and the peak of two steps after it."""
    import torch.distributed as dist

    with simulated_cuda(gpu="24GiB", device_count=2):
        dist.init_process_group("nccl")
        torch.cuda.set_device(1)
        m = torch.nn.Linear(8, 8).cuda()
        model = torch.nn.parallel.DistributedDataParallel(m, device_ids=[1], **ddp)
        built = torch.cuda.memory_allocated(1)
        torch.cuda.reset_peak_memory_stats(1)
        for _ in range(2):
            model(torch.ones(4, 8, device="cuda")).sum().backward()
        assert m.weight.grad is not None and m.weight.grad.device == torch.device("cuda", 1)
        peak = torch.cuda.max_memory_allocated(1)
        dist.destroy_process_group()
    return built, peak


def test_ddp_static_graph_and_find_unused_keep_a_used_map_on_the_gpu(rank1: Any) -> None:
    """reducer.cpp: ``find_unused_parameters`` (the Reducer's constructor) and ``static_graph``
    (``set_static_graph``) call ``initialize_local_used_map``: ``local_used_map_dev_`` =
    ``at::zeros({2}, kInt)`` on the parameters' GPU, one 512-byte block for the Reducer's life;
    its staging copy (``all_reduce_local_used_map``) is pinned host memory, not the GPU's. A
    Linear(8, 8): weight, bias and the one bucket of 72 floats are 512 bytes each."""
    plain = _ddp_step()
    assert plain[0] == 3 * 512
    assert _ddp_step(static_graph=True) == (plain[0] + 512, plain[1] + 512)
    assert _ddp_step(find_unused_parameters=True) == (plain[0] + 512, plain[1] + 512)


def test_ddp_leaves_a_globally_unused_parameters_gradient_alone(rank1: Any) -> None:
    """A parameter no rank used: the Reducer copies the reduced used map back to the host
    (``local_used_map_.copy_(local_used_map_dev_)``) and leaves its gradient unset."""
    import torch.distributed as dist

    with simulated_cuda(gpu="24GiB", device_count=2):
        dist.init_process_group("nccl")
        torch.cuda.set_device(1)
        m = torch.nn.ModuleDict({"used": torch.nn.Linear(8, 8), "unused": torch.nn.Linear(8, 8)}).cuda()

        class Forward(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.m = m

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.m["used"](x)

        model = torch.nn.parallel.DistributedDataParallel(Forward(), device_ids=[1], find_unused_parameters=True)
        for _ in range(2):
            model(torch.ones(4, 8, device="cuda")).sum().backward()
        assert m["used"].weight.grad is not None and m["unused"].weight.grad is None
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["privateuse1", "meta"])
def test_a_device_index_is_a_cuda_device(rank1: Any, backend: str) -> None:
    """On a GPU build an integer device is CUDA's: ``ToyModel().to(rank)`` (pytorch/examples
    distributed/ddp/example.py), ``torch.ones(n, device=rank)``, ``t.to(rank)``. ``Module.to``
    parses it in C++ as the current accelerator's index (PrivateUse1 here; a CPU build without it
    has no accelerator)."""
    with simulated_cuda(gpu="24GiB", device_count=2, backend=backend):
        torch.cuda.set_device(1)
        m = torch.nn.Linear(256, 256).to(1)
        x = torch.ones(8, 256, device=1)
        y = torch.zeros(8, 256).to(1)
        assert m.weight.device == x.device == y.device == torch.device("cuda", 1)
        assert torch.cuda.memory_allocated(0) == 0
        blocks = [256 * 256 * 4, 256 * 4, 8 * 256 * 4, 8 * 256 * 4]   # weight, bias, x, y: multiples of 512
        assert torch.cuda.memory_allocated(1) == sum(blocks)
        (m(x) - y).sum().backward()
        assert m.weight.grad is not None and m.weight.grad.device == torch.device("cuda", 1)
