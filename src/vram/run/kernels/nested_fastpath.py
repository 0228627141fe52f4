"""``nn.TransformerEncoder``'s nested-tensor fast path on the simulated GPU, op by op as CUDA runs it.

In ``eval()`` without grad, with a ``src_key_padding_mask`` and ``enable_nested_tensor=True``,
``TransformerEncoder.forward`` (torch/nn/modules/transformer.py) checks the mask is left-aligned
(``torch._nested_tensor_from_mask_left_aligned``), packs the batch into a strided nested tensor
(``torch._nested_tensor_from_mask``), runs each layer's ``torch._transformer_encoder_layer_fwd`` on
it and pads it back (``to_padded_tensor``). A strided nested tensor is one contiguous buffer plus
host metadata (``NestedTensorImpl``: ``nested_sizes`` on the CPU); `SimulatedNestedTensor` holds the
same: a simulated buffer and the ``[N, 2]`` sizes. Every device allocation is the CUDA source's
(paths under ``aten/src/ATen/native/``):

* `left_aligned`: ``NestedTensor_nested_tensor_from_mask_left_aligned`` (nested/NestedTensorMath.cpp):
  ``zeros({N, 1})``, ``cat({mask, pad}, 1).to(kInt).argmin(1)``, ``mask.cumsum(1)`` (structured: the
  int64 output, then ``self.to(int64)`` for the scan, freed), then ``cuda_equal``: ``eq``, ``all``, ``item``;
* `from_mask`: ``NestedTensor_nested_tensor_from_mask``: the same sizes, ``full_like(sizes, D)``,
  ``cat({sizes, d}, 1).to(kCPU)``, then ``nested_from_padded_cuda`` (nested/cuda/
  NestedTensorTransformerFunctions.cpp): the buffer ``empty({sum(L_i) * D})`` and the int32 metadata
  ``cat({sizes, padded sizes, offsets}).to(kCUDA, kInt, non_blocking)`` (with the int64 staging copy a
  non-blocking conversion makes on the GPU), freed on return;
* `nested_attention`: ``native_multi_head_attention_cuda``'s SDPA branch (transformers/cuda/attention.cu)
  on a nested input: ``nested_linear`` (``linear`` on the buffer as ``[sum(L_i), D]``), the chunks as
  views, ``_scaled_dot_product_{flash,efficient}_attention_nestedtensor_cuda``
  (``sdpa_nested_preprocessing``: the int32 cumulative lengths of q and k copied to the device; the
  packed chunks need no ``contiguous()``) over the variable-length kernels, the output projection,
  then the attention output and the projection input die;
* `to_padded`: ``NestedTensor_to_padded_tensor_cuda``: the padded output, then the int32 metadata
  ``cat({offsets, sizes}).to(kCUDA, kInt)`` (blocking: converted on the host), freed on return;
* `nested_values`: the outputs' values, from PyTorch's CPU nested kernels.

The layers' norms, feed-forward and residual adds run on the buffer as ``[sum(L_i), D]``
(``nested_layer_norm``, ``NestedTensor_times_Tensor_plus_Tensor_addmm``, the in-place nested add) in
`vram.run.kernels.fastpath`. A batch of one scans its mask with cub's device scan (``cumsum`` of
one row: `vram.run.kernels.sorting`, the temporary storage named). Refused in one line: dtypes
other than float32/float16 (the
generic ``nested_from_padded`` / ``to_padded_tensor`` paths). A layer whose attention leaves the
SDPA branch (a sequence of length <= 1, a head dim not a multiple of 8, no fused kernel) pads the
batch again (``transform_bias_rescale_qkv`` with padding, ``NestedTensor_to_mask``,
``nested_from_padded`` with the 0213 transform): `vram.run.kernels.fastpath`.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

from vram.run.values import known

from .sdpa_choice import HALF, minimum_gemm_alignment

_PREFIX = "vram run: nn.TransformerEncoder's nested-tensor fast path"
_SUPPORTED = (torch.float32, torch.float16)


class SimulatedNestedTensor:
    """A strided nested tensor ``[N, {L_i}, D]`` on the simulated GPU, as ``NestedTensorImpl`` holds
    it: a contiguous 1-D buffer and the host ``nested_sizes``. It lives inside
    ``TransformerEncoder.forward`` only; any other use stops with one line."""

    is_nested = True
    requires_grad = False

    def __init__(self, buffer: torch.Tensor, sizes: torch.Tensor) -> None:
        self.buffer, self.sizes = buffer, sizes
        #: the same nested tensor computed by the CPU kernels when its inputs' values are known
        #: (`nested_values`), and whether they were placeholders
        self.host: torch.Tensor | None = None
        self.host_assumed = False

    @property
    def dtype(self) -> torch.dtype:
        return self.buffer.dtype

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def dim(self) -> int:
        return 3

    def lengths(self) -> list[int]:
        return [int(n) for n in self.sizes[:, 0].tolist()]

    def rows(self) -> torch.Tensor:
        """The buffer as ``[sum(L_i), D]`` (what ``get_buffer().reshape({-1, D})`` gives)."""
        return self.buffer.view(-1, int(self.sizes[0, 1]))

    def to_padded_tensor(self, padding: float, output_size: Any = None) -> torch.Tensor:
        """``Tensor.to_padded_tensor``: ``torch.nested.to_padded_tensor``, which the simulation's
        function mode sees (`vram.run.kernels.fastpath.FUSED`)."""
        return torch.nested.to_padded_tensor(self, padding, output_size)  # type: ignore[arg-type]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", str(func))
        raise NotImplementedError(f"{_PREFIX}: {name} on its nested tensor is not modelled (only the "
                                  "encoder layers' fused kernels and to_padded_tensor are)")


def _refuse(why: str) -> NotImplementedError:
    return NotImplementedError(f"{_PREFIX}: {why} is not modelled; build the encoder with "
                               "enable_nested_tensor=False to measure the dense path")


def _checked(t: torch.Tensor, mask: torch.Tensor) -> tuple[int, int]:
    if mask.dtype != torch.bool:
        raise RuntimeError(f"Expected mask to be of ScalarType Bool, but got {mask.dtype} instead.")
    if mask.dim() != 2:
        raise RuntimeError("Padding mask should be 2D")
    if t.dim() != 3:
        raise RuntimeError("Input should be a 3D tensor, N * L * D")
    n, length = t.size(0), t.size(1)
    if (n, length) != tuple(mask.shape):
        raise RuntimeError("Mask size should match input size")
    return n, length


def _lengths_and_argmin(mask: torch.Tensor, n: int, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``tmp_pad``, ``nums`` and the ``cumsum`` of both mask functions, allocated in the C++ order."""
    pad = torch.zeros((n, 1), dtype=torch.bool, device=mask.device)
    joined = torch.cat([mask, pad], 1)
    as_int = joined.to(torch.int32)
    nums = as_int.argmin(1)
    del as_int, joined  # the full expression's temporaries, last made first
    # cumsum (structured): the int64 output, then self.to(int64) for the scan, freed
    summed = torch.empty((n, length), dtype=torch.int64, device=mask.device)
    widened = mask.to(torch.int64)
    torch.cumsum(widened, 1, out=summed)
    del widened
    return pad, nums, summed


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``cuda_equal``: ``eq(self, src).all().item()``; the temporaries die last made first."""
    same = torch.eq(a, b)
    every = same.all()
    result = bool(every.item())
    del every, same
    return result


def left_aligned(args: tuple[Any, ...], kwargs: dict[str, Any], major: int, minor: int) -> bool:
    """``NestedTensor_nested_tensor_from_mask_left_aligned`` on a GPU."""
    t, mask = (list(args) + [kwargs.get("t"), kwargs.get("mask")])[:2]
    n, length = _checked(t, mask)
    pad, nums, summed = _lengths_and_argmin(mask, n, length)
    sizes = summed.select(1, length - 1)
    result = _equal(sizes, nums)
    del nums, pad, sizes, summed  # the C++ locals, last declared first
    return result


def from_mask(args: tuple[Any, ...], kwargs: dict[str, Any], major: int, minor: int) -> SimulatedNestedTensor:
    """``NestedTensor_nested_tensor_from_mask`` then ``nested_from_padded_cuda`` on a GPU."""
    names = ("t", "mask", "mask_check")
    p: dict[str, Any] = {"mask_check": True}
    p.update(zip(names, args))
    p.update(kwargs)
    t, mask = p["t"], p["mask"]
    n, length = _checked(t, mask)
    if t.dtype not in _SUPPORTED:
        raise _refuse(f"a {t.dtype} input (nested_from_padded_generic and the generic to_padded_tensor)")
    pad, nums, summed = _lengths_and_argmin(mask, n, length)
    sizes = summed.select(1, length - 1)
    if p["mask_check"] and not _equal(sizes, nums):
        raise RuntimeError("Mask must be left-aligned without gaps")
    sizes = sizes.reshape(n, 1)
    d = torch.full_like(sizes, t.size(2), memory_format=torch.contiguous_format)
    joined = torch.cat([sizes, d], 1)
    host = joined.to("cpu")
    del sizes, summed  # `sizes = ...`: the old sizes go first, then the cat temporary
    del joined
    lengths = [int(v) for v in host[:, 0].tolist()]
    if sum(lengths) == 0:  # a GPU stops too, in to_padded_tensor ("at least one constituent tensor ...")
        raise RuntimeError(f"{_PREFIX}: every token is padding (or the mask's values are not known to the "
                           "simulation: see its placeholder reads; --values real computes them)")
    out = _nested_from_padded(t, host, lengths)
    del d, nums, pad  # the C++ locals, last declared first
    return out


def _nested_from_padded(padded: torch.Tensor, sizes: torch.Tensor, lengths: list[int]) -> SimulatedNestedTensor:
    """``nested_from_padded_cuda`` (3-D, no 0213 transform): the output buffer, then the metadata (the
    sizes, the padded sizes, the offsets: ``3 * N + 4`` int64 on the host) ``.to(kCUDA, kInt,
    non_blocking=true)``: a non-blocking copy converts on the GPU (Copy.cu ``copy_kernel_cuda``:
    ``conversion_device`` is CUDA), so the int32 output and an int64 staging copy, freed at once."""
    d = padded.size(2)
    output = torch.empty(sum(lengths) * d, dtype=padded.dtype, device=padded.device)
    count = 3 * len(lengths) + 4
    metadata = torch.empty(count, dtype=torch.int32, device=padded.device)
    staging = torch.empty(count, dtype=torch.int64, device=padded.device)
    del staging
    contiguous = padded.contiguous()
    del contiguous, metadata
    return SimulatedNestedTensor(output, sizes)


def padded_metadata(padded: torch.Tensor, sizes: torch.Tensor) -> None:
    """``nested_from_padded_cuda`` with the 0213 transform (4-D ``[N, NH, T, DH]``): the int32
    metadata of ``2 * N`` sizes, 4 padded sizes and ``N + 1`` offsets, and its int64 staging copy."""
    if padded.dtype not in _SUPPORTED:
        raise _refuse(f"a {padded.dtype} attention output (nested_from_padded_generic)")
    count = sizes.numel() + padded.dim() + sizes.size(0) + 1
    metadata = torch.empty(count, dtype=torch.int32, device=padded.device)
    staging = torch.empty(count, dtype=torch.int64, device=padded.device)
    del staging
    contiguous = padded.contiguous()
    del contiguous, metadata


def to_padded(args: tuple[Any, ...], kwargs: dict[str, Any], major: int, minor: int) -> torch.Tensor:
    """``NestedTensor_to_padded_tensor_cuda`` for a 3-D nested tensor."""
    names = ("input", "padding", "output_size")
    p: dict[str, Any] = {"output_size": None}
    p.update(zip(names, args))
    p.update(kwargs)
    nt, output_size = p["input"], p["output_size"]
    lengths, d = nt.lengths(), int(nt.sizes[0, 1])
    if not any(lengths):
        raise RuntimeError("to_padded_tensor: at least one constituent tensor should have non-zero numel")
    if output_size is None:  # the 2-D recursion of the CUDA kernel, then a reshape (a view)
        shape = [len(lengths), max(lengths), d]
    else:
        shape = [int(s) for s in output_size]
        if len(shape) != 3:
            raise RuntimeError("Length of output_size does not match NestedTensor dims. Broadcasting is "
                               "not supported.")
        if shape[0] < len(lengths) or shape[1] < max(lengths) or shape[2] < d:
            raise RuntimeError("Value in output_size is less than NestedTensor padded size. Truncation "
                               "is not supported.")
    output = torch.empty(shape, dtype=nt.dtype, device=nt.buffer.device)
    metadata = torch.empty(3 * len(lengths) + 1 if output_size is not None else 2 * len(lengths) + 1,
                           dtype=torch.int32, device=nt.buffer.device)
    del metadata
    return output


# -- the attention of a nested layer ------------------------------------------------------------------
def _nested_backend(dtype: torch.dtype, dh: int, lengths: list[int], major: int, minor: int) -> str:
    """``select_sdp_backend`` for strided nested q/k/v in inference (cuda/sdp_utils.cpp): cuDNN
    refuses strided nested inputs (``check_for_nested_inputs``, unless
    ``TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED=1``, not modelled); flash needs fp16/bf16 on sm80+ and a
    head dim that is a multiple of 8 and <= 256; memory-efficient a head dim divisible by
    ``minimum_gemm_alignment``; both no empty sequence. (The data-pointer alignment check holds:
    the buffer starts a block and its chunks sit ``D`` elements apart.)"""
    if os.environ.get("TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED") == "1":
        raise _refuse("cuDNN attention on nested tensors (TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED=1)")
    b = torch.backends.cuda
    cc = (major, minor)
    no_empty = min(lengths) > 0
    flash = (b.flash_sdp_enabled() and (8, 0) <= cc <= (12, 1) and dtype in HALF and dh <= 256 and dh % 8 == 0
             and no_empty)
    align = minimum_gemm_alignment(dtype, major)
    efficient_dtypes = (torch.float16, torch.float32, torch.bfloat16) if major >= 8 else (torch.float16, torch.float32)
    efficient = (b.mem_efficient_sdp_enabled() and (5, 0) <= cc <= (12, 1) and dh % align == 0 and no_empty
                 and dtype in efficient_dtypes)
    names = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
    for backend in (names[i] for i in torch._C._get_sdp_priority_order()):
        if (backend == "flash" and flash) or (backend == "efficient" and efficient):
            return backend
        if backend == "math" and b.math_sdp_enabled():
            return "math"
    return "error"


def nested_attention(nt: SimulatedNestedTensor, heads: int, qkv_w: torch.Tensor, qkv_b: torch.Tensor,
                     proj_w: torch.Tensor, proj_b: torch.Tensor, major: int, minor: int) -> torch.Tensor | None:
    """``native_multi_head_attention_cuda``'s SDPA branch on a nested input, no mask, no weights:
    the projection ``[sum(L_i), D]`` as a dense tensor (the nested output's buffer); None when the
    branch does not apply (`vram.run.kernels.fastpath` runs the general one)."""
    lengths = nt.lengths()
    d = int(nt.sizes[0, 1])
    dh = d // heads
    backend = _nested_backend(nt.dtype, dh, lengths, major, minor) if dh % 8 == 0 else "none"
    if min(lengths) <= 1 or backend not in ("flash", "efficient"):
        return None  # check_for_seq_len_1_nested_tensor, or math: the general branch
    total = sum(lengths)
    x = F.linear(nt.rows(), qkv_w, qkv_b)  # nested_linear: [sum(L_i), 3D]
    q, k, v = (x.as_strided((total, heads, dh), (3 * d, dh, 1), x.storage_offset() + i * d) for i in range(3))
    cumulative = [0]
    for n in lengths:
        cumulative.append(cumulative[-1] + n)
    # cumulative_and_max_seq_len: built on the host, then .to(kCUDA), once for q and once for k
    cu_q = torch.tensor(cumulative, dtype=torch.int32, device=x.device)
    cu_k = torch.tensor(cumulative, dtype=torch.int32, device=x.device)
    longest = max(lengths)
    if backend == "flash":
        y, lse, seed, offset, debug = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, longest,
                                                                              longest, 0.0, False, False)
        # scaled_dot_product_attention returns; its tuple dies in order: logsumexp, the cumulative
        # lengths (returned by the nested kernel), rng_state, _unused
        del lse, cu_q, cu_k, seed, offset, debug
    else:
        res = torch.ops.aten._efficient_attention_forward(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), None,
                                                          cu_q, cu_k, longest, longest, 0.0, 0, False)
        del cu_q, cu_k  # the preprocessing's locals, when the nested kernel returns
        y = res[0].view(total, d)
        del res
    out = F.linear(y.view(total, d), proj_w, proj_b)  # nested_linear on the contiguous reshape (a view)
    del y, q, k, v, x  # the C++ locals: the attention output, then the packed projection
    return out


# -- values ------------------------------------------------------------------------------------------
def _host(sim: Any, x: Any) -> Any:
    if isinstance(x, SimulatedNestedTensor):
        return x.host
    if isinstance(x, torch.Tensor) and sim.block_of(x) is not None:
        return known.cpu_value(sim, x)
    return x


def nested_values(sim: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    """The values of a nested-path call's output: what PyTorch's CPU kernels compute from the inputs'
    values (a CPU strided nested tensor is kept for the next layer), or unknown when an input's
    are. The composites above allocate what CUDA allocates but never write their buffers."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, (torch.Tensor, SimulatedNestedTensor))]
    hosts = [_host(sim, a) for a in tensors]
    target = out.buffer if isinstance(out, SimulatedNestedTensor) else out
    if not isinstance(target, torch.Tensor):
        return
    if any(h is None for h in hosts):
        known.forget(sim, target)
        return
    assumed = any(a.host_assumed if isinstance(a, SimulatedNestedTensor) else known.assumed(sim, a) for a in tensors)
    with _disable_current_modes():  # the CPU kernels, below the simulation
        result = func(*(_host(sim, a) for a in args), **{k: _host(sim, v) for k, v in kwargs.items()})
        value = result.values().reshape(-1) if isinstance(out, SimulatedNestedTensor) else result
    known.define(sim, target, value, assumed)
    if isinstance(out, SimulatedNestedTensor):
        out.host, out.host_assumed = result, assumed
