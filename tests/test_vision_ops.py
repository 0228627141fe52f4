"""torchvision's C++ operators next to a CPU torch (its PyPI wheel is CUDA's): detection models call
``torchvision.ops.nms`` and ``roi_align`` as on a GPU, on simulated tensors and on the host.

Expectations: the greedy suppression of ``csrc/ops/cpu/nms_kernel.cpp`` written out here as loops;
``roi_align`` of a linear feature map, whose bilinear samples are exact (hand-computed); the CUDA
kernels' allocations (``roi_align_kernel.cu``: the output ``zeros({K, C, PH, PW})`` forward,
``grad_input`` of the input's shape backward; spec §4: blocks of 512 bytes)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from vram.run.cuda.compat import define_torchvision_ops  # noqa: E402
from vram.run.runtime import simulated_cuda  # noqa: E402

define_torchvision_ops()
tv_ops = pytest.importorskip("torchvision.ops")


def _greedy_nms(boxes: list[list[float]], scores: list[float], thr: float) -> list[int]:
    order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable, descending
    area = [(b[2] - b[0]) * (b[3] - b[1]) for b in boxes]
    suppressed, keep = set(), []
    for pos, i in enumerate(order):
        if i in suppressed:
            continue
        keep.append(i)
        for j in order[pos + 1:]:
            w = max(0.0, min(boxes[i][2], boxes[j][2]) - max(boxes[i][0], boxes[j][0]))
            h = max(0.0, min(boxes[i][3], boxes[j][3]) - max(boxes[i][1], boxes[j][1]))
            if w * h / (area[i] + area[j] - w * h) > thr:
                suppressed.add(j)
    return keep


BOXES = [[0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30], [0, 0, 10, 9], [21, 21, 29, 31], [50, 50, 52, 52]]
SCORES = [0.9, 0.8, 0.7, 0.95, 0.7, 0.1]


def test_torchvision_has_its_ops_and_nms_is_the_cpu_kernels() -> None:
    from torchvision.extension import _has_ops

    assert _has_ops()
    keep = tv_ops.nms(torch.tensor(BOXES, dtype=torch.float32), torch.tensor(SCORES), 0.5)
    assert keep.dtype == torch.long and keep.tolist() == _greedy_nms(BOXES, SCORES, 0.5)
    assert tv_ops.nms(torch.zeros(0, 4), torch.zeros(0), 0.5).shape == (0,)
    # roi_align: one roi over [0, 3] x [0, 3] of a map whose value is 4y + x, aligned (shifted by
    # half a pixel), 2x2 bins of 1.5 pixels, one sample at each bin's centre: (y, x) in {0.25, 1.75}^2
    x = torch.arange(16, dtype=torch.float32).view(1, 1, 4, 4).requires_grad_(True)
    rois = torch.tensor([[0.0, 0.0, 0.0, 3.0, 3.0]])
    out = tv_ops.roi_align(x, rois, (2, 2), spatial_scale=1.0, sampling_ratio=1, aligned=True)
    assert out.flatten().tolist() == [1.25, 2.75, 7.25, 8.75]
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape and x.grad.sum().item() == 4.0


def test_detection_ops_on_the_simulated_gpu() -> None:
    """``nms`` on known values gives the CPU kernel's answer, with the CUDA kernel's temporaries;
    ``roi_align`` allocates its output
    forward and the input's gradient backward, nothing else (no Python fallback's temporaries)."""
    with simulated_cuda(gpu="24GiB"):
        boxes = torch.tensor(BOXES, dtype=torch.float32, device="cuda")
        scores = torch.tensor(SCORES, device="cuda")
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        keep = tv_ops.nms(boxes, scores, 0.5)
        assert keep.is_cuda and keep.tolist() == _greedy_nms(BOXES, SCORES, 0.5)
        # nms_kernel.cu: order_t, dets_sorted, the mask (6 x 1 words), the kept positions and the
        # output live at once (the sorted scores died before), each a 512-byte block; then the output
        assert torch.cuda.max_memory_allocated() - before == 5 * 512
        assert torch.cuda.memory_allocated() - before == 512
        del boxes, scores, keep
        feat = torch.empty(2, 256, 50, 50, device="cuda", requires_grad=True)  # 2,560,000 bytes
        rois = torch.tensor([[0, 0.0, 0.0, 20.0, 20.0]] * 100 + [[1, 5.0, 5.0, 40.0, 30.0]] * 28, device="cuda")
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = tv_ops.roi_align(feat, rois, (7, 7), spatial_scale=0.5, sampling_ratio=2)
        assert out.shape == (128, 256, 7, 7)
        out_bytes = 128 * 256 * 49 * 4  # 6,422,528: a multiple of 512
        assert torch.cuda.memory_allocated() - before == out_bytes
        assert torch.cuda.max_memory_allocated() - before == out_bytes
        out.sum().backward()
        assert feat.grad is not None and feat.grad.is_cuda and feat.grad.shape == feat.shape

