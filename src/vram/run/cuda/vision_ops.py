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
  (a stable descending sort of the scores, greedy suppression where IoU > threshold), and
  ``roi_align`` / ``_roi_align_backward`` as torchvision's own Python ``_roi_align`` and its
  vector-Jacobian product. The other ops have no host kernel here: a host call says so.
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


#: bytes of the samples tensor (``[rois, C, PH, PW, IY, IX]``) one call of torchvision's Python
#: ``_roi_align`` builds; the rois are taken in groups that keep it under this
ROI_SAMPLES_BYTES = 64 << 20


def roi_align_cpu(input: torch.Tensor, rois: torch.Tensor, spatial_scale: float, pooled_height: int,
                  pooled_width: int, sampling_ratio: int, aligned: bool) -> torch.Tensor:
    """torchvision's Python ``_roi_align`` over groups of rois. It samples each bin at IY × IX
    points, with adaptive sampling (``sampling_ratio <= 0``) at every row and column of the
    input, masked (Mask R-CNN's target masks: gigabytes for a few hundred rois at once); each
    roi's output is computed from its own samples, the same for any group it is in."""
    fn = _roi_align_python()
    iy, ix = (sampling_ratio, sampling_ratio) if sampling_ratio > 0 else (input.size(2), input.size(3))
    per_roi = input.size(1) * pooled_height * pooled_width * iy * ix * input.element_size()
    group = max(1, ROI_SAMPLES_BYTES // max(per_roi, 1))
    if rois.size(0) <= group:
        return fn(input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned)
    return torch.cat([fn(input, rois[i:i + group], spatial_scale, pooled_height, pooled_width, sampling_ratio,
                         aligned) for i in range(0, rois.size(0), group)])


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
