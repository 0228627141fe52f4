"""``vram estimate --ddp/--fsdp``: each rank's figures against the same training loop
written by hand (`tests/distributed_programs/estimate_equivalent.py`) under ``vram run
--nproc-per-node``, and against PyTorch's ``FSDPMemTracker`` on the CPU with the fake process
group, the way tests/test_fsdp.py compares them.

The tracker and the simulation count the same tensors but for two kinds (see tests/test_fsdp.py):
cuBLAS workspaces, which no tracker sees (the estimate reports them as ``cublas_workspaces``), and
Adam's ``step`` counters, host tensors on a GPU run (``torch/optim/adam.py`` ``_init_group``) that
the CPU tracker counts, 512 bytes each. HSDP (``--ddp 2 --fsdp 2``: ``fully_shard`` over a 2-D
(replicate, shard) mesh) runs under the tracker with the fake group too. DDP does not: the fake
group's all-reduce future holds no tensor and the Reducer's ``comm.cpp`` asserts, so DDP is
compared with the hand-written run only.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch.distributed.fsdp")

from test_fsdp import ENV, PROGRAMS  # noqa: E402 - after the skip: the same environment and programs

ADAM_STEPS = 16 * 512   # tiny_stack: 4 blocks x 4 parameters, one host float32 step counter each
INPUT = ["--input", "64x256"]


def _run(cmd: list[str], ok: bool = True, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout, cwd=str(PROGRAMS))
    if ok:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def estimate(*args: str, model: str = "tiny_stack:stack", timeout: int = 300, status: int = 0) -> dict:
    """``vram estimate --json``'s answer; `status`: its exit status (0 fits, 1 does not fit)."""
    r = _run([sys.executable, "-m", "vram", "estimate", model, *args, "--json"], ok=False, timeout=timeout)
    assert r.returncode == status, r.stdout + r.stderr
    return json.loads(r.stdout)


def hand_figures(mode: str, nproc: int, *args: str) -> dict[int, tuple[int, int]]:
    """Each rank's (peak allocated, peak reserved) of the loop written by hand under ``vram run``."""
    out = _run([sys.executable, "-m", "vram", "run", "--nproc-per-node", str(nproc),
                "estimate_equivalent.py", mode, "--world", str(nproc), *args]).stdout
    got = {(int(r), k): int(v) for r, k, v in re.findall(r"^\[rank(\d+)\]:(peak|reserved) (\d+)$", out, re.M)}
    return {r: (got[r, "peak"], got[r, "reserved"]) for r in range(nproc)}


def by_hand(mode: str, nproc: int, *args: str) -> dict[int, int]:
    return {r: v[0] for r, v in hand_figures(mode, nproc, *args).items()}


def estimated(got: dict) -> dict[int, tuple[int, int]]:
    """Each rank's (peak allocated, peak reserved) as `vram estimate --json` reports them."""
    est = {r: got["estimates"][str(v["simulated_as"])] for r, v in got["ranks"].items()}
    return {int(r): (e["peak_allocated"], e["peak_reserved"]) for r, e in est.items()}


def tracker(mode: str, nproc: int) -> int:
    out = _run([sys.executable, "estimate_equivalent.py", mode, "--world", str(nproc), "--tracker"]).stdout
    return int(re.findall(r"^peak (\d+)$", out, re.M)[0])


@pytest.mark.parametrize("mode, flags, nproc", [
    pytest.param("fsdp", ["--fsdp", "2"], 2, marks=pytest.mark.slow),
    pytest.param("hsdp", ["--ddp", "2", "--fsdp", "2"], 4, marks=pytest.mark.slow)], ids=["fsdp2", "hsdp-2x2"])
def test_fsdp_estimate_equals_the_run_by_hand_and_fsdp_mem_tracker(mode: str, flags: list[str], nproc: int) -> None:
    got = estimate(*INPUT, *flags)
    assert got["layout"]["world_size"] == nproc
    # fully_shard pads every shard to torch.chunk's first: these ranks allocate the same, one stands for all
    assert {r["simulated_as"] for r in got["ranks"].values()} == {0}
    est = got["estimates"]["0"]
    assert hand_figures(mode, nproc) == estimated(got)
    assert est["peak_allocated"] - est["categories"]["cublas_workspaces"] == tracker(mode, nproc) - ADAM_STEPS
    cats = est["categories"]
    assert cats["parameters"] == cats["all_gather_buffers"] == 4 * 525568 * 4 // 2 + 8 * 0  # a half of 4 blocks
    assert cats["ddp_buckets"] == 0


def test_ddp_estimate_equals_the_run_by_hand() -> None:
    got = estimate(*INPUT, "--ddp", "2")
    est = got["estimates"]["0"]
    assert hand_figures("ddp", 2) == estimated(got)
    assert est["categories"]["parameters"] == 4 * 525568 * 4   # replicated: every parameter
    assert est["categories"]["ddp_buckets"] > 0 and est["categories"]["all_gather_buffers"] == 0


