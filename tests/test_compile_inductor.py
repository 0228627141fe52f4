"""Inductor's CUDA wrappers, generated on a CPU build (`vram.run.compile`), against the wrappers a
real H200 ran: ``compiled_gpt.py`` (``../shared/gpu-truth``: a 6-layer GPT, batch 8 x 512, bf16
autocast, ``torch.compile`` default mode; recorded under torch 2.11): the wrappers' own
allocations in the second step (no autotuning then), in order and size; and the whole program
under ``vram run`` (the memory at every wrapper call's start and end, the backward's allocations,
first-launch autotuning). The GPT cases compile for minutes: marked slow."""
from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import tarfile
from importlib.util import find_spec
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from vram.run.compile.wrapper_plan import BufferEvent, buffer_events, storage_bytes  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TRUTH = Path(os.environ.get("VRAM_GPU_TRUTH", REPO.parent / "shared" / "gpu-truth"))

_WRAPPER = '''
class Runner:
    def call(self, args):
        primals_1, primals_2 = args
        with torch.cuda._DeviceGuard(0):
            buf0 = empty_strided_cuda((8, 512, 1), (512, 1, 4096), torch.float32)
            buf1 = reinterpret_tensor(buf0, (8, 512, 1), (512, 1, 1), 0); del buf0  # reuse
            buf2 = empty_strided_cuda((0, 4), (4, 1), torch.bfloat16)
            buf3 = torch.ops.aten._scaled_dot_product_flash_attention.default(primals_1, primals_2, x, 0.0, True)
            buf4 = buf3[0]
            del buf3, buf2
        return (buf1, buf4, )
def benchmark_compiled_module():
    buf9 = empty_strided_cuda((4, ), (1, ), torch.float32)
'''


def test_wrapper_events_follow_the_generated_code() -> None:
    """Storage of the largest offset (``empty_strided``), reuse allocates nothing, extern ops named,
    frees in order, nothing read past ``call``."""
    assert buffer_events(_WRAPPER) == [
        BufferEvent("alloc", "buf0", (1 + 7 * 512 + 511 * 1 + 0 * 4096) * 4),
        BufferEvent("alloc", "buf2", 0),
        BufferEvent("extern", "buf3", op="aten._scaled_dot_product_flash_attention.default"),
        BufferEvent("free", "buf3"), BufferEvent("free", "buf2")]
    assert storage_bytes((2, 3), (1, 2), "bfloat16") == (1 + 1 + 4) * 2


def test_bad_wrapper_is_refused() -> None:
    with pytest.raises(ValueError, match="no 'def call"):
        buffer_events("x = 1\n")
    with pytest.raises(ValueError, match="torch.qint8"):
        storage_bytes((1,), (1,), "qint8")


_WORKER = r'''
import json, sys
from vram.run.compile import cuda_process
cuda_process.prepare()
import math
import torch
import torch.nn as nn
import torch.nn.functional as F
from vram.run.compile.inductor_cuda import compile_for_cuda, retarget, route_sdpa
from vram.run.compile.wrapper_plan import buffer_events
source = open(sys.argv[1]).read()
head = source.split("torch.manual_seed(0)")[0].split("a = p.parse_args()")[1]
exec(head)
captured = []
def capture(gm, example_inputs):
    captured.append((gm, example_inputs))
    return gm.forward
model = GPT()
x = torch.randint(0, 32768, (8, 512)); y = torch.randint(0, 32768, (8, 512))
torch.compile(model, backend=capture)(x, y)
gm, inputs = captured[0]
retarget(gm, "cpu")
backends = route_sdpa(gm, torch.bfloat16, 9, 0)
wrappers = compile_for_cuda(gm, inputs, torch.bfloat16)
print(json.dumps({"backends": backends, "sources": wrappers, "wrappers": [
    [[e.kind, e.name, e.nbytes, e.op] for e in buffer_events(w)] for w in wrappers]}))
'''


def _recorded_trace() -> list[dict]:
    with tarfile.open(TRUTH / "h200-2026-11-27" / "recordings.tar.xz") as tar:
        member = tar.extractfile("compiled_gpt_default.pickle")
        assert member is not None
        return pickle.load(io.BytesIO(member.read()))["device_traces"][0]


