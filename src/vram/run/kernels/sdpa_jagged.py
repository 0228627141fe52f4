"""``scaled_dot_product_attention`` on jagged nested tensors (``torch.nested.nested_tensor(...,
layout=torch.jagged)``) as a CUDA build runs it.

A jagged nested tensor is a Python subclass over a dense ``values`` buffer and ``offsets``
(torch/nested/_internal/nested_tensor.py); its ``__torch_function__`` sends SDPA to
``jagged_scaled_dot_product_attention`` (torch/nested/_internal/sdpa.py), which picks a kernel
with its own ``_select_sdp_backend`` — flash, memory-efficient, math, cuDNN, in that order — and
calls the variable-length kernels on the values with cumulative sequence lengths. Here:

* `select_jagged_backend`: that order, with the CUDA build's ``can_use_flash_attention`` /
  ``can_use_mem_efficient_attention`` (cuda/sdp_utils.cpp): their general constraints only, since
  a jagged tensor is nested but not strided (``has_for_nested_inputs`` asks for a strided layout;
  ``has_only_dense_inputs`` is false), then the Python checks of torch/nested/_internal/sdpa.py;
* `jagged_sdpa` runs PyTorch's own ``jagged_scaled_dot_product_attention`` with that choice, so the
  offsets' int32 copies, the max-sequence-length reads and the kernels' calls are PyTorch's;
* `varlen_plan`: what the variable-length kernels allocate (``flash_attn/flash_api.cpp``
  ``mha_varlen_fwd`` / ``mha_varlen_bwd`` under ``cuda/attention.cu`` ``_flash_attention_forward``
  and ``cuda/attention_backward.cu`` ``_flash_attention_backward``; ``attention.cu``
  ``_efficient_attention_forward`` with ``cu_seqlens``).

Their backward: ``_flash_attention_backward`` here, ``_efficient_attention_backward`` in
`vram.run.kernels.sdpa`. Refused in one line: the math path (it converts to strided nested tensors,
which the simulated GPU does not hold) and cuDNN's nested kernels.
"""
from __future__ import annotations

from typing import Any

import torch

from .functions import clone_with_globals
from .sdpa_choice import HALF, deterministic_algorithms, sdpa_rejections

#: the checks of ``can_use_*_attention`` that run only when no input is nested
#: (``has_only_dense_inputs``), and the causal non-square check, which skips nested inputs
_DENSE_ONLY = frozenset({"check_batch_size_and_num_heads_dense", "check_nonzero_sequence_lengths_dense",
                         "check_last_dim_stride_equals_1_dense", "check_cudnn_tensor_shapes",
                         "check_flash_causal_non_square_seqlens"})
_MATH = ("vram run: scaled_dot_product_attention on jagged nested tensors takes the math path here "
         "(torch/nested/_internal/sdpa.py: no fused kernel accepts these inputs), which converts them to "
         "strided nested tensors; those are not modelled on the simulated GPU")
_CUDNN = ("vram run: scaled_dot_product_attention on jagged nested tensors would run cuDNN's nested "
          "kernels (torch/nested/_internal/sdpa.py: flash, memory-efficient and math refused); not modelled")

def _jagged_params(q: Any, k: Any, v: Any, mask: Any, dropout: float, causal: bool, gqa: bool) -> Any:
    from torch.backends.cuda import SDPAParams
    return SDPAParams(q, k, v, mask, dropout, causal, gqa)


def select_jagged_backend(p: dict[str, Any], major: int = 9, minor: int = 0) -> str:
    """torch/nested/_internal/sdpa.py ``_select_sdp_backend`` on a GPU of this capability:
    "flash", "efficient", "math", "cudnn" or "error"."""
    from torch.nested._internal import sdpa as nested_sdpa

    b = torch.backends.cuda
    if not (b.flash_sdp_enabled() or b.mem_efficient_sdp_enabled() or b.math_sdp_enabled()
            or b.cudnn_sdp_enabled()):
        return "error"
    rejected = sdpa_rejections(p, major, minor, skipped=_DENSE_ONLY)
    params = _jagged_params(p["query"], p["key"], p["value"], p["attn_mask"], p["dropout_p"], p["is_causal"],
                            p["enable_gqa"])
    if rejected["flash"] is None and nested_sdpa._can_use_flash_sdpa_jagged(params):
        return "flash"
    if rejected["efficient"] is None and nested_sdpa._can_use_efficient_sdpa_jagged(params):
        return "efficient"
    if b.math_sdp_enabled() and nested_sdpa._can_use_math_sdpa_jagged(params):
        return "math"
    if rejected["cudnn"] is None:
        return "cudnn"
    return "error"


