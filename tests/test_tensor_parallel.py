"""Tensor parallel through DTensor (``parallelize_module`` with ``ColwiseParallel`` /
``RowwiseParallel``) on simulated GPUs: `tests/distributed_programs/tp_mlp.py` under
``vram run --nproc-per-node 2``, against PyTorch's sources and its ``MemTracker`` run on the CPU
with the fake process group (which counts every storage the ops make, 512-byte rounded)."""
from __future__ import annotations

import re
import sys

import pytest

from test_fsdp import PROGRAMS, _run

pytest.importorskip("torch.distributed.tensor.parallel")

MiB, KiB = 1 << 20, 1 << 10
W = 16 * MiB                  # one 4096x1024 float32 weight
X, H = 32 * KiB, 64 * KiB     # [8, 1024] activations; [8, 4096 / 2] local hidden activations


def test_tensor_parallel_mlp_per_rank() -> None:
    out = _run([sys.executable, "-m", "vram", "run", "--nproc-per-node", "2", str(PROGRAMS / "tp_mlp.py")])
    for rank in (0, 1):
        got = dict(re.findall(rf"^\[rank{rank}\]:([a-z]+) (.*)$", out, re.M))
        assert got["built"] == f"{2 * W} {2 * W}"
        # distribute_tensor (tensor/_api.py): Shard(0) chunks are views; Shard(1) chunks are
        # made contiguous (Shard._split_tensor(contiguous=True)), then scattered into
        # empty_like(chunk): down's full weight + both column chunks + the local output, beside
        # up's local half
        assert got["parallel"] == f"{W} {W // 2 + W + W + W // 2}"
        assert got["local"] == "(2048, 1024) (1024, 2048)"
        # forward: x, relu's output (saved) and y stay; the peak adds down's Partial output and
        # the all-reduce's copy of it (Functional.cpp all_reduce: input.clone())
        assert got["forward"] == f"{W + X + H + X} {W + X + H + X + X}"
        # backward: gradients as large as the local parameters; x and y stay
        assert got["backward"].split()[0] == str(2 * W + 2 * X)
    tracker = dict(re.findall(r"^([a-z]+) (\d+)$", _run([sys.executable, str(PROGRAMS / "tp_mlp.py"), "--tracker"]),
                              re.M))
    assert got["forward"].split()[1] == tracker["forward"]
    assert got["backward"].split()[1] == tracker["backward"]
