"""Tensor parallelism under ``torch.compile`` in ``vram run``: ColwiseParallel/RowwiseParallel
(``parallelize_module``), then ``torch.compile``, as torchtitan composes them.

``DTensor.from_local`` (ColwiseParallel's input hook) moves its input to the device mesh's device
type, ``cuda`` (``if device_type != local_tensor.device.type: local_tensor.to(device_type)``),
which on a GPU is where the input already is. Dynamo runs the call whole on fake tensors, which
under ``vram run`` are on the simulated device: the ``cuda`` named inside it is that device too.
The graphs then take DTensors and the mesh, which the compiled runtime does not model: they run
eagerly, said once per rank."""
from __future__ import annotations

import subprocess
import sys
from importlib.util import find_spec

import pytest

pytest.importorskip("torch")

from paths import REPO  # noqa: E402

SCRIPT = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel, RowwiseParallel
dist.init_process_group("nccl")
torch.cuda.set_device(dist.get_rank())
mesh = init_device_mesh("cuda", (2,))
m = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda()
parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
step = torch.compile(m) if COMPILE else m
opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
x = torch.randn(16, 256, device="cuda")
for _ in range(2):
    step(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
if dist.get_rank() == 0:
    print("peaks", torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
dist.destroy_process_group()
"""


def _run(tmp_path, compile_: bool) -> subprocess.CompletedProcess[str]:
    script = tmp_path / f"tp_{compile_}.py"
    script.write_text(SCRIPT.replace("COMPILE", str(compile_)))
    return subprocess.run([sys.executable, "-m", "vram", "run", "--gpu", "H200", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, cwd=REPO, timeout=900)


@pytest.mark.skipif(find_spec("triton") is None, reason="needs triton (the 'compile' extra)")
@pytest.mark.slow  # two runs of two ranks, one compiling: about two minutes
def test_tensor_parallel_layers_under_compile_run_to_the_end(tmp_path) -> None:
    """The compiled run ends as on a GPU, says once per rank what runs eagerly, and (its graphs
    running eagerly) makes the eager run's peaks."""
    compiled, eager = _run(tmp_path, True), _run(tmp_path, False)
    assert compiled.returncode == 0, compiled.stdout[-3000:] + compiled.stderr[-3000:]
    assert eager.returncode == 0, eager.stderr[-3000:]
    out = compiled.stdout + compiled.stderr
    assert out.count("runs eagerly") == 2 and "Traceback" not in out, out[-3000:]
    peaks = [line for line in (compiled.stdout + eager.stdout).splitlines() if "peaks" in line]
    assert len(peaks) == 2 and peaks[0].split("peaks")[1] == peaks[1].split("peaks")[1], peaks
