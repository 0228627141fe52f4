"""FSDP2 (``fully_shard``) on simulated GPUs, checked against PyTorch's own tracker.

`tests/distributed_programs/fsdp2_mlp.py` is an ordinary FSDP2 training script. Run by
``vram run --nproc-per-node 2`` it prints ``max_memory_allocated()`` over a warmed-up baseline;
run with ``--tracker`` it is rank 0 of 2 on the CPU with PyTorch's fake process group, under
``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker``, the way PyTorch's
``test/distributed/_tools/test_fsdp2_mem_tracker.py`` measures it.

The two count the same tensors but for the optimizer's ``step`` counters: Adam keeps them on the
host unless ``capturable``/``fused`` (``torch/optim/adam.py``, ``_init_group``), so on a GPU they
are not GPU memory, while a CPU run's tracker counts each (4 bytes, 512 rounded). The tracker
rounds every storage to 512 bytes only on CUDA (``mem_tracker._WeakRefInfo``); the script applies
the same rule to its CPU storages. cuBLAS/cuBLASLt workspaces, which no tracker sees, are created
by the warm-up before the baseline, as in PyTorch's test.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch.distributed.fsdp")

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = Path(__file__).resolve().parent / "distributed_programs"
ENV = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
for _var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
    ENV.pop(_var, None)

ADAM_STEPS = 12 * 512   # 3 blocks x 4 parameters: one host float32 step counter each, 512 rounded


def _run(cmd: list[str]) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300, cwd=str(ROOT))
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def vram_peaks(script: str, *args: str, nproc: int = 2) -> dict[int, int]:
    """Each rank's printed ``peak N`` under ``vram run --nproc-per-node nproc``."""
    out = _run([sys.executable, "-m", "vram", "run", "--nproc-per-node", str(nproc), str(PROGRAMS / script), *args])
    return {int(r): int(v) for r, v in re.findall(r"^\[rank(\d+)\]:peak (\d+)$", out, re.M)}


@pytest.mark.parametrize("args, extra", [
    ((), 0), pytest.param(("--no-reshard", "--foreach"), 0, marks=pytest.mark.slow),
    pytest.param(("--bf16",), 0, marks=pytest.mark.slow),
    # Activation checkpointing: the recomputed forward's addmm runs on the autograd thread, whose
    # cuBLAS handle gets its own cuBLASLt workspace (1 MiB, CUBLASLT_WORKSPACE_SIZE's default;
    # the warm-up's backward made none: it has no addmm). No tracker sees workspaces.
    pytest.param(("--ac",), 1 << 20, marks=pytest.mark.slow),
], ids=["default", "no-reshard-foreach", "bf16", "activation-checkpointing"])
def test_fsdp2_peak_matches_fsdp_mem_tracker(args: tuple[str, ...], extra: int) -> None:
    tracker = int(re.findall(r"^peak (\d+)$", _run([sys.executable, str(PROGRAMS / "fsdp2_mlp.py"), "--tracker",
                                                       *args]), re.M)[0])
    peaks = vram_peaks("fsdp2_mlp.py", *args)
    assert peaks == {0: tracker - ADAM_STEPS + extra, 1: tracker - ADAM_STEPS + extra}


def _phases(*args: str) -> dict[str, str]:
    out = _run([sys.executable, "-m", "vram", "run", "--nproc-per-node", "2", "--ranks", "0",
                str(PROGRAMS / "fsdp2_phases.py"), *args])
    return dict(re.findall(r"^\[rank0\]:([a-z_0-9]+) (.*)$", out, re.M))


MiB, KiB = 1 << 20, 1 << 10
W, X = 4 * MiB, 32 * KiB     # one unsharded 1024x1024 float32 weight; the 8x1024 input, each output


