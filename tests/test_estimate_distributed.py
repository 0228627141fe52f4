"""``vram estimate --ddp/--fsdp`` (issue 13): each rank's figures against the same training loop
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


def _run(cmd: list[str], ok: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300, cwd=str(PROGRAMS))
    if ok:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def estimate(*args: str) -> dict:
    return json.loads(_run([sys.executable, "-m", "vram", "estimate", "tiny_stack:stack", *args, "--json"]).stdout)


def by_hand(mode: str, nproc: int, *args: str) -> dict[int, int]:
    out = _run([sys.executable, "-m", "vram", "run", "--nproc-per-node", str(nproc),
                "estimate_equivalent.py", mode, "--world", str(nproc), *args]).stdout
    return {int(r): int(v) for r, v in re.findall(r"^\[rank(\d+)\]:peak (\d+)$", out, re.M)}


def tracker(mode: str, nproc: int) -> int:
    out = _run([sys.executable, "estimate_equivalent.py", mode, "--world", str(nproc), "--tracker"]).stdout
    return int(re.findall(r"^peak (\d+)$", out, re.M)[0])


@pytest.mark.parametrize("mode, flags, nproc", [
    ("fsdp", ["--fsdp", "2"], 2), ("hsdp", ["--ddp", "2", "--fsdp", "2"], 4)], ids=["fsdp2", "hsdp-2x2"])
def test_fsdp_estimate_equals_the_run_by_hand_and_fsdp_mem_tracker(mode: str, flags: list[str], nproc: int) -> None:
    got = estimate(*INPUT, *flags)
    assert got["layout"]["world_size"] == nproc
    # fully_shard pads every shard to torch.chunk's first: these ranks allocate the same, one stands for all
    assert {r["simulated_as"] for r in got["ranks"].values()} == {0}
    est = got["estimates"]["0"]
    hand = by_hand(mode, nproc)
    assert hand == dict.fromkeys(range(nproc), est["peak_allocated"])
    assert est["peak_allocated"] - est["categories"]["cublas_workspaces"] == tracker(mode, nproc) - ADAM_STEPS
    cats = est["categories"]
    assert cats["parameters"] == cats["all_gather_buffers"] == 4 * 525568 * 4 // 2 + 8 * 0  # a half of 4 blocks
    assert cats["ddp_buckets"] == 0


def test_ddp_estimate_equals_the_run_by_hand() -> None:
    got = estimate(*INPUT, "--ddp", "2")
    est = got["estimates"]["0"]
    assert by_hand("ddp", 2) == {0: est["peak_allocated"], 1: est["peak_allocated"]}
    assert est["categories"]["parameters"] == 4 * 525568 * 4   # replicated: every parameter
    assert est["categories"]["ddp_buckets"] > 0 and est["categories"]["all_gather_buffers"] == 0


def test_max_batch_with_fsdp_is_the_boundary() -> None:
    gpu = ["--gpu", "700MiB"]   # a size-only GPU is an H100 node: NCCL takes 484 MiB of it at the first collective
    best = estimate(*INPUT, "--fsdp", "2", "--max-batch", *gpu)["max_batch"]
    assert best and best > 1
    at = estimate("--input", f"{best}x256", "--fsdp", "2", *gpu)["estimates"]["0"]
    over = estimate("--input", f"{best + 1}x256", "--fsdp", "2", *gpu)["estimates"]["0"]
    assert at["fits"] and not over["fits"]


@pytest.mark.parametrize("args, message", [
    (["--tp", "2"], "--tp needs --tp-plan MODULE:FUNC"),
    (["--fsdp", "0"], "--fsdp must be a positive number of GPUs"),
    (["--ddp", "2", "--tp", "2", "--tp-plan", "tiny_stack:stack"], "--ddp with --tp"),
    (["--pp", "2", "--input", "3x256"], "does not split into 2 micro-batches"),
    (["--microbatches", "2"], "--microbatches needs --pp"),
], ids=["tp-without-plan", "zero", "ddp-tp", "pp-batch", "microbatches-without-pp"])
def test_bad_layouts_are_one_line_errors(args: list[str], message: str) -> None:
    r = _run([sys.executable, "-m", "vram", "estimate", "tiny_stack:stack",
              *(INPUT if "--input" not in args else []), *args], ok=False)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr


def test_pp_refuses_a_model_without_a_top_level_module_list() -> None:
    r = _run([sys.executable, "-m", "vram", "estimate", "tiny_stack:flat", *INPUT, "--pp", "2"], ok=False)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "cannot be split" in r.stderr
