"""``torch.cuda.comm``'s C++ half on the simulated GPUs, for `vram.run.cuda.api` (layer 4).

``nn.DataParallel`` scatters its inputs with ``torch._C._scatter`` even on one GPU, and
``torch.cuda.comm`` calls ``_gather``, ``_broadcast*`` and ``_scatter_out``/``_gather_out``; a CPU
build of torch has none of them. Each function here is the sequence of tensor ops of
``torch/csrc/cuda/comm.cpp`` (torch 2.13), so what it allocates goes through the run's modes and is
charged as on the GPU: ``scatter`` returns views of the source for its own device and
``.to(cuda:i, non_blocking)`` copies (on ``streams[i]`` when given) for the others; ``gather``
allocates the result with ``at::empty`` (the inputs' common suggested memory format) and copies
each input into a slice; ``broadcast`` allocates ``at::empty`` on every other device.

Between two or more GPUs a CUDA build broadcasts with NCCL (``nccl::is_available``: dense
contiguous CUDA tensors on distinct devices), whose single-process communicators
(``ncclCommInitAll``, ``torch/csrc/cuda/nccl.cpp``) take device memory that vram does not model:
those broadcasts stop with one line rather than leave it out.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["comm_functions"]


def _cuda(index: int) -> torch.device:
    return torch.device("cuda", index)


def _check_streams(streams: Sequence[Any] | None, i: int, device_index: int) -> Any:
    stream = streams[i] if streams is not None and i < len(streams) else None
    if stream is not None and stream.device_index != device_index:
        raise RuntimeError(f"Expected the device associated with the stream at index {i} "
                           f"(was {stream.device_index}) to match the device supplied at that index "
                           f"(expected {device_index})")
    return stream


def _on(stream: Any, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`fn` with `stream` current, as comm.cpp's ``OptionalCUDAStreamGuard.reset_stream``."""
    if stream is None:
        return fn()
    with torch.cuda.stream(stream):
        return fn()


def scatter(tensor: torch.Tensor, devices: Sequence[int], chunk_sizes: Sequence[int] | None,
            dim: int, streams: Sequence[Any] | None) -> list[torch.Tensor]:
    """``torch::cuda::scatter``: chunks of `tensor`; those for another device are copied there."""
    if not devices:
        raise RuntimeError("Expected at least one device to scatter to")
    if chunk_sizes is not None and len(chunk_sizes) != len(devices):
        raise RuntimeError("Expected devices and chunk_sizes to be of same length, but got "
                           f"len(devices) = {len(devices)} and len(chunk_sizes) = {len(chunk_sizes)}")
    chunks = list(tensor.split_with_sizes(list(chunk_sizes), dim) if chunk_sizes is not None
                  else tensor.chunk(len(devices), dim))
    for i, chunk in enumerate(chunks):
        index = int(devices[i])
        if index != tensor.get_device():
            stream = _check_streams(streams, i, index)
            if index < 0:
                raise RuntimeError(f"Expected non-negative device index, but got {index}")
            chunks[i] = _on(stream, lambda c=chunk, d=index: c.to(_cuda(d), non_blocking=True,
                                                                   memory_format=torch.preserve_format))
    return chunks


def scatter_out(tensor: torch.Tensor, out: Sequence[torch.Tensor], dim: int,
                streams: Sequence[Any] | None) -> list[torch.Tensor]:
    """``torch::cuda::scatter_out``: each chunk copied into its output tensor."""
    if not out:
        raise RuntimeError("Expected at least one output tensor to scatter to")
    dim = dim % tensor.dim() if tensor.dim() else 0
    sizes = []
    for i, o in enumerate(out):
        if not o.is_cuda:
            raise RuntimeError("Expected all output tensors to be CUDA tensors, but output tensor at "
                               f"index {i} has device '{o.device}'")
        same = o.dim() == tensor.dim() and all(a == b for k, (a, b) in enumerate(zip(o.shape, tensor.shape))
                                               if k != dim)
        if not same:
            raise RuntimeError(f"Output tensor at index {i} has incorrect shape: {list(o.shape)}. Expected "
                               f"same shape except for scatter dim {dim} as the source tensor: "
                               f"{list(tensor.shape)}")
        sizes.append(o.shape[dim])
    if sum(sizes) != tensor.shape[dim]:
        raise RuntimeError(f"Total size for output tensors along scatter dim {dim} does not match the "
                           f"source tensor size at dim {dim}. Expected {tensor.shape[dim]}, but got total "
                           f"size {sum(sizes)}")
    for i, chunk in enumerate(tensor.split_with_sizes(sizes, dim)):
        stream = _check_streams(streams, i, out[i].get_device())
        _on(stream, lambda c=chunk, o=out[i]: o.copy_(c, non_blocking=True))
    return list(out)


