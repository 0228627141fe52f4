"""``vram.estimate(model, inputs, layout=...)``: the Python API's multi-GPU layouts, the
same layouts as ``vram estimate --ddp/--fsdp/--tp/--pp``. The expected figure is the training loop
written by hand (`tests/distributed_programs/estimate_equivalent.py`) under ``vram run
--nproc-per-node``, as in tests/test_estimate_distributed.py."""
from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")

import vram  # noqa: E402
from test_estimate_distributed import by_hand  # noqa: E402
from test_fsdp import PROGRAMS, ROOT  # noqa: E402
from vram.estimate.layout import Layout  # noqa: E402
from vram.units import format_size  # noqa: E402


@pytest.fixture
def programs(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.chdir(PROGRAMS)
    monkeypatch.syspath_prepend(str(PROGRAMS))
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "src"))
    import tiny_stack
    return tiny_stack


@pytest.mark.slow
def test_fsdp_layout_from_python_equals_the_run_by_hand(programs: Any) -> None:
    got = vram.estimate(programs.stack, torch.Size([64, 256]), layout={"fsdp": 2})
    assert got.layout == Layout(fsdp=2) and sorted(got.coords) == [0, 1]
    assert got.stands_for == {0: [0, 1]}          # even shards: one rank stands for both
    hand = by_hand("fsdp", 2)
    assert {r: got.result_of(r).peak_allocated for r in (0, 1)} == hand
    same = vram.estimate("tiny_stack:stack", torch.empty(64, 256), layout=Layout(fsdp=2))
    assert same.result_of(1).peak_allocated == hand[1]
    named = vram.estimate(programs.stack, {"x": torch.Size([64, 256])}, layout={"fsdp": 2})
    assert named.result_of(0).peak_allocated == hand[0]  # forward(x=...) is forward(...) here
    # nvidia-smi per rank: reserved + context (0 here) + NCCL's 196 MiB of bookkeeping and a
    # 24-channel ring of 12 MiB per channel (vram.devices.nccl), in the table and in the rank's report
    smi = got.result_of(0).peak_reserved + (196 + 24 * 12) * 2**20
    assert got.nvidia_smi(0) == got.nvidia_smi(1) == smi
    text = str(got).split("=== rank 0")[1]
    assert f"nvidia-smi peak {format_size(smi)}" in text and f"NCCL + others): {format_size(smi)}" in text


class Local(torch.nn.Module):
    pass


def local_factory() -> torch.nn.Module:
    return Local()


local_factory.__module__ = "__main__"


@pytest.mark.parametrize("model, kw, message", [
    (lambda: Local(), {}, "module-level factory function"),
    (Local(), {}, "not an nn.Module"),
    (local_factory, {}, "defined in __main__"),
    ("tiny_stack:stack", {"step": print}, "step=<built-in function print> cannot be sent"),
    ("tiny_stack:stack", {"layout": 2}, "layout must be a vram.estimate.layout.Layout"),
    ("tiny_stack:stack", {"layout": {"tp": 2}}, "--tp needs --tp-plan"),
    ("tiny_stack:stack", {"layout": {"pp": 2}, "example_inputs": {"x": torch.Size([64, 256])}}, "name no --input"),
], ids=["lambda", "instance", "main", "callable-setting", "bad-layout", "tp-without-plan", "pp-named"])
def test_what_cannot_reach_the_ranks_is_a_one_line_error(programs: Any, model: Any, kw: dict[str, Any],
                                                         message: str) -> None:
    kw = {"layout": {"fsdp": 2}, **kw}
    inputs = kw.pop("example_inputs", torch.Size([64, 256]))
    with pytest.raises((ValueError, TypeError)) as e:
        vram.estimate(model, inputs, **kw)
    assert message in str(e.value) and "\n" not in str(e.value)