def jagged_sdpa(p: dict[str, Any], major: int, minor: int) -> Any:
    """``jagged_scaled_dot_product_attention`` with the backend a CUDA GPU of this capability picks."""
    from torch.backends.cuda import SDPBackend
    from torch.nested._internal import sdpa as nested_sdpa

    q, k, v = p["query"], p["key"], p["value"]
    backend = select_jagged_backend(p, major, minor)
    if backend == "math":
        raise NotImplementedError(_MATH)
    if backend == "cudnn":
        raise NotImplementedError(_CUDNN)
    choice = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
              "error": SDPBackend.ERROR}[backend]
    run = clone_with_globals(nested_sdpa.jagged_scaled_dot_product_attention,
                             _select_sdp_backend=lambda *args: choice)
    return run(q, k, v, attn_mask=p["attn_mask"], dropout_p=p["dropout_p"], is_causal=p["is_causal"],
               scale=p["scale"], enable_gqa=p["enable_gqa"])


# -- what the variable-length kernels allocate ------------------------------------------------------
def _round(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _flash_varlen_forward(args: tuple[Any, ...]) -> list[tuple[str, Any]] | None:
    """``mha_varlen_fwd``: out (``empty_like(q)``), softmax_lse ``[num_heads, total_q]`` float, then
    rng_state and ``_unused``; with dropout a second rng_state replaces the first (freed). No
    split-KV buffers (only for a paged KV cache or the swapped single-query layout, which needs
    fewer key heads than query heads)."""
    if args[3] is None:
        return None  # the dense call: _scaled_dot_product_flash_attention's plan covers it
    dropout = float(args[7]) if len(args) > 7 else 0.0
    plan: list[tuple[str, Any]] = [("out", 0), ("out", 1)]
    if dropout > 0.0:
        return plan + [("tmp", 16), ("out", 3), ("out", 2), ("free", 0)]
    return plan + [("out", 2), ("out", 3)]


def _flash_varlen_backward(args: tuple[Any, ...], sms: int) -> list[tuple[str, Any]] | None:
    """``_flash_attention_backward``: ``grad_out.contiguous()`` and ``out.contiguous()``, then
    ``mha_varlen_bwd``: dq/dk/dv, softmax_d ``[num_heads, total_q + 128 * b]`` float and dq_accum
    ``[total_q + 128 * b, num_heads, head_size_rounded]`` float (``zeros`` of ``nsplits`` copies
    when deterministic), freed on return with the copies."""
    g, q, out, cu_q = args[0], args[1], args[4], args[6]
    if cu_q is None:
        return None
    total_q, h, d = q.shape
    b = cu_q.numel() - 1
    plan: list[tuple[str, Any]] = []
    for t in (g, out):
        if not t.is_contiguous():
            plan.append(("tmp", t.numel() * t.element_size()))
    copies = len(plan)
    dr = _round(d, 32 if d <= 128 else 64)
    rows = total_q + 128 * b
    nsplits = -(-sms // (b * h)) if deterministic_algorithms() else 1
    plan += [("out", 0), ("out", 1), ("out", 2), ("tmp", h * rows * 4), ("tmp", nsplits * rows * h * dr * 4)]
    plan += [("free", copies + 1), ("free", copies)]
    return plan + [("free", i) for i in reversed(range(copies))]


def _efficient_varlen_forward(args: tuple[Any, ...]) -> list[tuple[str, Any]] | None:
    """``_efficient_attention_forward``: the output, the logsumexp (``[b, heads, ceil(max_seqlen_q /
    32) * 32]`` when computed), and an output accumulator for half inputs with head dims > 128
    (``kNeedsOutputAccumulatorBuffer``); seed and offset are CPU tensors outside a graph capture."""
    q, k, v = args[0], args[1], args[2]
    plan: list[tuple[str, Any]] = [("out", 0), ("out", 1)]
    if q.dtype in HALF and max(k.size(-1), v.size(-1)) > 128:
        plan += [("tmp", q.size(0) * q.size(1) * q.size(2) * v.size(-1) * 4), ("free", 0)]
    return plan


def varlen_plan(name: str, args: tuple[Any, ...], sms: int) -> list[tuple[str, Any]] | None:
    """The allocation order of the attention kernels jagged inputs call (None for other ops)."""
    if name == "_flash_attention_forward":
        return _flash_varlen_forward(args)
    if name == "_flash_attention_backward":
        return _flash_varlen_backward(args, sms)
    if name == "_efficient_attention_forward":
        return _efficient_varlen_forward(args)
    return None
