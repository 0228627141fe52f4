"""torch.distributed ranks on the PrivateUse1 engine: a rank's own GPU is the engine's
device 0, so its backward takes the GPU's formulas.

The autograd engine has ready queues for PrivateUse1 device 0 only: the Python device guard's
``deviceCount()`` is 1 (torch/csrc/acc/Module.cpp ``PythonDeviceGuard``; engine.cpp
``start_device_threads``). Expected counts come from tests/test_subclass_formulas.py's families
(the in-place formulas of derivatives.yaml / ``InputBuffer::accumulate`` a GPU runs); a rank's
figures must be the single-GPU step's plus DDP's bucket (reducer.cpp: one flat bucket of every
gradient, 512-byte rounded, spec §4).
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
from vram.run.engine import EngineLimit  # noqa: E402
from vram.run.memory.storage_api import raw_device  # noqa: E402
from vram.run.runtime import simulated_cuda  # noqa: E402

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
        assert w.untyped_storage().device == torch.device("cuda", 1)    # what a GPU build says
        assert raw_device(w.untyped_storage()) == torch.device("vramsim", 0)  # the engine's device 0
        (w * 2).sum().backward()
        assert w.grad is not None and w.grad.device == torch.device("cuda", 1)
        assert torch.cuda.memory_allocated(1) == 2 * 256 * 256 * 4 and torch.cuda.memory_allocated(0) == 0
        other = torch.ones(128, device="cuda:0")     # another GPU: forward ops run and are charged there
        assert other.device == torch.device("cuda", 0) and torch.cuda.memory_allocated(0) == 512
        x = torch.randn(128, device="cuda:0", requires_grad=True)
        with pytest.raises(EngineLimit, match="other than cuda:1.*--backend meta"):
            (x * 2).sum().backward()


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


def test_ddp_with_a_pinned_used_map_is_refused_or_rerun_on_meta(tmp_path: Path) -> None:
    """``find_unused_parameters=True``: refused in one line when the engine was asked for, rerun
    on the meta engine when it was the default."""
    script = tmp_path / "unused.py"
    script.write_text(PROGRAM.read_text().replace("device_ids=[local])", "device_ids=[local], "
                                                  "find_unused_parameters=True)"))
    asked = _vram("--backend", "privateuse1", "--nproc-per-node", "2", "--ranks", "0", str(script))
    assert asked.returncode == 1
    refusal = [ln for ln in asked.stderr.splitlines() if "find_unused_parameters=True copies" in ln]
    assert len(refusal) == 1 and "Traceback" not in asked.stderr
    default = _vram("--nproc-per-node", "2", "--ranks", "0", str(script))
    assert default.returncode == 0, default.stdout + default.stderr
    assert "running the script again on the meta engine" in default.stderr
    assert _printed(default.stdout, 0)["full"] > sum(FAMILIES[f][3] for f in FAMILIES)   # meta's formulas


def test_ddp_static_graph_is_refused_in_process(rank1: Any) -> None:
    import torch.distributed as dist

    with simulated_cuda(gpu="24GiB", device_count=2):
        dist.init_process_group("nccl")
        m = torch.nn.Linear(8, 8).cuda()
        with pytest.raises(EngineLimit, match="static_graph copies its used-parameter map"):
            torch.nn.parallel.DistributedDataParallel(m, device_ids=[1], static_graph=True)


@pytest.mark.parametrize("backend", ["privateuse1", "meta"])
def test_a_device_index_is_a_cuda_device(rank1: Any, backend: str) -> None:
    """On a GPU build an integer device is CUDA's: ``ToyModel().to(rank)`` (pytorch/examples
    distributed/ddp/example.py), ``torch.ones(n, device=rank)``, ``t.to(rank)``. ``Module.to``
    parses it in C++ as the current accelerator's index, which is not a CUDA index here (the
    PrivateUse1 engine numbers the rank's own GPU 0; a CPU build without it has no accelerator)."""
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
