"""The functional collectives (``torch.distributed._functional_collectives``, ``torch.ops.
_c10d_functional``, DTensor's ``_dtensor.shard_dim_alltoall``) reach the simulated process group
as their CUDA kernels reach ProcessGroupNCCL.

Expected behaviour from PyTorch's sources: ``torch/csrc/distributed/c10d/Functional.cpp`` (outputs
allocated with ``at::empty`` / ``clone`` on the current stream before the collective, default
options so ``asyncOp`` is true, ``register_work`` for each output), ``Work.cpp`` (the registry
holds the Work until ``wait_tensor`` pops it), ``ProcessGroupNCCL.cpp`` (``collective``: an async
op stashes its inputs and outputs until ``WorkNCCL::synchronizeStream`` unstashes them at wait;
``outputs_`` kept by the Work; the communicator is created at the group's first collective).
Sizes: 512-byte rounding, 2 MiB small segments (spec §4).
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
dist = pytest.importorskip("torch.distributed")

from vram.run.runtime import simulated_cuda  # noqa: E402

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def rank0(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {"RANK": 0, "WORLD_SIZE": 2, "LOCAL_RANK": 0, "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": 29500}.items():
        monkeypatch.setenv(k, str(v))
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)


def _free() -> int:
    return int(torch.cuda.mem_get_info()[0])


def test_first_functional_collective_creates_the_communicator(rank0: None) -> None:
    """The group's NCCL communicator is created and connected at its first collective, functional
    or not: the card's free memory drops by the same NCCL figure as for ``dist.all_reduce``."""
    import torch.distributed._functional_collectives as funcol
    drops = []
    for functional in (False, True):
        with simulated_cuda(gpu="H100", device_count=2):
            dist.init_process_group("nccl")
            x = torch.empty(1024, device="cuda")
            before = _free()
            if functional:
                funcol.all_reduce(x, "sum", dist.group.WORLD).wait()
            else:
                dist.all_reduce(x)
            drops.append(before - _free())
            after = _free()
            funcol.all_gather_single(x, 0, dist.group.WORLD).wait()  # connected once: nothing more
            assert _free() == after   # its 8 KiB output fits in x's 2 MiB segment
            dist.destroy_process_group()
    assert drops[0] == drops[1] > 0


def test_outputs_on_the_current_stream_inputs_stashed_until_wait(rank0: None) -> None:
    """``all_gather_into_tensor``: the ``[2 * 1024, 1024]`` output on the current stream (a side
    stream here); the input, deleted by the script, stays stashed until the output is waited."""
    import torch.distributed._functional_collectives as funcol
    with simulated_cuda(gpu="24GiB", device_count=2):
        dist.init_process_group("nccl")
        s = torch.cuda.Stream()
        x = torch.empty(1024, 1024, device="cuda")                 # 4 MiB
        torch.cuda.memory._record_memory_history(max_entries=1000)
        with torch.cuda.stream(s):
            y = funcol.all_gather_single(x, 0, dist.group.WORLD)
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        assert [(e["size"], e["stream"]) for e in trace if e["action"] == "alloc"] == [(8 * MiB, s.cuda_stream)]
        del x
        assert torch.cuda.memory_allocated() == 12 * MiB            # x stashed by the Work
        y = y.wait()
        assert torch.cuda.memory_allocated() == 8 * MiB and y.shape == (2048, 1024)


def test_an_output_never_waited_for_stays_allocated(rank0: None) -> None:
    """The registry holds the Work and the Work its outputs: an ``all_reduce`` result dropped
    without ``wait_tensor`` keeps its clone; one waited for is freed with its last reference."""
    import torch.distributed._functional_collectives as funcol
    with simulated_cuda(gpu="24GiB", device_count=2):
        dist.init_process_group("nccl")
        x = torch.empty(1024, 1024, device="cuda")
        waited = funcol.all_reduce(x, "sum", dist.group.WORLD).wait()
        del waited
        assert torch.cuda.memory_allocated() == 4 * MiB
        dropped = funcol.all_reduce(x, "sum", dist.group.WORLD)
        del dropped
        assert torch.cuda.memory_allocated() == 8 * MiB


def test_shard_to_shard_is_one_all_to_all(rank0: None) -> None:
    """DTensor ``Shard(0) -> Shard(1)`` of a [1024, 1024] float32 (local [512, 1024]):
    ``shard_dim_alltoall`` copies the input as [2, 512, 512] (2 MiB), receives into an
    ``empty_like`` (2 MiB), waits, and returns the receive buffer viewed [1024, 512] (already
    contiguous after ``movedim(0, 0)``); the fake kernel's stacked copies and ``cat`` are not
    made."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    with simulated_cuda(gpu="24GiB", device_count=2):
        mesh = init_device_mesh("cuda", (2,))
        d = DTensor.from_local(torch.empty(512, 1024, device="cuda"), mesh, [Shard(0)], run_check=False)
        base = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=1000)
        r = d.redistribute(mesh, [Shard(1)]).to_local()
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        assert [e["size"] for e in trace if e["action"] == "alloc"] == [2 * MiB, 2 * MiB]
        assert r.shape == (1024, 512) and torch.cuda.memory_allocated() - base == 2 * MiB


def test_bad_reduce_op_is_refused_before_allocating(rank0: None) -> None:
    """``to_reduce_op``: "Unrecognized reduce_op" (Functional.cpp), nothing allocated."""
    with simulated_cuda(gpu="24GiB", device_count=2):
        dist.init_process_group("nccl")
        x = torch.empty(1024, device="cuda")
        before = torch.cuda.memory_allocated()
        with pytest.raises(RuntimeError, match="Unrecognized reduce_op: premul_sum"):
            torch.ops._c10d_functional.reduce_scatter_tensor(x, "premul_sum", 2, "0")
        assert torch.cuda.memory_allocated() == before


PROGRAM = """
import os, sys, torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
x = torch.ones(1 << 20, device="cuda")
if sys.argv[1] == "functional":
    y = funcol.all_gather_single(x, 0, dist.group.WORLD).wait()
else:
    y = torch.empty(2 << 20, device="cuda")
    dist.all_gather_into_tensor(y, x)
dist.destroy_process_group()
"""


def _nccl_line(tmp_path: Path, kind: str) -> str:
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run([sys.executable, "-m", "vram", "run", "--gpu", "H100", "--nproc-per-node", "2",
                        str(script), kind], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"^\s*NCCL (\S+) .*$", r.stdout, re.M)
    assert m is not None, r.stdout
    return m.group(1)


@pytest.mark.slow
def test_launched_program_with_only_functional_collectives_counts_nccl(tmp_path: Path) -> None:
    """Under ``vram run --nproc-per-node 2``, a program whose only collective is functional shows
    the same NCCL memory per rank as one calling ``dist.all_gather_into_tensor``."""
    figures: dict[str, Any] = {kind: _nccl_line(tmp_path, kind) for kind in ("functional", "c10d")}
    assert figures["functional"] == figures["c10d"] != "0"
