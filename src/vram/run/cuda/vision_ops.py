"""Kernels for torchvision's C++ operators when its library cannot load (`vram.run.cuda.compat`).

With its operator library loaded, torchvision calls ``torch.ops.torchvision.*`` (``nms``,
``roi_align`` in ``MultiScaleRoIAlign``, ``roi_pool``, ``ps_roi_*``, ``deform_conv2d``), whose
CUDA kernels allocate their outputs (and, for ``nms``, the scratch `vram.run.kernels.vision`
lists), and whose autograd functions (``torchvision/csrc/ops/autograd/*.cpp``) save what each
backward kernel reads. A CPU torch next to torchvision's CUDA wheel has the schemas only
(`compat.TORCHVISION_SCHEMAS`), and torchvision then falls back to Python (``_roi_align``:
the bilinear interpolation as whole tensors, a memory profile no GPU run has) or refuses
(``nms``: "Couldn't load custom C++ ops"). So here the library is given what a GPU run uses:

- *the simulated GPU*: the engine's fallback runs each op's meta kernel (torchvision's
  ``_meta_registrations``); ``nms``'s output size comes from its CPU kernel over the values;
- *autograd*: torchvision's own formulas (``_autograd_registrations.py``: each backward kernel);
- *the host* (a host run, values computed on the CPU): ``nms`` as ``cpu/nms_kernel.cpp`` runs it
  (a stable descending sort of the scores, greedy suppression where IoU > threshold),
  ``roi_align`` as the CUDA kernel computes it, roi by roi (`roi_align_cpu`), and
  ``_roi_align_backward`` as the vector-Jacobian product of torchvision's own Python
  ``_roi_align``. The other ops have no host kernel here: a host call says so.
"""
from __future__ import annotations

import importlib
from typing import Any

import torch


