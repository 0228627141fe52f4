"""A default run that meets a data-dependent shape goes on with real values
(`vram.run.values.rerun`): the script runs again with ``--values real``, stderr says so once, and
the output printed before is not printed twice.

The program is a GCN layer in plain torch, as PyG's ``GCNConv`` computes it: self loops removed
with a boolean mask over ``edge_index`` (``add_remaining_self_loops``), added back, symmetric
degree normalisation, messages summed with ``index_add_``. Its edge index (2 x 40,000 int64) is
larger than a default run keeps values of, so ``ei[:, mask]`` has a shape the default run cannot
know. The expected losses are the same program's on the CPU.
"""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from vram.run.values import rerun  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

PROGRAM = '''
import torch
import torch.nn as nn

torch.manual_seed(0)
N, E, F, H, C = 2000, 40000, 16, 16, 5
x, edge_index, y = torch.randn(N, F), torch.randint(0, N, (2, E)), torch.randint(0, C, (N,))
print("graph", N, "nodes", E, "edges")


class GCN(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(F, H), nn.Linear(H, C)

    def prop(self, h, ei):
        ei = ei[:, ei[0] != ei[1]]
        loops = torch.arange(h.size(0), device=h.device)
        ei = torch.cat([ei, torch.stack([loops, loops])], 1)
        deg = torch.zeros(h.size(0), device=h.device).index_add_(0, ei[1], torch.ones(ei.size(1), device=h.device))
        norm = deg.pow(-0.5)[ei[0]] * deg.pow(-0.5)[ei[1]]
        return torch.zeros_like(h).index_add_(0, ei[1], h[ei[0]] * norm[:, None])

    def forward(self, x, ei):
        return self.l2(self.prop(self.l1(x).relu(), ei))


dev = DEVICE
model = GCN().to(dev)
opt = torch.optim.Adam(model.parameters(), lr=0.01)
x, edge_index, y = x.to(dev), edge_index.to(dev), y.to(dev)
for step in range(2):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x, edge_index), y)
    loss.backward()
    opt.step()
    print("loss", loss.item())
'''


def test_a_data_dependent_shape_reruns_with_real_values_printing_once(tmp_path: Path) -> None:
    script = tmp_path / "gcn.py"
    script.write_text(PROGRAM.replace("DEVICE", '"cuda"'))
    cpu = io.StringIO()
    saved = sys.stdout
    sys.stdout = cpu
    try:
        exec(compile(PROGRAM.replace("DEVICE", '"cpu"'), "gcn_cpu", "exec"), {})
    finally:
        sys.stdout = saved
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run([sys.executable, "-m", "vram", "run", str(script)], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stderr.count("running the script again with --values real") == 1
    assert "ei[:, ei[0] != ei[1]] needs tensor values" in r.stderr
    assert r.stdout == cpu.getvalue()       # "graph ..." once, then the CPU's losses


def test_the_second_attempt_holds_back_what_was_printed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "printed.txt"
    path.write_text("a\nb\n")
    saved = sys.stdout
    try:
        rerun.skip_printed(str(path))
        print("a")
        print("b")
        print("c")
    finally:
        sys.stdout = saved
    assert capsys.readouterr().out == "c\n" and not path.exists()
    path.write_text("a\nb\n")
    try:
        rerun.skip_printed(str(path))
        print("a")
        print("x")          # differs: from here on everything is printed
        print("b")
    finally:
        sys.stdout = saved
    assert capsys.readouterr().out == "x\nb\n"