def _check_gather(tensors: Sequence[torch.Tensor], dim: int) -> tuple[int, list[int]]:
    if not tensors:
        raise RuntimeError("Expected at least one tensor to gather from")
    first = tensors[0]
    dim = dim % first.dim() if first.dim() else 0
    expected = list(first.shape)
    total = 0
    for i, t in enumerate(tensors):
        if not t.is_cuda:
            raise RuntimeError("Expected all input tensors to be CUDA tensors, but tensor at index "
                               f"{i} has device {t.device}")
        if t.dim() != len(expected):
            raise RuntimeError("Expected all input tensors to have the same number of dimensions, but "
                               f"tensor at index {i}has {t.dim()} dimensions, (expected {len(expected)})")
        expected[dim] = t.shape[dim]
        if list(t.shape) != expected:
            raise RuntimeError(f"Input tensor at index {i} has invalid shape {list(t.shape)}, but "
                               f"expected {expected}")
        total += t.shape[dim]
    expected[dim] = total
    return dim, expected


def _gather_into(tensors: Sequence[torch.Tensor], out: torch.Tensor, dim: int) -> torch.Tensor:
    """``_gather_out_impl``: each input copied into its slice of `out`."""
    chunks = out.split_with_sizes([t.shape[dim] for t in tensors], dim)
    for chunk, t in zip(chunks, tensors):
        chunk.copy_(t, non_blocking=out.is_cuda)
    return out


def _suggested_format(t: torch.Tensor) -> torch.memory_format:
    """``suggest_memory_format``: channels-last when the strides say so, else contiguous."""
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous():
        return torch.channels_last
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d) and not t.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format


def gather(tensors: Sequence[torch.Tensor], dim: int, destination: int | None) -> torch.Tensor:
    """``torch::cuda::gather``: a new tensor on `destination` (-1: the CPU; None: the current GPU)."""
    dim, expected = _check_gather(tensors, dim)
    fmt = _suggested_format(tensors[0])
    if any(_suggested_format(t) != fmt for t in tensors):
        fmt = torch.contiguous_format
    device = torch.device("cpu") if destination == -1 else (
        torch.device("cuda") if destination is None else _cuda(destination))
    out = torch.empty(expected, dtype=tensors[0].dtype, device=device, memory_format=fmt)
    return _gather_into(tensors, out, dim)


