"""Host memory of a real-values run: freed value copies go back to the system, and a run short
of host memory stops with one line.

Expectations from glibc's malloc (malloc/malloc.c): a freed chunk that was mapped on its own
is unmapped at once; a chunk from the heap stays in the process while a live chunk sits above
it. A real-values run keeps a CPU copy of each live simulated storage, so once the script
drops its tensors, what the process holds must come back to where it was (within a few MiB),
even when small live tensors were allocated between the large ones.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from vram.run.runtime import run_script  # noqa: E402

#: 64 value copies of 2 MiB, each followed by a small one that stays live; the copies of the
#: 2 MiB tensors are freed. A 16 MiB copy freed first raises glibc's dynamic mmap threshold to
#: 16 MiB, as a large activation's does in a training run.
SCRIPT = """\
import torch

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS"))

del_me = torch.ones(1 << 22, device="cuda") * 2
del del_me
before = rss()
big, small = [], []
for i in range(64):
    big.append(torch.ones(1 << 19, device="cuda") * 2)
    small.append(torch.ones(16, device="cuda") * 2)
held = rss() - before
del big
print("held", held >> 20, "MiB; kept after del", (rss() - before) >> 20, "MiB")
"""


def test_freed_value_copies_go_back_to_the_system(tmp_path: Path) -> None:
    path = tmp_path / "copies.py"
    path.write_text(SCRIPT)
    code = f"from vram.run.runtime import run_script; raise SystemExit(run_script({str(path)!r}, [], values='real'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()
    held, kept = int(words[1]), int(words[6])
    assert held >= 128  # the 2 MiB copies were live (64 × 2 MiB)
    assert kept < 16, out.stdout


CANNOT = """\
import torch
lib = torch.library.Library("vramhh", "DEF")
lib.define("grow(Tensor x) -> Tensor")
lib.impl("grow", lambda x: torch.empty_like(x), "Meta")
def cpu(x):
    raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                       "memory: you tried to allocate 1099511627776 bytes. Error code 12 (Cannot allocate memory)")
lib.impl("grow", cpu, "CPU")
x = torch.ones(1000, device="cuda")
y = torch.ops.vramhh.grow(x)
print("value", y.sum().item())
"""


def test_a_cpu_kernel_short_of_host_memory_stops_the_run_in_one_line(tmp_path: Path, capsys) -> None:
    """A CPU allocation that fails is no unknown value (answered with a placeholder): the run
    stops, saying what its copies hold and what is available."""
    path = tmp_path / "grow.py"
    path.write_text(textwrap.dedent(CANNOT))
    assert run_script(str(path), [], values="real") == 1
    captured = capsys.readouterr()
    assert "value" not in captured.out
    err = captured.err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("vram run: --values real: vramhh.grow") and "could not allocate host memory" in err[0]
    assert "the CPU copies of the simulated GPU's values hold 0 MiB" in err[0] and "is available" in err[0]


def test_roi_align_on_the_host_is_the_cuda_kernel_roi_by_roi() -> None:
    """``roi_align_forward_kernel_impl`` (torchvision/csrc/ops/cuda/roi_align_kernel.cu): each
    bin the mean of its bilinear samples, a sample beyond [-1, size] counting 0. Rois inside the
    map: what torchvision's Python ``_roi_align`` gives (bit for bit with a fixed sampling ratio;
    with adaptive sampling it sums a grid padded with zeros, in another order: to 1e-6). A 1 × 1 bin over x in
    [-4, 4] of a map of ones, 2 × 2 samples: x = -2 (outside: 0) and x = 2 (1), so 0.5. And a Mask
    R-CNN target mask (one roi, 28 × 28, adaptive sampling over a 320 × 320 mask) no longer
    samples every row and column per bin: well under a second."""
    import time

    from vram.run.cuda import vision_ops
    from vram.run.cuda.compat import define_torchvision_ops

    define_torchvision_ops()
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(2, 3, 60, 50, generator=gen)
    starts, sizes = torch.rand(37, 2, generator=gen) * 20, 1 + torch.rand(37, 2, generator=gen) * 70
    rois = torch.cat([torch.randint(0, 2, (37, 1), generator=gen).float(), starts, starts + sizes], 1)
    for ratio in (0, 2):
        for aligned in (False, True):
            expected = vision_ops._roi_align_python()(x, rois, 0.5, 7, 7, ratio, aligned)
            out = vision_ops.roi_align_cpu(x, rois, 0.5, 7, 7, ratio, aligned)
            assert torch.equal(out, expected) if ratio else torch.allclose(out, expected, rtol=0, atol=1e-6)
    ones = torch.ones(1, 1, 8, 8)
    out = vision_ops.roi_align_cpu(ones, torch.tensor([[0.0, -4.0, 2.0, 4.0, 6.0]]), 1.0, 1, 1, 2, False)
    assert out.item() == 0.5
    mask = (torch.rand(1, 1, 320, 320, generator=gen) > 0.5).float()
    t = time.perf_counter()
    vision_ops.roi_align_cpu(mask, torch.tensor([[0.0, 10.0, 20.0, 200.0, 220.0]]), 1.0, 28, 28, 0, False)
    assert time.perf_counter() - t < 5  # the whole-grid sampling took 18 s and 3.5 GiB
