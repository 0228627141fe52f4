"""``torch.compile(mode="reduce-overhead")`` under ``vram run``: CUDA graph trees
(torch/_inductor/cudagraph_trees.py) on the simulated GPU, against the real H200's recording of
``compiled_gpt.py --mode reduce-overhead`` (``../shared/gpu-truth/h200-2026-11-27``, torch 2.11)
and PyTorch's rules: warm-up runs in the tree's private pool on its own stream, non-static inputs
copied into the pool when a graph is recorded, replays allocate nothing. Each case compiles in the
compile process (tens of seconds to minutes): marked slow."""
from __future__ import annotations

import io
import pickle
import re
import subprocess
import tarfile
from importlib.util import find_spec
from pathlib import Path

import pytest

from compiled_runs import mlp_script, vram_run
from paths import GPU_TRUTH as TRUTH

_STEP = re.compile(r"^step (\d+) loss \S+ max_allocated ([\d,]+) max_reserved ([\d,]+)$", re.M)


def _needs_compile() -> None:
    if find_spec("triton") is None:
        pytest.skip("needs triton (the 'compile' extra)")


def _vram_run(script: Path, snapshot: Path, *args: str) -> subprocess.CompletedProcess[str]:
    done = vram_run(script, snapshot, *args)
    assert "not modelled" not in done.stderr and "runs eagerly" not in done.stderr, done.stderr[-3000:]
    return done


def _recorded_trace() -> list[dict]:
    with tarfile.open(TRUTH / "h200-2026-11-27" / "recordings.tar.xz") as tar:
        member = tar.extractfile("compiled_gpt_reduce_overhead.pickle")
        assert member is not None
        return pickle.load(io.BytesIO(member.read()))["device_traces"][0]


def _requested(trace: list[dict]) -> tuple[int, int]:
    """The most bytes requested at once in step 0 (up to the first ``zero_grad``) and in the run."""
    allocated = peak = 0
    step0 = None
    for event in trace:
        if step0 is None and any(f["name"] == "zero_grad" for f in event["frames"]):
            step0 = peak
        if event["action"] in ("alloc", "free_completed"):
            allocated += event["size"] if event["action"] == "alloc" else -event["size"]
            peak = max(peak, allocated)
    assert step0 is not None
    return step0, peak


def _outside_partitions(trace: list[dict]) -> list[int]:
    """Sizes of the allocations on the tree's stream outside a graph partition: the default
    generator's seed and offset (``capture_begin``), then what ``_allocate_and_copy_recording_inputs``
    copies into the pool (the token batches, the loss gradient)."""
    return [e["size"] for e in trace if e["action"] == "alloc" and e["stream"] != 0
            and not any(f["name"] == "partition_0" for f in e["frames"])]


@pytest.mark.slow  # compiles the GPT in the compile process: minutes
def test_compiled_gpt_reduce_overhead_follows_the_h200_recording(tmp_path: Path) -> None:
    """compiled_gpt.py with ``mode="reduce-overhead"``: step 0 (warm-up of the forward and the
    backward in the tree's pool) peaks at the H200's allocated bytes exactly; the most bytes
    requested at once, in step 0 and in the run (the recording of step 1), are the recording's;
    the recording copies the same non-static inputs into the pool on the side stream; step 2
    replays and allocates nothing more. The run's peaks differ from the H200's by what torch
    2.11's forward wrapper allocates more than 2.13's (docs/estimate-accuracy.md §8)."""
    _needs_compile()
    if not (TRUTH / "compiled_gpt.py").exists():
        pytest.skip("needs ../shared/gpu-truth beside the checkout")
    snapshot = tmp_path / "compiled_gpt_ro.pickle"
    done = _vram_run(TRUTH / "compiled_gpt.py", snapshot, "--mode", "reduce-overhead")
    steps = {int(s): (int(a.replace(",", "")), int(r.replace(",", ""))) for s, a, r in _STEP.findall(done.stdout)}
    assert steps[0][0] == 1_466_986_496  # the H200's step 0 (logs.txt)
    assert steps[1] == steps[2]  # step 2 replays: nothing new
    allocated, reserved = steps[2]
    assert abs(allocated - 2_014_251_008) <= 0.001 * 2_014_251_008
    assert abs(reserved - 2_185_232_384) <= 0.022 * 2_185_232_384
    with open(snapshot, "rb") as f:
        simulated = pickle.load(f)["device_traces"][0]
    real = _recorded_trace()
    assert _requested(simulated) == _requested(real) == (1_462_915_192, 2_010_796_456)
    assert _outside_partitions(simulated) == _outside_partitions(real) == [8, 8, 32768, 32768, 4]


_MLP = mlp_script("reduce-overhead", 4, "torch.cuda.memory_stats()['allocation.all.allocated'], "
                  "torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()")


@pytest.mark.slow  # compiles in the compile process: about a minute
def test_replays_allocate_nothing_and_warm_up_uses_the_private_pool(tmp_path: Path) -> None:
    """PyTorch's rules (cudagraph_trees.py): step 0 warms up (``run_eager``) with the thread's
    allocations routed to the tree's pool (``_use_cuda_memory_pool_manager``) on the manager's
    own stream; step 1 records; steps 2 and 3 replay (``CUDAGraphNode.run``): no allocation
    at all, so the count of allocations made is the same after steps 2 and 3 as after step 1,
    but for the few the script makes itself each step (``sum``'s output and its gradient)."""
    _needs_compile()
    script = tmp_path / "mlp.py"
    script.write_text(_MLP, encoding="utf-8")
    snapshot = tmp_path / "mlp.pickle"
    done = _vram_run(script, snapshot)
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("step ")]
    counts = [int(r[2]) for r in rows]
    assert counts[2] - counts[1] == counts[3] - counts[2] < counts[1] - counts[0]
    assert int(rows[3][4]) == int(rows[1][4])  # no new peak after the recording
    with open(snapshot, "rb") as f:
        snap = pickle.load(f)
    pooled = [s for s in snap["segments"] if tuple(s["segment_pool_id"]) != (0, 0)]
    assert pooled and all(s["stream"] != 0 for s in pooled)
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
    assert all(e["stream"] != 0 for e in allocs[:counts[1]] if any(f["name"] == "partition_0" for f in e["frames"]))
    replayed = allocs[counts[1]:]  # steps 2 and 3: the script's own ops only, none in the graphs
    assert replayed and not any(e["stream"] != 0 or any(f["name"] == "partition_0" for f in e["frames"])
                                for e in replayed)
