"""``vram estimate --compile`` / ``estimate(compile=)``: the model trained under ``torch.compile``
as ``vram run`` runs it (docs/estimate-accuracy.md §8), with estimate's per-module hooks off so
that Dynamo traces whole graphs."""
from __future__ import annotations

import re
from importlib.util import find_spec
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from compiled_runs import vram_run  # noqa: E402
from vram.estimate import estimate  # noqa: E402


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))


def test_compile_mode_and_what_it_cannot_go_with_are_refused() -> None:
    with pytest.raises(ValueError, match="not a torch.compile mode"):
        estimate(_mlp, torch.Size([2, 1024]), compile="fastest")
    with pytest.raises(ValueError, match="compile with checkpoint is not modelled"):
        estimate(_mlp, torch.Size([2, 1024]), compile="default", checkpoint=True)


_BY_HAND = '''
import torch
m = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
opt = torch.optim.Adam(m.parameters(), lr=1e-3)
step = torch.compile(m)
x = None
for i in range(3):
    x = torch.empty(256, 1024, device="cuda")  # the new batch, then the old one dies
    step(x).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
print("peaks", torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
'''


@pytest.mark.slow  # compiles in the compile process: about two minutes with the run by hand
def test_estimate_compile_is_the_compiled_script_run_by_hand(tmp_path: Path) -> None:
    """estimate's default step (a new batch each step, the sum of the outputs, Adam, grads set
    to None) under ``compile="default"`` peaks where ``vram run`` of the same compiled step
    written by hand does; Dynamo traces it without a graph break (estimate's global module
    hooks would break it at every module); what the compiled forward saves for the backward
    counts as activations, by "(compiled model)"."""
    if find_spec("triton") is None:
        pytest.skip("needs triton (the 'compile' extra)")
    from torch._dynamo.utils import counters

    counters.clear()
    result = estimate(_mlp, torch.Size([256, 1024]), gpu="H200", compile="default")
    assert not counters["graph_break"]
    assert result.settings["compile"] == "default"
    assert result.forward_end["activations"] > 0
    assert "(compiled model)" in result.forward_end_by_module  # (the batch itself: outside any module)
    script = tmp_path / "by_hand.py"
    script.write_text(_BY_HAND, encoding="utf-8")
    done = vram_run(script, tmp_path / "by_hand.pickle")
    found = re.search(r"^peaks (\d+) (\d+)$", done.stdout, re.M)
    assert found is not None, done.stdout
    assert (max(result.first_peak_allocated, result.peak_allocated),
            max(result.first_peak_reserved, result.peak_reserved)) == (int(found[1]), int(found[2]))
