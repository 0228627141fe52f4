"""A torchvision built for CUDA next to a CPU build of torch (for `vram.run.runtime`; layer 4).

PyPI's torchvision wheels are built against CUDA torch: their operator library (``_C.so``) links
``libtorch_cuda``, so next to a CPU torch it cannot load, and ``import torchvision`` then fails in
``torchvision/_meta_registrations.py``, which registers fake kernels for ``torchvision::nms`` and
friends: ``RuntimeError: operator torchvision::nms does not exist``. A simulated GPU needs none of
those kernels for the models themselves (ResNet, ViT, timm's models: convolutions, attention,
norms), so when the library cannot load, `define_torchvision_ops` defines the operators' schemas
(as ``torchvision/csrc/ops/*.cpp`` declares them with ``TORCH_LIBRARY_FRAGMENT(torchvision, m)``)
with the kernels a run needs (`vram.run.cuda.vision_ops`: host kernels, autograd formulas), and
lets torchvision's load of the library succeed: torchvision imports, its own fake kernels
register, and detection models call ``nms`` and ``roi_align`` as they do on a GPU.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from . import vision_ops as _vision_ops

#: ``torchvision/csrc/ops/*.cpp``'s schemas (torchvision 0.17 onwards: SymInt sizes)
TORCHVISION_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "SymInt batch_size, SymInt channels, SymInt height, SymInt width, int sampling_ratio, bool aligned) -> Tensor",
    "qroi_align(Tensor input, Tensor rois, float input_scale, int input_zero_point, float rois_scale, "
    "int rois_zero_point, float spatial_scale, SymInt pooled_height, SymInt pooled_width, int sampling_ratio, "
    "bool aligned) -> Tensor",
    "roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor",
    "ps_roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio) -> (Tensor, Tensor)",
    "_ps_roi_align_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, int sampling_ratio, SymInt batch_size, SymInt channels, "
    "SymInt height, SymInt width) -> Tensor",
    "ps_roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_ps_roi_pool_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, "
    "SymInt width) -> Tensor",
    "deform_conv2d(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, SymInt stride_h, "
    "SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, SymInt groups, "
    "SymInt offset_groups, bool use_mask) -> Tensor",
    "_deform_conv2d_backward(Tensor grad, Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, "
    "SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, "
    "SymInt groups, SymInt offset_groups, bool use_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    "box_iou_rotated(Tensor boxes1, Tensor boxes2) -> Tensor",
)
_LIBRARY: list[Any] = []  # the torch.library.Library holding the definitions, kept alive


def define_torchvision_ops() -> bool:
    """If torchvision is installed, not imported yet, and its operator library cannot load with
    this torch, define its operators' schemas (no kernels) so that it imports. True if it did."""
    if "torchvision" in sys.modules or _LIBRARY:
        return False
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    libraries = sorted(glob.glob(os.path.join(spec.submodule_search_locations[0], "_C*.so")))
    for path in libraries:
        try:
            torch.ops.load_library(path)
            return False  # it loads: torchvision has its kernels
        except (OSError, RuntimeError):
            continue
    if not libraries or _defined("torchvision::nms"):
        return False
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in TORCHVISION_SCHEMAS:
        if not _defined("torchvision::" + schema.split("(", 1)[0]):
            lib.define(schema)
    _vision_ops.register(lib)
    _LIBRARY.append(lib)
    _stand_in_for(libraries)
    return True


def _stand_in_for(libraries: list[str]) -> None:
    """``torch.ops.load_library`` of torchvision's operator library (`libraries`, which cannot
    load) succeeds: its operators are defined, with kernels (`vram.run.cuda.vision_ops`), so
    ``torchvision.extension._has_ops()`` is true and torchvision calls them, as on a GPU."""
    ops = torch.ops
    load = ops.load_library
    stood_in = {os.path.realpath(p) for p in libraries}

    def load_library(path: Any) -> None:
        if isinstance(path, (str, os.PathLike)) and os.path.realpath(path) in stood_in:
            ops.loaded_libraries.add(os.path.realpath(path))
            return
        load(path)
    ops.load_library = load_library  # type: ignore[method-assign]


def _defined(qualname: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(qualname, "")
        return True
    except RuntimeError:
        return False


def refuse_cuda_ipc(simulated: Callable[[Any], bool],
                    host_bytes: Callable[[Any], Any]) -> Callable[[], None]:
    """A simulated tensor pickled for another process (``torch.multiprocessing``: a Hogwild
    model passed to ``mp.Process``, a CUDA tensor put on an ``mp.Queue``) stops with one line;
    a lazy host tensor is sent as its bytes (`host_bytes`: a real host view of them, else None),
    as the CPU tensor it is: a DataLoader worker's batch built with a large ``torch.zeros`` (timm's
    ``fast_collate``) arrived in the main process as a bare meta tensor.

    On a GPU, ``torch/multiprocessing/reductions.py`` ``reduce_tensor`` sends a CUDA storage by
    CUDA IPC, and the receiver is another process with its own CUDA context and caching allocator
    on the same card; a child of ``vram run`` is a plain CPU process that has no simulated GPU,
    and the CPU path fails with "_share_fd_: only available on CPU". Returns the restore."""
    from multiprocessing.reduction import ForkingPickler

    reducers = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
    saved = {cls: fn for cls, fn in reducers.items() if issubclass(cls, torch.Tensor)}

    def refusing(real: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def reduce(t: Any) -> Any:
            if simulated(t):
                raise RuntimeError("vram run: a CUDA tensor sent to another process (torch.multiprocessing, "
                                   "CUDA IPC) is not simulated: the receiving process would be a GPU process of "
                                   "its own; run each worker's code under its own `vram run`")
            host = host_bytes(t)
            if host is not None:
                return real(host.requires_grad_(t.requires_grad) if t.is_leaf else host)
            return real(t)
        return reduce

    for cls, fn in saved.items():
        reducers[cls] = refusing(fn)

    def restore() -> None:
        reducers.update(saved)
    return restore
