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


def test_roi_align_on_the_host_samples_a_bounded_group_of_rois_at_a_time(monkeypatch) -> None:
    """Adaptive sampling (``sampling_ratio=0``) samples each of the 7 × 7 bins at every row and
    column of the input: 3 × 49 × 60 × 50 floats (1.7 MiB) per roi. With a 4 MiB bound, two rois
    per call of torchvision's ``_roi_align``; the outputs are those of one call, bit for bit."""
    from vram.run.cuda import vision_ops
    from vram.run.cuda.compat import define_torchvision_ops

    define_torchvision_ops()
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(2, 3, 60, 50, generator=gen)
    rois = torch.cat([torch.randint(0, 2, (37, 1), generator=gen).float(), torch.rand(37, 2, generator=gen) * 20,
                      20 + torch.rand(37, 2, generator=gen) * 30], 1)
    whole = vision_ops._roi_align_python()(x, rois, 1.0, 7, 7, 0, False)
    python, groups = vision_ops._roi_align_python(), []

    def counted(inp, r, *rest):
        groups.append(r.size(0))
        return python(inp, r, *rest)
    monkeypatch.setattr(vision_ops, "_roi_align_python", lambda: counted)
    monkeypatch.setattr(vision_ops, "ROI_SAMPLES_BYTES", 4 << 20)
    out = vision_ops.roi_align_cpu(x, rois, 1.0, 7, 7, 0, False)
    assert torch.equal(out, whole)
    assert groups == [2] * 18 + [1]