def _wrapper_of(event: dict) -> str | None:
    """The generated wrapper on `event`'s stack (its ``call`` frame), if any."""
    return next((f["filename"] for f in event["frames"] if f["name"] == "call" and "torchinductor" in f["filename"]),
                None)


def _recorded_runs_allocations() -> list[list[int]]:
    """Every allocation made while a wrapper ran (its own and its extern kernels'), per run."""
    runs: list[list[int]] = []
    last = None
    for event in _recorded_trace():
        wrapper = _wrapper_of(event)
        if wrapper is None:
            last = None
            continue
        if wrapper != last:
            runs.append([])
            last = wrapper
        if event["action"] == "alloc":
            runs[-1].append(event["size"])
    return runs


def _recorded_wrapper_allocations() -> list[list[int]]:
    trace = _recorded_trace()
    calls: list[list[int]] = []
    last = None
    for event in trace:
        top = event["frames"][0] if event["frames"] else {}
        in_wrapper = top.get("name") == "call" and "torchinductor" in top.get("filename", "")
        if event["action"] != "alloc" or not in_wrapper:
            continue
        if top["filename"] != last or not calls:
            calls.append([])  # a new wrapper invocation (forward and backward alternate)
            last = top["filename"]
        calls[-1].append(event["size"])
    return calls[2:4]  # forward and backward of the first step, then the second step's


