"""``vram estimate --compile`` / ``estimate(compile=)``: the model trained under ``torch.compile``
as ``vram run`` runs it (docs/estimate-accuracy.md §8), with estimate's per-module hooks off so
that Dynamo traces whole graphs."""
from __future__ import annotations

import functools
import pickle
import re
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from compiled_runs import vram_run  # noqa: E402
from vram.estimate import estimate  # noqa: E402


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))


def test_compile_mode_and_what_it_cannot_go_with_are_refused() -> None:
    with pytest.raises(ValueError, match="not a torch.compile mode"):
        estimate(_mlp, torch.Size([2, 1024]), compile="fastest")
    with pytest.raises(ValueError, match="compile with a multi-GPU layout"):
        estimate(_mlp, torch.Size([2, 1024]), compile="default", parallel=object())


def _stack_module(folder: Path) -> Any:
    """`_STACK` written to `folder` and imported (the by-hand script imports the same file)."""
    import importlib.util

    (folder / "stack.py").write_text(_STACK, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("stack_under_test", folder / "stack.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dynamo_sources_of_a_checkpointed_stack_name_its_modules(tmp_path: Path) -> None:
    """The nn_module_stack Dynamo records for a stack whose blocks estimate checkpoints
    (``functools.partial(checkpoint, forward)``) travels to the compile process with each node,
    and its sources lead back from the compiled model to the module of that class; a source of
    another class, or from another frame's ``self``, names nothing."""
    from torch.utils.checkpoint import checkpoint

    from vram.estimate.trace import module_at_source
    from vram.run.compile.graph_transport import graph_module, graph_nodes

    stack = _stack_module(tmp_path).Stack(n=2)
    for block in stack.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    graphs: list[Any] = []

    def capture(gm: Any, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch.compile(stack, backend=capture)(torch.randn(4, 256))
    (gm,) = graphs
    sent = graph_module(graph_nodes(gm.graph, gm))
    body = sent.wrap_body_1.graph  # block 1's checkpointed region
    modules = {n.name: list(n.meta["nn_module_stack"].values()) for n in body.nodes if "nn_module_stack" in n.meta}
    up_source, up_class = modules["linear"][0]
    assert (up_source, up_class) == ("L['self'].blocks.1.forward.args[0].__self__.up", "torch.nn.modules.linear.Linear")
    assert module_at_source(stack, up_source, up_class) is stack.blocks[1].up
    block_source, block_class = modules["add"][0]  # the residual sum: the block's own op
    assert module_at_source(stack, block_source, block_class) is stack.blocks[1]
    assert module_at_source(stack, up_source, "torch.nn.modules.activation.ReLU") is None
    assert module_at_source(stack, "L['self'].up", up_class) is None  # a block's frame: its own self
    assert module_at_source(stack, "L['mod'].blocks.0", block_class) is None


_STACK = '''
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    """A pre-norm residual MLP block: x + down(relu(up(norm(x))))."""

    def __init__(self, d=256):
        super().__init__()
        self.norm, self.up, self.act, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.ReLU(), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(self.act(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, checkpointed=False, d=256, n=3):
        super().__init__()
        self.checkpointed = checkpointed
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.checkpointed else b(x)
        return x
'''
_STACK_BY_HAND = '''
import sys
sys.path.insert(0, sys.argv[1])
import torch
from stack import Stack
m = Stack(checkpointed="--checkpoint" in sys.argv).cuda()
opt = torch.optim.Adam(m.parameters(), lr=1e-3)
step = torch.compile(m)
x = None
for i in range(3):
    x = torch.empty(512, 256, device="cuda")  # the new batch, then the old one dies
    step(x).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
print("peaks", torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
'''


def _events(snapshot: dict[str, Any]) -> list[tuple[str, int, int]]:
    return [(e["action"], e["addr"], e["size"]) for e in snapshot["device_traces"][0]]


@pytest.mark.slow  # compiles in the compile process: about two minutes with the runs by hand
@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpoint"])
def test_estimate_compile_makes_the_allocations_of_the_script_by_hand(tmp_path: Path, checkpoint: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``estimate(compile="default")`` of a 3-block residual MLP stack, with and without
    ``checkpoint=True`` (each block of its ModuleList in non-reentrant ``torch.utils.checkpoint``),
    makes the allocations and frees, in order, at the addresses and of the sizes, that ``vram run``
    of the same compiled step written by hand makes (a new batch each step, the sum of the
    outputs, Adam, grads set to None; ``checkpoint(block, x, use_reentrant=False)`` in the
    model's forward), and so peaks where it does: estimate's checkpointing and its saved-tensor
    hook leave the traced program as the user's. Dynamo traces one graph (estimate's global
    module hooks would break it at every module; checkpointed blocks are its
    ``tag_activation_checkpoint`` regions). At the end of the forward the activations are what
    the compiled graph saved for the backward, each by the innermost module of the graph node
    that made it, the batch outside any module; with checkpointing, only each block's input."""
    if find_spec("triton") is None:
        pytest.skip("needs triton (the 'compile' extra)")
    from torch._dynamo.utils import counters

    from vram.estimate import engine

    module = _stack_module(tmp_path)
    runs: list[Any] = []

    def recorded(*args: Any, **kwargs: Any) -> Any:
        runs.append(real_run(*args, **{**kwargs, "record": True}))
        return runs[-1]

    real_run = engine._run
    monkeypatch.setattr(engine, "_run", recorded)
    counters.clear()
    result = estimate(module.Stack, torch.Size([512, 256]), gpu="H200", compile="default", checkpoint=checkpoint)
    assert not counters["graph_break"]
    assert result.settings["compile"] == "default" and result.settings["checkpoint"] is checkpoint
    batch = 512 * 256 * 4
    by_module = result.forward_end_by_module
    assert sum(by_module.values()) == result.forward_end["activations"]
    if checkpoint:  # each block's input: the batch, then the residual sums of blocks 0 and 1
        assert by_module == {"(outside any module)": batch, "blocks.0": batch, "blocks.1": batch}
    else:  # what each block's compiled ops save, by the module of the op (ReLU's output, 4 x the batch);
        # a node no module made (the compile's own) leaves its tensor to the compiled model
        assert by_module["(outside any module)"] == batch
        assert {f"blocks.{i}.act": 4 * batch for i in range(3)}.items() <= by_module.items()
        assert set(by_module) <= {"(outside any module)", "(compiled model)",
                                  *(f"blocks.{i}{s}" for i in range(3) for s in ("", ".norm", ".up", ".act", ".down"))}
    script = tmp_path / "by_hand.py"
    script.write_text(_STACK_BY_HAND, encoding="utf-8")
    done = vram_run(script, tmp_path / "by_hand.pickle", str(tmp_path), *(["--checkpoint"] if checkpoint else []))
    found = re.search(r"^peaks (\d+) (\d+)$", done.stdout, re.M)
    assert found is not None, done.stdout
    assert (max(result.first_peak_allocated, result.peak_allocated),
            max(result.first_peak_reserved, result.peak_reserved)) == (int(found[1]), int(found[2]))
    with open(tmp_path / "by_hand.pickle", "rb") as f:
        by_hand = _events(pickle.load(f))  # noqa: S301 - written by the run above
    (run,) = runs
    estimated = _events(run.snapshot)
    # estimate ends by dropping the last batch; the script's snapshot is taken before its batch dies
    assert estimated[:len(by_hand)] == by_hand
    assert [(a, size) for a, _, size in estimated[len(by_hand):]] == [("free_requested", batch),
                                                                      ("free_completed", batch)]