def gather_out(tensors: Sequence[torch.Tensor], out: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch::cuda::gather_out``."""
    dim, expected = _check_gather(tensors, dim)
    if list(out.shape) != expected:
        raise RuntimeError(f"Expected out tensor to have shape {expected}, but got {list(out.shape)}")
    return _gather_into(tensors, out, dim)


def _no_nccl(source: torch.Tensor, devices: Sequence[int]) -> None:
    """Stop, before anything is allocated, where a CUDA build would broadcast a CUDA tensor with
    NCCL between the process's own GPUs."""
    devices = {source.get_device(), *devices}
    if len(devices) > 1 and source.is_cuda:
        raise NotImplementedError(
            f"vram run: a broadcast between {len(devices)} simulated GPUs of one process (nn.DataParallel's "
            "replicate, torch.cuda.comm.broadcast) runs on NCCL, whose ncclCommInitAll communicators are "
            "not modelled; run one process per GPU (DistributedDataParallel, --nproc-per-node)")


def broadcast_out(tensor: torch.Tensor, out: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``torch::cuda::broadcast_out``: `tensor` copied into each output tensor."""
    for i, o in enumerate(out):
        if not o.is_cuda:
            raise RuntimeError("Expected all output tensors to be CUDA tensors, but output tensor at "
                               f"index {i} has device '{o.device}'")
        if o.shape != tensor.shape:
            raise RuntimeError("Expected all output tensors to have same shape as the source tensor "
                               f"{list(tensor.shape)}, but output tensor at index {i} has shape {list(o.shape)}")
    _no_nccl(tensor, [o.get_device() for o in out])
    for o in out:
        o.copy_(tensor, non_blocking=True)
    return list(out)


def broadcast(tensor: torch.Tensor, devices: Sequence[int]) -> list[torch.Tensor]:
    """``torch::cuda::broadcast``: `tensor` itself for its own device, a copy for each other one."""
    for d in devices:
        if d < 0:
            raise RuntimeError(f"Expected non-negative device index, but got {d}")
    own = tensor.get_device()
    _no_nccl(tensor, devices)
    copies = [torch.empty(tensor.shape, dtype=tensor.dtype, device=_cuda(d)) for d in devices if d != own]
    for c in copies:
        c.copy_(tensor, non_blocking=True)
    it = iter(copies)
    return [tensor if d == own else next(it) for d in devices]


#: ``c10::ScalarType``'s order (c10/core/ScalarType.h): ``take_tensors`` keys its groups by it
_SCALAR_ORDER = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                 torch.float32, torch.float64, torch.complex32, torch.complex64, torch.complex128,
                 torch.bool, torch.qint8, torch.quint8, torch.qint32, torch.bfloat16]


def take_tensors(tensors: Sequence[torch.Tensor], size_limit: int) -> list[list[torch.Tensor]]:
    """``torch::utils::take_tensors`` (tensor_flatten.cpp, not fine-grained): per dtype, a group
    is closed once its bytes reach `size_limit`; the open ones follow in ``ScalarType`` order."""
    groups: dict[int, tuple[list[torch.Tensor], list[int]]] = {}
    results: list[list[torch.Tensor]] = []
    for t in tensors:
        if t.is_sparse or t.dtype not in _SCALAR_ORDER:
            raise NotImplementedError(f"vram run: torch.cuda.comm.broadcast_coalesced of a {t.layout} "
                                      f"{t.dtype} tensor is not modelled")
        group, size = groups.setdefault(_SCALAR_ORDER.index(t.dtype), ([], [0]))
        group.append(t)
        size[0] += t.numel() * t.element_size()
        if size[0] >= size_limit:
            results.append(group)
            del groups[_SCALAR_ORDER.index(t.dtype)]
    return results + [groups[k][0] for k in sorted(groups)]


def broadcast_coalesced(tensors: Sequence[torch.Tensor], devices: Sequence[int],
                        buffer_size: int) -> list[list[torch.Tensor]]:
    """``torch::cuda::broadcast_coalesced``: device 0 gets the tensors themselves; each group of
    `take_tensors` is flattened (one group of one tensor is a view, else ``at::cat``) and
    broadcast, which past one GPU stops (`_no_nccl`)."""
    if not all(t.get_device() == devices[0] for t in tensors):
        raise RuntimeError(f"All tensors must be on devices[0]: {devices[0]}")
    if tensors:
        _no_nccl(tensors[0], devices)
    for group in take_tensors(tensors, buffer_size):
        broadcast(torch._utils._flatten_dense_tensors(group), devices)
    return [list(tensors)]


def comm_functions() -> dict[str, Callable[..., Any]]:
    """The ``torch._C`` names of ``torch/csrc/cuda/python_comm.cpp`` and their stand-ins."""
    return {"_scatter": scatter, "_scatter_out": scatter_out, "_gather": gather, "_gather_out": gather_out,
            "_broadcast": broadcast, "_broadcast_out": broadcast_out,
            "_broadcast_coalesced": broadcast_coalesced}
