"""cuDNN convolutions and training batch norm as a real H200 runs them.

Expectations: the H200 recording ``shared/gpu-truth/h200-2026-11-27`` (torch 2.11.0+cu130, program
``conv_caps.py``: torchvision resnet18, channels_last, float16 autocast + GradScaler, two steps) and
its ``figures.jsonl`` peaks; the layouts and the OOM fallback from PyTorch's source
(``aten/src/ATen/native/cudnn/ConvShared.cpp``, ``Conv_v8.cpp`` ``run_single_conv`` / ``try_configs``).
"""
from __future__ import annotations

import pickle
import runpy
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from paths import GPU_TRUTH, H200, truth_figures, truth_recording  # noqa: E402
from vram.run.runtime import simulated_cuda  # noqa: E402

CL = torch.channels_last
#: the stem convolution of resnet18 at batch 64: the H200 asked a 25,715,216-byte forward workspace
STEM_X, STEM_W, STEM_WS = (64, 3, 224, 224), (64, 3, 7, 7), 25_715_216


def _events(snapshot: dict) -> list[tuple[str, int]]:
    return [(e["action"], e["size"]) for e in snapshot["device_traces"][0]
            if e["action"] in ("alloc", "free_completed", "segment_alloc", "oom")]


def _stem(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.conv2d(x, w, stride=2, padding=3)


def test_output_takes_channels_last_when_input_or_weight_has_it() -> None:
    """``cudnn_conv_suggest_memory_format``: channels_last when either operand is; the backward's
    grad_input follows (grad_output, weight), grad_weight (input, grad_output). (A hook sees the
    gradient before AccumulateGrad restrides it to the leaf's layout.)"""
    with simulated_cuda(gpu="H200"):
        x = torch.randn(2, 3, 16, 16, device="cuda", requires_grad=True)
        w = torch.randn(8, 3, 3, 3, device="cuda").to(memory_format=CL).requires_grad_()
        seen: list[torch.Tensor] = []
        x.register_hook(seen.append)
        y = torch.nn.functional.conv2d(x, w)
        assert y.is_contiguous(memory_format=CL) and not y.is_contiguous()
        y.sum().backward()
        assert seen[0].is_contiguous(memory_format=CL) and not seen[0].is_contiguous()
        plain = torch.nn.functional.conv2d(x.detach(), w.detach().contiguous())
        assert plain.is_contiguous()
        # a contiguous incoming gradient is first made the input's layout (grad_output.to(
        # input.suggest_memory_format())), so grad_input is channels_last with a contiguous weight
        xc = torch.randn(2, 3, 16, 16, device="cuda").to(memory_format=CL).requires_grad_()
        seen.clear()
        xc.register_hook(seen.append)
        yc = torch.nn.functional.conv2d(xc, w.detach().contiguous())
        yc.backward(torch.ones(yc.shape, device="cuda"))
        assert seen[0].is_contiguous(memory_format=CL) and not seen[0].is_contiguous()
        # cudnn_convolution_transpose_backward_input, the transposed forward: the same rule
        wt = torch.randn(3, 8, 3, 3, device="cuda").to(memory_format=CL)
        up = torch.nn.functional.conv_transpose2d(x.detach(), wt)
        assert up.is_contiguous(memory_format=CL) and not up.is_contiguous()


def test_workspace_follows_the_output_and_is_freed_on_return() -> None:
    """``run_conv_plan``: the output first (``cudnn_convolution``), then the plan's workspace, freed
    when the call returns: the H200's resnet18 stem asked 25,715,216 B."""
    with simulated_cuda(gpu="H200"):
        x = torch.empty(STEM_X, device="cuda", dtype=torch.half, memory_format=CL)
        w = torch.empty(STEM_W, device="cuda", dtype=torch.half, memory_format=CL)
        torch.cuda.memory._record_memory_history()
        y = _stem(x, w)
        ev = _events(torch.cuda.memory._snapshot())
        out = y.numel() * 2
        assert [e for e in ev if e[0] != "segment_alloc"] == [("alloc", out), ("alloc", STEM_WS),
                                                             ("free_completed", STEM_WS)]


def test_an_input_not_in_the_weights_layout_is_copied_for_the_call() -> None:
    """``_convolution`` passes ``input.contiguous(backend_memory_format)`` to ``cudnn_convolution``,
    which then allocates the output: a contiguous input and a channels_last weight cost a copy of
    the input, freed when the call returns."""
    with simulated_cuda(gpu="H200"):
        x = torch.empty(4, 16, 32, 32, device="cuda")
        w = torch.empty(8, 16, 3, 3, device="cuda", memory_format=CL)
        torch.cuda.memory._record_memory_history()
        y = torch.nn.functional.conv2d(x, w)
        ev = [e for e in _events(torch.cuda.memory._snapshot()) if e[0] != "segment_alloc"]
        xb = 4 * 16 * 32 * 32 * 4
        assert ev == [("alloc", xb), ("alloc", y.numel() * 4), ("free_completed", xb)]


def test_backward_copies_in_cudnn_convolution_backwards_order() -> None:
    """``convolution_backward`` (Cudnn): ``input.contiguous(fmt)`` when grad_weight is wanted;
    ``cudnn_convolution_backward``: ``grad_output.to(input.suggest_memory_format())``; backward-data:
    grad_input, then the weight and grad_output copies, dying when it returns (grad_output's
    first); backward-filter: grad_output and input copies, then grad_weight; then the ``.to`` copy,
    then the input copy die."""
    from vram.run.kernels.cudnn_conv import conv_plan

    g = torch.empty(2, 8, 6, 6, device="meta")                       # contiguous grad_output
    x = torch.empty(2, 4, 8, 8, device="meta")                       # contiguous input
    w = torch.empty(8, 4, 3, 3, device="meta", memory_format=CL)     # channels_last weight
    outs = [torch.empty(2, 4, 8, 8, device="meta"), torch.empty(8, 4, 3, 3, device="meta"), None]
    plan = [s for s in conv_plan("convolution_backward", (g, x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
                                                           [True, True, False]), outs, (8, 6)) if s[0] != "note"]
    xb, gb = x.numel() * 4, g.numel() * 4
    assert plan == [("tmp", xb),                          # 0: input.contiguous(channels_last)
                    ("tmp", gb),                          # 1: grad_output.to(channels_last)
                    ("out", 0),                           # grad_input (channels_last: grad_output's)
                    ("cudnn", (plan[3][1][0], 0)), ("free", 2),   # workspace (estimated: sm86)
                    ("out", 1), ("cudnn", (plan[6][1][0], 0)), ("free", 3),
                    ("free", 1), ("free", 0), ("out", 2)]


def test_a_workspace_that_does_not_fit_is_a_survived_oom() -> None:
    """``try_configs`` catches ``c10::OutOfMemoryError`` and runs the next engine config (modelled
    as needing no workspace); the allocator's OOM path has counted ``num_ooms`` and recorded the
    ``oom`` event. The plan that ran is cached: the same call again does not OOM."""
    # input 20 MiB + weight 2 MiB + output 98 MiB segments: 120 of 140 MiB; the workspace needs 26
    with simulated_cuda(gpu="140MiB"):
        x = torch.empty(STEM_X, device="cuda", dtype=torch.half, memory_format=CL)
        w = torch.empty(STEM_W, device="cuda", dtype=torch.half, memory_format=CL)
        torch.cuda.memory._record_memory_history()
        y = _stem(x, w)
        assert torch.cuda.memory_stats()["num_ooms"] == 1
        assert [a for a, _ in _events(torch.cuda.memory._snapshot())].count("oom") == 1
        del y
        y = _stem(x, w)
        assert torch.cuda.memory_stats()["num_ooms"] == 1
        blocks = [-(-t.numel() * 2 // 512) * 512 for t in (x, w, y)]  # requests round up to 512 B
        assert torch.cuda.max_memory_allocated() == sum(blocks)


def test_a_cached_plan_whose_workspace_no_longer_fits_ooms_twice() -> None:
    """``run_single_conv``: the cached plan is tried first (OOM caught), then the heuristics'
    configs, whose first is the same engine (a second OOM), then the next one."""
    with simulated_cuda(gpu="180MiB"):
        x = torch.empty(STEM_X, device="cuda", dtype=torch.half, memory_format=CL)
        w = torch.empty(STEM_W, device="cuda", dtype=torch.half, memory_format=CL)
        y = _stem(x, w)  # 20 + 2 + 98 + 26 MiB: fits; the plan is cached
        assert torch.cuda.memory_stats()["num_ooms"] == 0
        del y
        torch.cuda.empty_cache()
        filler = torch.empty(40 << 20, dtype=torch.uint8, device="cuda")  # 22 + 40 + 98 + 26 > 180
        y = _stem(x, w)
        assert torch.cuda.memory_stats()["num_ooms"] == 2
        del y
        y = _stem(x, w)
        assert torch.cuda.memory_stats()["num_ooms"] == 2
        del y, filler


def test_a_batch_norm_workspace_that_does_not_fit_is_fatal() -> None:
    """``cudnn_batch_norm`` takes its workspace with ``at::empty`` and catches nothing: the H200's
    2,590,364-byte workspace for [64, 64, 112, 112] (a 20 MiB segment) does not fit beside the
    98 MiB input, the 98 MiB output and the statistics' 2 MiB small segment on 200 MiB."""
    with simulated_cuda(gpu="200MiB"):
        bn = torch.nn.BatchNorm2d(64).cuda()
        x = torch.empty(64, 64, 112, 112, device="cuda", dtype=torch.half, memory_format=CL)
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 20.00 MiB"):
            bn(x)


def test_a_convolution_outside_the_table_is_charged_nothing_and_named() -> None:
    from vram.run.runtime import active_sim

    with simulated_cuda(gpu="H200"):
        x = torch.randn(2, 3, 16, 16, device="cuda")
        w = torch.randn(8, 3, 3, 3, device="cuda")
        torch.cuda.memory._record_memory_history()
        y = torch.nn.functional.conv2d(x, w)
        assert y.shape == (2, 8, 14, 14)
        assert [a for a, _ in _events(torch.cuda.memory._snapshot()) if a != "segment_alloc"] == ["alloc"]
        sim = active_sim()
        assert sim is not None and sum(n for what, n in sim.uncharged.items() if "cuDNN workspaces" in what) == 1


@pytest.mark.skipif(not (H200 / "recordings.tar.xz").exists(), reason="needs shared/gpu-truth beside the clone")
def test_resnet18_step_is_the_h200s(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Both peaks are the H200's, and every allocation, free and segment of the two steps comes in
    the recording's order and size, the frees of the script's globals at its end included."""
    pytest.importorskip("torchvision")
    real = _events(pickle.loads(truth_recording("conv_caps_0", tmp_path).read_bytes()))
    fig = truth_figures("conv_caps_0")
    argv = sys.argv
    with simulated_cuda(gpu="H200"):
        torch.cuda.memory._record_memory_history(stacks="python")
        try:
            sys.argv = ["conv_caps.py"]
            runpy.run_path(str(GPU_TRUTH / "conv_caps.py"), run_name="__main__")
        finally:
            sys.argv = argv
        got = _events(torch.cuda.memory._snapshot())
        peaks = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    assert peaks == (fig["max_allocated"], fig["max_reserved"]) == (998_643_200, 1_249_902_592)
    assert got == real
    assert capsys.readouterr().out.startswith("end 998643200 1249902592 0")