def nms_cpu(dets: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """``torchvision/csrc/ops/cpu/nms_kernel.cpp``: boxes in a stable descending order of score,
    each kept unless a kept one overlaps it with IoU > `iou_threshold` (in the boxes' dtype,
    compared in double)."""
    torch._check(dets.dim() == 2 and dets.size(1) == 4,
                 lambda: f"boxes should have 4 elements in dimension 1, got {dets.size(-1)}")
    torch._check(scores.dim() == 1, lambda: f"scores should be a 1d tensor, got {scores.dim()}D")
    torch._check(dets.size(0) == scores.size(0), lambda: "boxes and scores should have same number of elements in "
                                                         f"dimension 0, got {dets.size(0)} and {scores.size(0)}")
    if dets.numel() == 0:
        return torch.empty(0, dtype=torch.long)
    x1, y1, x2, y2 = (dets[:, i].contiguous() for i in range(4))
    areas = (x2 - x1) * (y2 - y1)
    order = scores.sort(stable=True, dim=0, descending=True)[1]
    xx1 = torch.maximum(x1[order][:, None], x1[order][None, :])
    yy1 = torch.maximum(y1[order][:, None], y1[order][None, :])
    xx2 = torch.minimum(x2[order][:, None], x2[order][None, :])
    yy2 = torch.minimum(y2[order][:, None], y2[order][None, :])
    zero = torch.zeros((), dtype=dets.dtype)
    inter = torch.maximum(zero, xx2 - xx1) * torch.maximum(zero, yy2 - yy1)
    a = areas[order]
    over = (inter / (a[:, None] + a[None, :] - inter)).double() > iou_threshold
    n = dets.size(0)
    suppressed = torch.zeros(n, dtype=torch.bool)
    later = torch.ones(n, n, dtype=torch.bool).triu(1)
    keep = []
    for i in range(n):
        if not suppressed[i]:
            keep.append(i)
            suppressed |= over[i] & later[i]
    return order[torch.tensor(keep, dtype=torch.long)]


def _roi_align_python() -> Any:
    module = importlib.import_module("torchvision.ops.roi_align")  # the package's attribute is the function
    fn = module._roi_align
    return getattr(fn, "__wrapped__", fn)  # the function, not its torch.compile wrapper


def _bilinear_axis(pos: torch.Tensor, size: int) -> tuple[torch.Tensor, ...]:
    """One axis of ``bilinear_interpolate`` (roi_align_kernel.cu): whether each sample lies in
    [-1, size], its low and high indices, and the weights of each."""
    inside = (pos >= -1.0) & (pos <= size)
    pos = pos.clamp_min(0)
    low = pos.to(torch.int64)
    last = low >= size - 1
    low = torch.where(last, size - 1, low)
    high = torch.where(last, size - 1, low + 1)
    pos = torch.where(last, low.to(pos.dtype), pos)
    lw = pos - low.to(pos.dtype)
    return inside, low, high, 1.0 - lw, lw


def _roi_align_one(image: torch.Tensor, roi: torch.Tensor, scale: float, ph: int, pw: int, ratio: int,
                   aligned: bool) -> torch.Tensor:
    """``roi_align_forward_kernel_impl`` (torchvision/csrc/ops/cuda/roi_align_kernel.cu) for one
    roi over its image ``[C, H, W]``: each bin's samples summed in the kernel's order (rows, then
    columns within a row), divided by their count. Arithmetic in the input's dtype."""
    dtype, (_, h, w) = image.dtype, image.shape
    offset = 0.5 if aligned else 0.0
    start_w, start_h, end_w, end_h = (roi[i] * scale - offset for i in (1, 2, 3, 4))
    roi_w, roi_h = end_w - start_w, end_h - start_h
    if not aligned:
        roi_w, roi_h = roi_w.clamp_min(1.0), roi_h.clamp_min(1.0)
    bin_h, bin_w = roi_h / ph, roi_w / pw
    grid_h = ratio if ratio > 0 else int(torch.ceil(roi_h / ph))
    grid_w = ratio if ratio > 0 else int(torch.ceil(roi_w / pw))
    count = max(grid_h * grid_w, 1)
    rows, cols = torch.arange(ph, dtype=dtype), torch.arange(pw, dtype=dtype)
    out = torch.zeros(image.size(0), ph, pw, dtype=dtype)
    for iy in range(grid_h):
        y_in, y_lo, y_hi, hy, ly = _bilinear_axis(start_h + rows * bin_h + torch.tensor(iy + .5, dtype=dtype)
                                                  * bin_h / grid_h, h)
        lo_rows, hi_rows = image[:, y_lo], image[:, y_hi]  # [C, PH, W]
        for ix in range(grid_w):
            x_in, x_lo, x_hi, hx, lx = _bilinear_axis(start_w + cols * bin_w + torch.tensor(ix + .5, dtype=dtype)
                                                      * bin_w / grid_w, w)
            val = (hy[:, None] * hx * lo_rows[:, :, x_lo] + hy[:, None] * lx * lo_rows[:, :, x_hi]
                   + ly[:, None] * hx * hi_rows[:, :, x_lo] + ly[:, None] * lx * hi_rows[:, :, x_hi])
            out += torch.where(y_in[:, None] & x_in, val, 0)
    return out / count


def roi_align_cpu(input: torch.Tensor, rois: torch.Tensor, spatial_scale: float, pooled_height: int,
                  pooled_width: int, sampling_ratio: int, aligned: bool) -> torch.Tensor:
    """``roi_align`` as the CUDA kernel computes it, roi by roi (`_roi_align_one`): host memory of
    one bin grid's samples at a time. (torchvision's Python ``_roi_align`` samples every bin at
    every row and column of the input under adaptive sampling: gigabytes for one roi of a
    Mask R-CNN target mask.)"""
    out = torch.zeros(rois.size(0), input.size(1), pooled_height, pooled_width, dtype=input.dtype)
    for k in range(rois.size(0)):
        out[k] = _roi_align_one(input[int(rois[k, 0])], rois[k], spatial_scale, pooled_height, pooled_width,
                                sampling_ratio, aligned)
    return out


def roi_align_backward_cpu(grad: torch.Tensor, rois: torch.Tensor, spatial_scale: float, pooled_height: int,
                           pooled_width: int, batch_size: int, channels: int, height: int, width: int,
                           sampling_ratio: int, aligned: bool) -> torch.Tensor:
    """The gradient of ``roi_align`` with respect to its input: the transpose of a map linear in
    it, by autograd (which a kernel called from a backward runs below: its keys are let in)."""
    c = torch._C
    autograd = c.DispatchKeySet(c.DispatchKey.ADInplaceOrView)
    for key in (c.DispatchKey.AutogradFunctionality, c.DispatchKey.AutogradOther, c.DispatchKey.AutogradNestedTensor):
        autograd = autograd | c.DispatchKeySet(key)
    allowed = c._dispatch_tls_local_exclude_set() - autograd
    with c._ForceDispatchKeyGuard(c._dispatch_tls_local_include_set(), allowed), torch.enable_grad():
        x = torch.zeros(batch_size, channels, height, width, dtype=grad.dtype, requires_grad=True)
        out = _roi_align_python()(x, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned)
        return torch.autograd.grad(out, x, grad)[0]


def _no_host_kernel(name: str) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"torchvision::{name} on host tensors needs torchvision's C++ library, which "
                                  "cannot load next to this CPU build of torch (its wheel is built for CUDA)")
    return kernel


HOST = {"nms": nms_cpu, "roi_align": roi_align_cpu, "_roi_align_backward": roi_align_backward_cpu}
NO_HOST = ("roi_pool", "_roi_pool_backward", "ps_roi_align", "_ps_roi_align_backward", "ps_roi_pool",
           "_ps_roi_pool_backward", "deform_conv2d", "_deform_conv2d_backward")


def register(lib: Any) -> None:
    """Give `lib` (the ``torchvision`` fragment holding the schemas) its host kernels and
    ``_cuda_version`` (-1, as a build without CUDA reports: torchvision then skips its CUDA
    version check). torchvision registers the autograd formulas and autocast's casts itself,
    in Python, once its library loaded (``torchvision/_autograd_registrations.py``, 0.28)."""
    lib.define("_cuda_version() -> int")
    lib.impl("_cuda_version", lambda: -1, "CompositeExplicitAutograd")
    for name, kernel in HOST.items():
        lib.impl(name, kernel, "CPU")
    for name in NO_HOST:
        lib.impl(name, _no_host_kernel(name), "CPU")
