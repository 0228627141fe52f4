"""``torch.compile(mode="max-autotune-no-cudagraphs")`` under ``vram run``: each matmul takes
Inductor's choice without benchmarks (select_algorithm.py ``pick_deterministic_choice``: the
extern cuBLAS kernel), and the benchmarking a GPU does while compiling is charged before the
graph first runs (``AlgorithmSelectorCache.get_inputs`` / ``benchmark_choices``: example inputs
and output, an L2-flush buffer per choice, the compiling thread's cuBLAS workspace). Compiles in
the compile process (about a minute): marked slow."""
from __future__ import annotations

import pickle
from importlib.util import find_spec
from pathlib import Path

import pytest

from compiled_runs import mlp_script, vram_run

_SCRIPT = mlp_script("max-autotune-no-cudagraphs", 2)
_H200_L2 = 62_914_560  # the L2-flush buffer the H200 recordings show (benchmark_gpu)
_CUBLAS_SM90 = 4096 * 8 * 1024  # getChosenWorkspaceSize on sm90 (CublasHandlePool.cpp)


@pytest.mark.slow  # compiles in the compile process: about a minute
def test_max_autotune_benchmarks_are_charged_and_cublas_is_chosen(tmp_path: Path) -> None:
    """Before the first forward: the first selection is the first layer's ``addmm`` (bias 4096
    fp32 expanded, input 256 x 1024, weight 1024 x 4096, output 256 x 4096: ``tuned_addmm``'s
    input nodes in order), benchmarked with more than one choice, each under one 60 MiB flush
    buffer, the extern choice allocating the compiling thread's cuBLAS and cuBLASLt workspaces
    (``CUBLASLT_WORKSPACE_SIZE`` 1024 KiB: addmm's ``gemm_and_bias``); the choice is
    said once on stderr."""
    if find_spec("triton") is None:
        pytest.skip("needs triton (the 'compile' extra)")
    script, snapshot = tmp_path / "mlp.py", tmp_path / "mlp.pickle"
    script.write_text(_SCRIPT, encoding="utf-8")
    done = vram_run(script, snapshot)
    assert done.stderr.count("pick_deterministic_choice") == 1
    with open(snapshot, "rb") as f:
        trace = pickle.load(f)["device_traces"][0]
    allocs = [e["size"] for e in trace if e["action"] == "alloc"]
    # the model's parameters and x come first (4 + 1 tensors); then the compile's benchmarks
    params = [4096 * 1024 * 4, 4096 * 4, 1024 * 4096 * 4, 1024 * 4, 256 * 1024 * 4]
    assert allocs[:5] == params
    assert allocs[5:9] == [4096 * 4, 256 * 1024 * 4, 1024 * 4096 * 4, 256 * 4096 * 4]
    assert allocs[9:12] == [_CUBLAS_SM90, 1024 * 1024, _H200_L2]  # cuBLAS, cuBLASLt (addmm), the flush
    flushes = 0
    for size in allocs[12:]:
        if size != _H200_L2:
            break
        flushes += 1
    assert flushes >= 1  # the Triton templates' benchmarks: one flush buffer each