TP = ["--tp-plan", "tiny_stack:tp_plan"]


@pytest.mark.parametrize("mode, flags, nproc", [
    # tensor parallelism stays in the default run through test_distributed_tp.py and test_tensor_parallel.py
    pytest.param("tp", ["--tp", "2", *TP], 2, marks=pytest.mark.slow),
    pytest.param("fsdp_tp", ["--fsdp", "2", "--tp", "2", *TP], 4, marks=pytest.mark.slow)], ids=["tp2", "fsdp2-x-tp2"])
def test_tp_estimate_equals_the_run_by_hand_and_mem_tracker(mode: str, flags: list[str], nproc: int) -> None:
    """Colwise/Rowwise ``parallelize_module`` (and FSDP2 over it on a (dp_shard, tp) mesh): the
    estimate, the loop by hand and MemTracker (TP) or FSDPMemTracker (FSDP over TP) agree on every
    rank. Where they count differently: the trackers see no cuBLAS workspace, and count Adam's host
    ``step`` counters; MemTracker files the input batch as an activation and the foreach step's
    temporaries (``_foreach_sqrt`` of every second moment ...) as optimizer state, which the
    estimate calls temporaries; the totals agree."""
    got = estimate(*INPUT, *flags)
    assert hand_figures(mode, nproc) == estimated(got)
    est = got["estimates"]["0"]
    assert est["peak_allocated"] - est["categories"]["cublas_workspaces"] == tracker(mode, nproc) - ADAM_STEPS
    dp = 2 if mode == "fsdp_tp" else 1
    # tensor/parallel/style.py: ColwiseParallel shards up's weight and bias Shard(0), RowwiseParallel
    # down's weight Shard(1) and replicates its bias; fully_shard then takes dim 0 of each over dp
    block = [512 * 256, 512, 256 * 512, 256]          # this TP rank's up.weight, up.bias, down.weight, down.bias
    assert est["categories"]["parameters"] == 4 * sum(-(-4 * n // dp // 512) * 512 for n in block)


@pytest.mark.slow
def test_sequence_parallel_estimate_equals_the_run_by_hand() -> None:
    """``tiny_stack.sp_plan`` (SequenceParallel norms, Colwise from the gathered sequence, Rowwise
    reduce-scattered back) over ``norm_stack``: the estimate equals the loop by hand on both ranks.
    MemTracker is not compared here: the peak is in the backward, where CUDA's ``mm`` clones the
    loss's stride-0 gradient (``out.sum()``'s backward is an ``expand``) to a contiguous matrix
    (``native/cuda/cuBlasCommonArgs.h`` ``prepare_matrix_for_cublas``, used by ``Blas.cpp``: neither stride is 1,
    ``tensor.clone(at::MemoryFormat::Contiguous)``), which the CPU's ``mm`` under the tracker
    does not, so the CPU peak lacks that copy (docs/estimate-accuracy.md)."""
    got = estimate("--input", "8x64x256", "--tp", "2", "--tp-plan", "tiny_stack:sp_plan", model="tiny_stack:norm_stack")
    assert hand_figures("tp", 2, "--sp", "--batch", "8", "--seq", "64") == estimated(got)
    # SequenceParallel replicates each norm's weight and bias (256 float32 each, a 1024-byte block)
    block = [512 * 256, 512, 256 * 512, 256, 256, 256]
    assert got["estimates"]["0"]["categories"]["parameters"] == 4 * sum(4 * n for n in block)


@pytest.mark.slow
def test_pp_estimate_equals_the_run_by_hand() -> None:
    """``pipeline()`` split at the blocks, one stage per rank, 4 micro-batches of 128: each stage's
    peaks equal the schedule written by hand, for both schedules. 1F1B's first stage holds fewer
    micro-batches' activations than GPipe's (``schedules.py``: 1F1B runs ``min(M, S - s)`` = 2
    forwards before its first backward, GPipe all 4), so its peak is lower."""
    peaks = {}
    for schedule in ("1F1B", "GPipe"):
        got = estimate("--input", "512x256", "--pp", "2", "--microbatches", "4", "--schedule", schedule)
        assert {r["simulated_as"] for r in got["ranks"].values()} == {0, 1}   # the stages differ
        assert hand_figures("pp", 2, "--batch", "512", "--microbatches", "4", "--schedule", schedule) == estimated(got)
        est = got["estimates"]
        assert est["0"]["categories"]["parameters"] == est["1"]["categories"]["parameters"] == 2 * 525568 * 4
        peaks[schedule] = est["0"]["peak_allocated"]
    assert peaks["1F1B"] < peaks["GPipe"]


@pytest.mark.slow
def test_max_batch_with_fsdp_is_a_boundary() -> None:
    """The search's answer fits and the batch after it does not, and each rank's runs are reported
    as they end. Fitting need not be monotonic in the batch (the search assumes it), so the answer
    is *a* boundary; here one lies at 2560 by the allocator's rounding: 700 MiB less NCCL's 484 MiB
    leaves the allocator 216 MiB. Each block's ReLU output saved for
    backward is batch x 1024 x 4 B: at 2560 exactly 10 MiB, which CUDACachingAllocator.cpp's
    ``get_allocation_size`` gives a segment of its own (``kMinLargeAlloc`` 10 MiB and above rounds to
    ``kRoundLarge`` 2 MiB), so batch 2560 fits; at 2561, 10 MiB + 4 KiB rounds up to a 12 MiB segment
    and the step reserves 247,463,936 B (236 MiB). Beside those, FSDP2's side streams hold segments
    the default stream cannot use (``_fsdp_collectives.py``: ``foreach_all_gather`` allocates the all-gather output on
    ``all_gather_copy_in_stream``, ``foreach_reduce`` the reduce-scatter output on
    ``reduce_scatter_stream``; each below 10 MiB, so a 20 MiB ``kLargeBuffer`` segment per stream)."""
    # a size-only GPU is an H100 node: NCCL takes 484 MiB of it at the first collective
    gpu = ["--gpu", "700MiB", "--context", "0"]
    r = _run([sys.executable, "-m", "vram", "estimate", "tiny_stack:stack", *INPUT, "--fsdp", "2", "--max-batch",
              *gpu, "--json"], ok=False, timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr
    best = json.loads(r.stdout)["max_batch"]
    runs = re.findall(r"^max-batch: rank 0: run (\d+), batch (\d+) (fits|does not fit) \(", r.stderr, re.M)
    assert runs and [int(n) for n, _, _ in runs] == list(range(1, len(runs) + 1)), r.stderr
    told = {int(b): f for _, b, f in runs}
    assert told[best] == "fits" and told[best + 1] == "does not fit", r.stderr
    fit = {b: estimate("--input", f"{b}x256", "--fsdp", "2", *gpu, status=s)["estimates"]["0"]["fits"]
           for b, s in ((best, 0), (best + 1, 1), (2560, 0), (2561, 1))}
    assert fit == {best: True, best + 1: False, 2560: True, 2561: False}


@pytest.mark.parametrize("args, message", [
    (["--tp", "2"], "--tp needs --tp-plan MODULE:FUNC"),
    (["--fsdp", "0"], "--fsdp must be a positive number of GPUs"),
    (["--ddp", "2", "--tp", "2", "--tp-plan", "tiny_stack:stack"], "--ddp with --tp"),
    (["--pp", "2", "--input", "3x256"], "does not split into 2 micro-batches"),
    (["--microbatches", "2"], "--microbatches needs --pp"),
], ids=["tp-without-plan", "zero", "ddp-tp", "pp-batch", "microbatches-without-pp"])
def test_bad_layouts_are_one_line_errors(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before any model is imported or rank launched (in this process: the CLI's own entry)."""
    from vram.cli.commands import main

    assert main(["estimate", "tiny_stack:stack", *(INPUT if "--input" not in args else []), *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and message in err, err


def test_pp_refuses_a_model_without_a_top_level_module_list() -> None:
    r = _run([sys.executable, "-m", "vram", "estimate", "tiny_stack:flat", *INPUT, "--pp", "2"], ok=False)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "cannot be split" in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("mode, flags, batch, extra", [
    ("ddp", ["--ddp", "2"], 1024, []),
    ("fsdp", ["--fsdp", "2"], 1024, []),
    ("tp", ["--tp", "2", *TP], 1024, []),
    ("pp", ["--pp", "2", "--microbatches", "4"], 2048, ["--microbatches", "4"]),
], ids=["ddp", "fsdp2", "tp", "pp"])
def test_checkpoint_with_each_layout_equals_the_run_by_hand(mode: str, flags: list[str], batch: int,
                                                            extra: list[str]) -> None:
    """``--checkpoint`` combined with each layout: every rank's peaks equal the loop
    by hand with ``checkpoint_wrapper`` (non-reentrant ``torch.utils.checkpoint``) around each
    block, applied as torchtitan does (after the TP plan, before DDP or ``fully_shard``; a pipeline
    stage's blocks after ``build_stage``). The batch is large enough for the peak to be in the
    backward, so checkpointing lowers it on every rank."""
    inputs = ["--input", f"{batch}x256"]
    got = estimate(*inputs, *flags, "--checkpoint")
    assert hand_figures(mode, 2, "--batch", str(batch), *extra, "--checkpoint") == estimated(got)
    plain = estimated(estimate(*inputs, *flags))
    assert all(got_r[0] < plain[r][0] for r, got_r in estimated(got).items())