def _block(nbytes: int) -> int:
    """The caching allocator's block for a request (kMinBlockSize 512)."""
    return max(512, -(-nbytes // 512) * 512)


@pytest.fixture(scope="module")
def gpt_wrappers() -> dict:
    """compiled_gpt.py's model compiled for an H200 in a compile process (about 2 minutes)."""
    if find_spec("triton") is None:
        pytest.skip("needs triton (the 'compile' extra)")
    if not (TRUTH / "compiled_gpt.py").exists():
        pytest.skip("needs ../shared/gpu-truth beside the checkout")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), *sys.path]))
    done = subprocess.run([sys.executable, "-c", _WORKER, str(TRUTH / "compiled_gpt.py")], capture_output=True,
                          text=True, env=env, timeout=1800, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow  # the GPT compiled in a compile process: minutes
def test_gpt_wrappers_match_the_h200_recording(gpt_wrappers: dict) -> None:
    result = gpt_wrappers
    assert result["backends"] == ["cudnn"] * 6  # the recorded build ran cuDNN attention (sm90, cuDNN > 9.15)
    forward, backward = ([_block(n) for kind, _, n, _ in events if kind == "alloc"] for events in result["wrappers"])
    real_forward, real_backward = _recorded_wrapper_allocations()
    # the backward wrapper's 90 buffers, byte for byte and in order
    assert backward == real_backward
    # the forward's first two blocks (embedding, layer norms, casts, qkv, attention, MLP); from the
    # third, torch 2.11's wrapper allocates a bf16 buffer where 2.13's reuses one (docs §8)
    assert forward[:36] == real_forward[:36]


@pytest.mark.slow  # the GPT compiled in a compile process: minutes
def test_gpt_backward_wrapper_runs_on_the_simulated_gpu_as_on_the_h200(gpt_wrappers: dict) -> None:
    """The backward wrapper run on the simulated H200 (kernels as no-ops, extern kernels through
    the engine) allocates what the real one allocated in step 1, its extern kernels' own
    allocations included (cuDNN attention backward's outputs and workspace, cuBLAS), in order
    and size."""
    from vram.run.compile.wrapper_run import call, load_wrapper
    from vram.run.runtime import simulated_cuda

    with simulated_cuda("H200"):
        module = load_wrapper(gpt_wrappers["sources"][1])
        args = module.get_args()
        torch.ones(2, 2, device="cuda") @ torch.ones(2, 2, device="cuda")  # cuBLAS's workspace, as step 0 made it
        torch.cuda.memory._record_memory_history(max_entries=100_000)
        call(module, args)
        del args
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
    simulated = [e["size"] for e in trace if e["action"] == "alloc"]
    real = _recorded_runs_allocations()[3]  # forward, backward, forward, backward: step 1's backward
    assert real.count(12_779_776) == 6  # cuDNN's backward workspace, one per attention
    assert simulated == real


H200_L2_CACHE_SIZE = 62_914_560  # the recording's L2-flush buffers (benchmark_gpu)


def _wrapper_calls(trace: list[dict]) -> list[dict]:
    """Each run of a generated wrapper's ``call`` (the recording's ``/tmp/torchinductor_*/….py``,
    the simulation's ``<inductor_forward_N>``): bytes allocated (requested) as it starts and as it
    ends, the sizes it allocates, in order, and its L2-flush buffers (autotuning)."""
    calls: list[dict] = []
    allocated, last = 0, None
    for event in trace:
        before = allocated
        if event["action"] == "alloc":
            allocated += event["size"]
        elif event["action"] == "free_requested":
            allocated -= event["size"]
        elif event["action"] not in ("segment_alloc", "segment_free", "free_completed"):
            continue
        frame = next((f["filename"] for f in event["frames"] if f["name"] == "call" and (
            "torchinductor" in f["filename"] or f["filename"].startswith("<inductor"))), None)
        if frame is None:
            last = None
            continue
        if frame != last:
            calls.append({"start": before, "sizes": [], "flushes": 0})
            last = frame
        if event["action"] == "alloc":
            calls[-1]["sizes"].append(event["size"])
            calls[-1]["flushes"] += event["size"] == H200_L2_CACHE_SIZE
        calls[-1]["end"] = allocated
    return calls


def _requested_peaks(trace: list[dict]) -> tuple[int, int]:
    """The most bytes requested (not rounded to blocks) at once in step 0 (until the third wrapper
    call, step 1's forward, starts) and in the whole run."""
    allocated, step0, peak, calls, last = 0, 0, 0, 0, None
    for event in trace:
        if event["action"] not in ("alloc", "free_requested"):
            continue
        frame = next((f["filename"] for f in event["frames"] if f["name"] == "call" and (
            "torchinductor" in f["filename"] or f["filename"].startswith("<inductor"))), None)
        calls += frame is not None and frame != last
        last = frame
        allocated += event["size"] if event["action"] == "alloc" else -event["size"]
        peak = max(peak, allocated)
        step0 = peak if calls <= 2 else step0
    return step0, peak


@pytest.mark.slow  # vram run compiles the GPT in its compile process: minutes
def test_compiled_gpt_under_vram_run_follows_the_h200_recording(tmp_path: Path) -> None:
    """``vram run`` of compiled_gpt.py: Dynamo's graph compiled for the H200 and run as
    AOTAutograd runs it. At the start and end of every wrapper call of the three steps, the
    bytes allocated are the recording's (the forward's outputs and saved tensors live until the
    backward wrapper frees them); the backward wrapper's allocations in steps 1 and 2, its extern
    kernels' included, are the recording's in order and size; the first forward autotunes as
    many configs (one L2-flush buffer each) as the recording shows; the most bytes requested at
    once, in step 0 and in the run, are the recording's."""
    if find_spec("triton") is None:
        pytest.skip("needs triton (the 'compile' extra)")
    if not (TRUTH / "compiled_gpt.py").exists():
        pytest.skip("needs ../shared/gpu-truth beside the checkout")
    snapshot = tmp_path / "compiled_gpt.pickle"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), *sys.path]))
    done = subprocess.run([sys.executable, "-m", "vram", "run", "--gpu", "H200", "--snapshot", str(snapshot),
                           str(TRUTH / "compiled_gpt.py")], capture_output=True, text=True, env=env, timeout=1800,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "not modelled" not in done.stderr and "runs eagerly" not in done.stderr
    with open(snapshot, "rb") as f:
        simulated_trace = pickle.load(f)["device_traces"][0]
    simulated, real = _wrapper_calls(simulated_trace), _wrapper_calls(_recorded_trace())
    # the most bytes requested at once: step 0 (its autotuning included), then the run
    assert _requested_peaks(simulated_trace) == _requested_peaks(_recorded_trace()) == (1_497_518_184,
                                                                                         2_045_366_680)
    assert len(simulated) == len(real) == 6  # forward and backward, three steps
    assert [(c["start"], c["end"]) for c in simulated] == [(c["start"], c["end"]) for c in real]
    assert simulated[3]["sizes"] == real[3]["sizes"] and simulated[5]["sizes"] == real[5]["sizes"]
    assert simulated[0]["flushes"] == real[0]["flushes"] == 20
