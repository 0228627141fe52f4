"""Tensor and sequence parallel through DTensor on simulated GPUs.

The collectives: DTensor redistributes through the functional collectives
(``torch/distributed/tensor/_redistribute.py`` -> ``_collective_utils.py`` ->
``torch/distributed/_functional_collectives.py``), whose kernels (``torch/csrc/distributed/c10d/
Functional.cpp``) allocate their output on the *current* stream before handing it to the process
group: ``all_reduce`` clones its input and reduces the clone in place, ``all_gather_into_tensor``
allocates ``[world * n, ...]`` (gathering along dim 0; another dim is gathered on dim 0 and then
``torch.cat`` of the chunks, ``_functional_collectives.all_gather_tensor``),
``reduce_scatter_tensor`` allocates ``[n / world, ...]``.

The training step: `tests/distributed_programs/tp_transformer.py` (torchtitan's TP + SP plan on a
small Llama-style model) under ``vram run --nproc-per-node 2``, against PyTorch's
``MemTracker`` on the CPU with the fake process group (rank 0 of 2). The two count the same
tensors but for AdamW's ``step`` counters, kept on the host on a GPU unless ``capturable`` or
``fused`` (``torch/optim/adam.py``, ``_init_group``) and counted by the CPU tracker: 26
parameters, 512 bytes each once rounded as on CUDA. Without checkpointing the peak is in the
backward, before any counter exists: equal. With ``checkpoint_wrapper`` around each block the
activations shrink and the peak moves into the optimizer step, after the counters are made.
A 2-D mesh (``("dp", "tp")``, FSDP2's ``fully_shard`` over ``dp`` on top of the TP plan) is
compared with ``FSDPMemTracker`` the same way; every rank runs the same program, so two ranks
that differ in both mesh coordinates are simulated. Local shard shapes follow
``torch/distributed/tensor/parallel/style.py``: ``ColwiseParallel`` shards a Linear weight
``Shard(0)``, ``RowwiseParallel`` ``Shard(1)`` (an Embedding's ``Shard(0)``), ``SequenceParallel``
replicates the norm's parameters; ``fully_shard`` adds ``Shard(0)`` over ``dp``.
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
PROGRAMS = ROOT / "tests" / "distributed_programs"
ENV = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
for _var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
    ENV.pop(_var, None)
ADAM_STEPS = 26 * 512


@pytest.fixture
def two_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {"RANK": 0, "WORLD_SIZE": 2, "LOCAL_RANK": 0, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500}.items():
        monkeypatch.setenv(k, str(v))
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)


def _allocs(run: Any) -> list[tuple[int, int]]:
    """(size, stream) of every allocation `run()` makes."""
    torch.cuda.memory._record_memory_history(max_entries=100000)
    before = len(torch.cuda.memory._snapshot()["device_traces"][0])
    run()
    trace = torch.cuda.memory._snapshot()["device_traces"][0][before:]
    torch.cuda.memory._record_memory_history(enabled=None)
    return [(e["size"], e["stream"]) for e in trace if e["action"] == "alloc"]


@pytest.mark.parametrize("src, dst, allocated", [
    ("S0", "R", [4 * MiB]),               # all_gather_into_tensor: [2 * 512, 1024]
    ("S1", "R", [4 * MiB, 4 * MiB]),      # gathered on dim 0, then cat of the chunks on dim 1
    ("P", "R", [4 * MiB]),                # all_reduce: input.clone(), reduced in place
    ("P", "S0", [2 * MiB]),               # reduce_scatter_tensor: [1024 / 2, 1024]
])
def test_redistribute_allocates_the_functional_collectives_outputs(two_ranks: None, src: str, dst: str,
                                                                   allocated: list[int]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    place = {"S0": Shard(0), "S1": Shard(1), "P": Partial(), "R": Replicate()}
    with simulated_cuda(gpu="24GiB", device_count=2):
        mesh = init_device_mesh("cuda", (2,))
        shape = {"S0": (512, 1024), "S1": (1024, 512)}.get(src, (1024, 1024))
        d = DTensor.from_local(torch.empty(shape, device="cuda"), mesh, [place[src]], run_check=False)
        base = torch.cuda.memory_allocated()
        out: list[Any] = []

        def redistribute() -> None:
            local = d.redistribute(mesh, [place[dst]]).to_local()
            out.append(local.wait() if hasattr(local, "wait") else local)   # an AsyncCollectiveTensor
        allocs = _allocs(redistribute)
        n = len(allocated)
        assert allocs[:n] == [(size, 0) for size in allocated]       # on the current (default) stream
        assert out[0].shape == ((1024, 1024) if dst == "R" else (512, 1024))
        assert torch.cuda.memory_allocated() - base == out[0].untyped_storage().nbytes()


def _run(cmd: list[str]) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600, cwd=str(ROOT))
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def _figures(out: str) -> dict[str, dict[int, int]]:
    """``{"peak": {rank: n}, "end": {rank: n}}`` from the lines a run printed (rank 0 if unprefixed)."""
    got: dict[str, dict[int, int]] = {"peak": {}, "end": {}}
    for rank, name, value in re.findall(r"^(?:\[rank(\d+)\]:)?(peak|end) (\d+)$", out, re.M):
        got[name][int(rank or 0)] = int(value)
    return got


@pytest.mark.parametrize("args, nproc, ranks", [
    pytest.param((), 2, [0, 1], marks=pytest.mark.slow),
    pytest.param(("--checkpoint",), 2, [0, 1], marks=pytest.mark.slow),
    # mesh (dp=2, tp=2): ranks 0 and 3 differ in both coordinates
    pytest.param(("--fsdp", "2"), 4, [0, 3], marks=pytest.mark.slow),
], ids=["tp-sp", "tp-sp-checkpoint", "fsdp2-x-tp"])
def test_tp_sp_transformer_step_matches_mem_tracker(args: tuple[str, ...], nproc: int, ranks: list[int]) -> None:
    tracker = _figures(_run([sys.executable, str(PROGRAMS / "tp_transformer.py"), "--tracker", *args]))
    out = _run([sys.executable, "-m", "vram", "run", "--nproc-per-node", str(nproc), "--ranks",
                ",".join(map(str, ranks)), str(PROGRAMS / "tp_transformer.py"), *args])
    vram = _figures(out)
    steps = ADAM_STEPS if "--checkpoint" in args else 0   # the peak: in the step (checkpointed) or the backward
    assert vram["peak"] == {r: tracker["peak"][0] - steps for r in ranks}
    assert vram["end"] == {r: tracker["end"][0] - ADAM_STEPS for r in ranks}
    shapes = dict(re.findall(rf"^\[rank{ranks[0]}\]:local (\S+) (\(.*\))$", out, re.M))
    tp = {"tok_embeddings.weight": (512, 256), "layers.0.attention.wq.weight": (128, 256),
          "layers.0.feed_forward.w2.weight": (256, 512), "output.weight": (512, 256), "norm.weight": (256,)}
    dp = 2 if "--fsdp" in args else 1                    # fully_shard: Shard(0) over dp, on the TP shard
    assert shapes == {k: str((v[0] // dp, *v[1:])) for k, v in tp.items()}
