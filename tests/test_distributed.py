"""Many simulated GPUs: ``torch.distributed`` with the ``nccl`` backend under
`vram.run.runtime.simulated_cuda`, DDP's gradient buckets, and the ``--nproc-per-node`` launcher.

Expected figures come from PyTorch's sources, as cited: ``ProcessGroupNCCL.cpp`` (``collective``:
asyncOp runs stash inputs/outputs until ``wait``, ``workEnqueue`` unstashes shelves the watchdog
saw complete; ``allgather``/``reduce_scatter`` flatten equal-size lists with ``newLikeFlat``;
``barrier`` all-reduces ``zeros({1}, kFloat)`` on ``guessDeviceId()``), ``reducer.cpp``
(``compute_bucket_assignment_by_size``, ``rebuild_buckets``: limits ``{first_bucket_bytes_cap,
bucket_bytes_cap}`` in gradient-ready order) and ``nn/parallel/distributed.py``
(``_BucketCapacityConfig``: 25 MiB, first bucket ``dist._DEFAULT_FIRST_BUCKET_BYTES`` = 1 MiB
only when ``bucket_cap_mb`` is not given; one bucket for everything before the first rebuild).
Allocator figures (512-byte rounding, 2 MiB small segments) from the spec §4/§6.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
nn = torch.nn

from vram.run.distributed.launcher import Launch, parse_ranks, torchrun_env  # noqa: E402
from vram.run.runtime import DataDependentError, simulated_cuda  # noqa: E402

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def rank_env(monkeypatch: pytest.MonkeyPatch) -> Any:
    def setup(rank: int, world: int, local: int | None = None) -> None:
        for k, v in {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank if local is None else local,
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500}.items():
            monkeypatch.setenv(k, str(v))
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "TORCH_DIST_INIT_BARRIER"):
        monkeypatch.delenv(var, raising=False)
    return setup


def test_init_process_group_nccl_on_simulated_gpus(rank_env: Any) -> None:
    rank_env(1, 4)
    assert not dist.is_nccl_available()           # the CPU build
    with simulated_cuda(gpu="24GiB", device_count=4):
        torch.cuda.set_device(1)
        dist.init_process_group("nccl")
        assert dist.is_nccl_available() and dist.get_backend() == "nccl"
        assert (dist.get_rank(), dist.get_world_size()) == (1, 4)
        x = torch.ones(4, device="cuda")
        dist.all_reduce(x)
        assert x.shape == (4,) and x.device == torch.device("cuda", 1)
    assert not dist.is_initialized() and not dist.is_nccl_available()   # all restored


def test_nccl_version_is_a_cuda_builds() -> None:
    """``torch.cuda.nccl.version()`` decodes ``NCCL_MAJOR << 32 | NCCL_MINOR << 16 | NCCL_PATCH``
    (torch/csrc/cuda/nccl.cpp ``version``; torch/cuda/nccl.py): under a simulated run it is the
    release vram's NCCL figures follow (NVIDIA/nccl 2.30.7), so bf16 checks such as torchtune's
    ``verify_bf16_support`` (``torch.cuda.nccl.version() >= (2, 10)``) pass, as on a CUDA build."""
    with pytest.raises(AttributeError):
        torch.cuda.nccl.version()                  # a CPU build has no _nccl_version
    with simulated_cuda(gpu="24GiB"):
        assert torch.cuda.nccl.version() == (2, 30, 7)
        assert dist.is_nccl_available() and torch.cuda.nccl.version() >= (2, 10)
    with pytest.raises(AttributeError):
        torch.cuda.nccl.version()                  # restored


def test_env_rendezvous_keeps_pytorchs_checks(rank_env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    rank_env(0, 2)
    monkeypatch.delenv("MASTER_ADDR")
    with simulated_cuda(device_count=2):
        with pytest.raises(ValueError, match="environment variable MASTER_ADDR expected, but not set"):
            dist.init_process_group("nccl")
        assert not dist.is_initialized()


def test_allgather_list_flattens_and_async_work_keeps_it(rank_env: Any) -> None:
    """``allgather`` of equal sizes receives into ``newLikeFlat`` ([world, *shape]), which the
    async Work stashes until ``wait()`` and keeps (``outputs_``) while it lives."""
    rank_env(0, 4)
    with simulated_cuda(gpu="24GiB"):
        dist.init_process_group("nccl")
        x = torch.empty(1024, 1024, device="cuda")                       # 4 MiB
        outs = [torch.empty(1024, 1024, device="cuda") for _ in range(4)]
        base = torch.cuda.memory_allocated()
        assert base == 20 * MiB
        w = dist.all_gather(outs, x, async_op=True)
        assert torch.cuda.memory_allocated() == base + 16 * MiB           # the flat [4, 1024, 1024]
        w.wait()
        assert torch.cuda.memory_allocated() == base + 16 * MiB           # outputs_ holds it
        del w
        assert torch.cuda.memory_allocated() == base
        torch.cuda.reset_peak_memory_stats()
        dist.all_gather(outs, x)                                          # sync: freed at return
        assert torch.cuda.memory_allocated() == base
        assert torch.cuda.max_memory_allocated() == base + 16 * MiB


def test_unwaited_async_work_is_unstashed_at_the_next_collective(rank_env: Any) -> None:
    rank_env(0, 2)
    with simulated_cuda(gpu="24GiB"):
        dist.init_process_group("nccl")
        t = torch.empty(256, 1024, device="cuda")                         # 1 MiB
        w = dist.all_reduce(t, async_op=True)
        del t, w                                   # never waited: the stash still holds t
        assert torch.cuda.memory_allocated() == MiB
        dist.all_reduce(torch.empty(128, device="cuda"))                  # its workEnqueue unstashes
        assert torch.cuda.memory_allocated() == 0
        t = torch.empty(256, 1024, device="cuda")
        dist.all_reduce(t)                                                # sync: nothing stashed
        del t
        assert torch.cuda.memory_allocated() == 0


def test_barrier_allreduces_a_float_on_the_guessed_device(rank_env: Any) -> None:
    rank_env(3, 4)
    with simulated_cuda(gpu="24GiB", device_count=2):
        dist.init_process_group("nccl")
        dist.barrier()                           # no collective yet: global rank % device count
        assert torch.cuda.max_memory_allocated(1) == 512 and torch.cuda.memory_allocated(1) == 0
        assert torch.cuda.memory_reserved(1) == 2 * MiB and torch.cuda.max_memory_allocated(0) == 0


def test_collective_values_assume_every_rank_holds_the_same(rank_env: Any) -> None:
    rank_env(1, 4)
    with simulated_cuda() as _:
        dist.init_process_group("nccl")
        n = torch.tensor([3, 5], device="cuda")
        dist.all_reduce(n)                                   # SUM over 4 equal contributions
        assert n.tolist() == [12, 20]
        m = torch.tensor([7.0], device="cuda")
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        assert m.item() == 7.0
        outs = [torch.zeros(2, device="cuda", dtype=torch.long) for _ in range(4)]
        dist.all_gather(outs, torch.tensor([1, 2], device="cuda"))
        assert [o.tolist() for o in outs] == [[1, 2]] * 4
        from vram.run.runtime import active_sim
        sim = active_sim()
        assert sim is not None and sim.report.sites             # reads of assumed values are listed


def test_strict_values_leave_collective_outputs_unknown(rank_env: Any) -> None:
    rank_env(1, 2)
    with simulated_cuda(strict_values=True):
        dist.init_process_group("nccl")
        n = torch.tensor([3], device="cuda")
        dist.broadcast(n, src=1)                              # this rank is the root: exact
        assert n.item() == 3
        dist.all_reduce(n)
        with pytest.raises(DataDependentError):
            n.item()


def _bucket_allocs(d: Any) -> list[int]:
    """Sizes of the allocations of at least 1 MiB made by ``reducer._rebuild_buckets()``."""
    torch.cuda.memory._record_memory_history(max_entries=100000)
    before = len(torch.cuda.memory._snapshot()["device_traces"][0])
    assert d.reducer._rebuild_buckets()
    trace = torch.cuda.memory._snapshot()["device_traces"][0][before:]
    torch.cuda.memory._record_memory_history(enabled=None)
    return [e["size"] for e in trace if e["action"] == "alloc" and e["size"] >= MiB]


@pytest.mark.parametrize("cap, expected", [
    (None, [4 * MiB, 8 * MiB]),   # default: 1 MiB first bucket closes after the first 4 MiB grad
    (5, [8 * MiB, 4 * MiB]),      # bucket_cap_mb given: every bucket, the first too, is 5 MiB
])
def test_ddp_buckets_follow_the_reducers_rules(rank_env: Any, cap: int | None, expected: list[int]) -> None:
    rank_env(0, 2)
    with simulated_cuda(gpu="24GiB", device_count=2):
        dist.init_process_group("nccl")
        m = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(3)]).cuda()   # 3 x 4 MiB
        before = torch.cuda.memory_allocated()
        d = nn.parallel.DistributedDataParallel(m, device_ids=[0], bucket_cap_mb=cap)
        assert torch.cuda.memory_allocated() - before == 12 * MiB   # one bucket for all, at first
        d(torch.randn(8, 1024, device="cuda")).sum().backward()
        m.zero_grad(set_to_none=True)
        # rebuilt in gradient-ready order (the last layer's weight first)
        assert _bucket_allocs(d) == expected


@pytest.mark.parametrize("as_view", [False, True])
def test_ddp_gradient_as_bucket_view_saves_the_gradients(rank_env: Any, as_view: bool) -> None:
    rank_env(0, 2)
    with simulated_cuda(gpu="24GiB", device_count=2):
        dist.init_process_group("nccl")
        m = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(3)]).cuda()
        d = nn.parallel.DistributedDataParallel(m, device_ids=[0], gradient_as_bucket_view=as_view,
                                                static_graph=as_view)
        x = torch.randn(8, 1024, device="cuda")
        for _ in range(2):
            d(x).sum().backward()
        grads = sum(p.grad.untyped_storage().nbytes() for p in m.parameters()
                    if p.grad.untyped_storage().nbytes() == p.numel() * 4)   # own storage, not a bucket view
        assert grads == (0 if as_view else 12 * MiB)
        assert all(p.grad.shape == p.shape for p in m.parameters())


def test_parse_ranks_and_torchrun_env() -> None:
    assert parse_ranks("all", 4) == [0, 1, 2, 3] and parse_ranks("0,2-3", 4) == [0, 2, 3]
    with pytest.raises(ValueError, match="outside 0-3"):
        parse_ranks("4", 4)
    with pytest.raises(ValueError, match="not a rank"):
        parse_ranks("x", 4)
    env = torchrun_env(Launch(4, 2), 5, base={})
    assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == \
        ("5", "1", "1", "8", "4")
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == "29500" and env["OMP_NUM_THREADS"] == "1"


SCRIPT = """
import os, torch, torch.distributed as dist
local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
dist.init_process_group("nccl")
x = torch.empty((dist.get_rank() + 1) * 1024 * 1024, device="cuda")   # rank r: (r + 1) * 4 MiB
dist.all_reduce(x)
print("rank", dist.get_rank(), "device", x.device, "world", dist.get_world_size())
torch.cuda.memory._dump_snapshot(os.path.join(os.path.dirname(__file__), "snap.pickle"))
if dist.get_rank() == 1:
    torch.empty(10**12, device="cuda")                                   # rank 1 runs out of memory
