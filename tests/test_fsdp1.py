"""FSDP1 (``FullyShardedDataParallel`` with FlatParameters) on simulated GPUs, checked
against PyTorch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``; FSDPMemTracker is FSDP2
only).

`tests/distributed_programs/fsdp1_mlp.py` is an ordinary FSDP1 training script: run by
``vram run`` it prints ``max_memory_allocated()`` over a warmed-up baseline, run with
``--tracker`` it is rank 0 of 2 on the CPU with PyTorch's fake process group under MemTracker.
They count the same tensors but for Adam's host ``step`` counters (``torch/optim/adam.py``,
``_init_group``), one per parameter the optimizer holds a non-empty shard of, which the CPU
tracker counts at 512 bytes each (see tests/test_fsdp.py). With FlatParameters that is one per
FSDP unit; with ``use_orig_params`` one per original parameter that rank 0's half of the
FlatParameter touches (``_flat_param.py``, ``_init_shard_metadata``): per 256-1024-256 block,
the first weight and part of its bias.
"""
from __future__ import annotations

import re
import sys

import pytest

from test_fsdp import PROGRAMS, _run

pytest.importorskip("torch.distributed.fsdp")


@pytest.mark.parametrize("args, steps", [
    (("--wrap",), 3),
    pytest.param(("--wrap", "--strategy", "SHARD_GRAD_OP"), 3, marks=pytest.mark.slow),
    pytest.param(("--wrap", "--strategy", "NO_SHARD"), 3, marks=pytest.mark.slow),
    pytest.param(("--wrap", "--bf16"), 3, marks=pytest.mark.slow),
    pytest.param(("--wrap", "--no-limit", "--backward-prefetch", "BACKWARD_POST", "--forward-prefetch"), 3,
                 marks=pytest.mark.slow),
    pytest.param(("--wrap", "--orig"), 6, marks=pytest.mark.slow),
    pytest.param(("--wrap", "--orig", "--bf16", "--strategy", "SHARD_GRAD_OP"), 6, marks=pytest.mark.slow),
    # One FlatParameter for the whole model: rank 0's half is block 0 and block 1's first weight
    # and part of its bias (6 original parameters); without use_orig_params, one counter.
    pytest.param(("--orig",), 6, marks=pytest.mark.slow),
    pytest.param((), 1, marks=pytest.mark.slow),
], ids=["full-shard", "shard-grad-op", "no-shard", "bf16", "prefetch-no-limit",
        "orig-params", "orig-bf16-shard-grad-op", "one-unit-orig", "one-unit"])
def test_fsdp1_peak_matches_mem_tracker(args: tuple[str, ...], steps: int) -> None:
    tracker = int(re.findall(r"^peak (\d+)$", _run([sys.executable, str(PROGRAMS / "fsdp1_mlp.py"), "--tracker",
                                                       *args]), re.M)[0])
    out = _run([sys.executable, "-m", "vram", "run", "--nproc-per-node", "2", "--ranks", "0",
                str(PROGRAMS / "fsdp1_mlp.py"), *args])
    assert re.findall(r"^\[rank0\]:peak (\d+)$", out, re.M) == [str(tracker - 512 * steps)]