@pytest.mark.parametrize("args, layer0, forward", [
    # _fsdp_param_group.py, FORWARD: unshard() allocates the all-gather output (AG, world x shard
    # = W) on the copy-in stream, wait_for_unshard() the unsharded parameter (W), keeping AG in
    # comm_ctx.all_gather_state; layer 1's wait_for_unshard drops it, but the walrus-bound
    # local ``prev_all_gather_state`` holds it until the method returns, i.e. past layer 1's
    # copy-out: the forward peak is shards + x + AG0 + AG1 + layer 1's weight + out0. The root's
    # post-forward frees the last AG (_fsdp_state.py).
    ((), W + 2 * W + X, (W + 3 * X, W + 3 * W + 2 * X)),
    # reshard_after_forward=False: layer 0's weight stays through layer 1's copy-out and after
    pytest.param(("--no-reshard",), W + 2 * W + X, (W + 2 * W + 3 * X, W + 4 * W + 2 * X), marks=pytest.mark.slow),
    # set_modules_to_forward_prefetch: layer 1's AG is allocated before layer 0 runs
    pytest.param(("--prefetch",), W + 3 * W + X, (W + 3 * X, W + 3 * W + 2 * X), marks=pytest.mark.slow),
    # CPUOffloadPolicy: shards live on the host; all-gather inputs are H2D copies freed before
    # layer 1's copy-out
    pytest.param(("--offload",), 2 * W + X, (3 * X, 3 * W + 2 * X), marks=pytest.mark.slow),
], ids=["reshard", "no-reshard", "prefetch", "cpu-offload"])
def test_fsdp2_sharding_forward_and_streams(args: tuple[str, ...], layer0: int, forward: tuple[int, int]) -> None:
    shards = 0 if args == ("--offload",) else W         # two half weights (world 2)
    p = _phases(*args)
    assert p["built"] == f"{2 * W} {2 * W}"
    # _init_sharded_param: new_zeros(padded shard) while the unsharded weight lives, one layer at a time
    assert p["sharded"] == f"{shards} {2 * W + W // 2}"
    assert int(p["layer0"]) == layer0                      # in layer 0's forward pre-hook
    assert p["forward"] == f"{forward[0]} {forward[1]}"
    # Allocations on FSDP2's streams (spec §4: a 1-10 MiB request gets a 20 MiB segment of its
    # stream): the all-gather outputs on the copy-in stream, the reduce-scatter outputs (the
    # sharded gradients) on the reduce-scatter stream; the all-gather stream only runs NCCL.
    streams = dict(re.findall(r"\('(\w+)', (\d+)\)", p["streams"]))
    assert streams["all_gather_copy_in"] == str(20 * MiB) and streams["reduce_scatter"] == str(20 * MiB)
    assert "all_gather" not in streams


def test_fsdp2_meta_init_charges_only_shards_and_the_summary_keeps_the_whole_run_peak() -> None:
    """torchtitan's way of building an FSDP2 model (tests/distributed_programs/fsdp2_meta_init.py).
    `_fully_shard/_fsdp_param.py` pads dim 0 to a multiple of the world and keeps one shard per
    rank: a 1024x1024 float32 weight over 8 ranks is 128 rows, 512 KiB, so ``to_empty`` holds 2 x
    512 KiB (a DTensor's wrapper, global-sized, is no memory of its own), and initialising them
    (trunc_normal_'s rejection loop, DTensor's RNG tracker) keeps it so. ``clip_grad_norm_
    (foreach=True)`` takes CUDA's foreach path. The script resets its peak every step, as
    torchtitan does; vram's table still gives the largest step peak."""
    out = _run([sys.executable, "-m", "vram", "run", "--nproc-per-node", "8", "--ranks", "0",
                str(PROGRAMS / "fsdp2_meta_init.py")])
    assert out.count("[rank0]:to_empty ") == 1   # DTensor's RNG state reaches the default engine: no rerun
    got = re.findall(r"^\[rank0\]:(\w+) (\d+)$", out, re.M)
    shard = 128 * 1024 * 4
    assert got[:2] == [("to_empty", str(2 * shard)), ("init", str(2 * shard))]
    steps = [int(v) for k, v in got if k == "step_peak"]
    assert len(steps) == 2
    row = re.search(r"^ +0 +0 +cuda:0 +([\d,]+) ", out, re.M)
    assert row is not None and int(row[1].replace(",", "")) == max(steps)