"""


def test_launcher_runs_each_rank_and_summarises(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run([sys.executable, "-m", "vram", "run", "--gpu", "24GiB", "--nproc-per-node", "2",
                        str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr                    # rank 1's OOM fails the run
    assert "[rank0]:rank 0 device cuda:0 world 2" in r.stdout
    assert "[rank1]:rank 1 device cuda:1 world 2" in r.stdout
    assert "[rank1]:torch.OutOfMemoryError: CUDA out of memory" in r.stderr
    rows = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln.strip()[:1].isdigit()}
    assert "4,194,304" in rows["0"] and rows["0"].rstrip().endswith("ok")
    assert "8,388,608" in rows["1"] and rows["1"].split()[-3:] == ["1", "exit", "1"]
    assert (tmp_path / "snap.rank0.pickle").exists() and (tmp_path / "snap.rank1.pickle").exists()
    assert not (tmp_path / "snap.pickle").exists()


@pytest.mark.slow
def test_launcher_simulates_only_the_ranks_asked_for(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace('"snap.pickle"', '"one.pickle"').split("if dist.get_rank() == 1")[0])
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run([sys.executable, "-m", "vram", "run", "--nproc-per-node", "4", "--ranks", "2",
                        str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "simulated: 2; not simulated (--ranks): 0-1,3" in r.stdout
    assert "[rank2]:rank 2 device cuda:2 world 4" in r.stdout and "[rank0]" not in r.stdout
    assert (tmp_path / "one.pickle").exists()                 # one writer: the path as asked
