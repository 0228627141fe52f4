"""What cuDNN's fused attention allocates, forward and backward (``aten/src/ATen/native/cudnn/MHA.cpp``
``run_cudnn_SDP_fprop`` / ``run_cudnn_SDP_bprop``, ``transformers/cuda/attention.cu``
``_cudnn_attention_forward`` and ``attention_backward.cu`` ``_cudnn_attention_backward``).

Each call takes ``mha_graph->get_workspace_size()`` bytes from the caching allocator after its
outputs and frees them on return. That size is the cuDNN frontend's own tensors plus the engine's:

* **The frontend's part** (``cudnn_frontend/node/scaled_dot_product_flash_attention.h``,
  ``get_fe_workspace_size_node``), exact from source: none forward (only ALiBi slopes, which
  PyTorch never asks for); backward (``CompositeSDPABackwardNode``, cuDNN >= 9: no dP workspace)
  the float32 ``dQ_accum`` [B, Hq, Sq, Dqk] and ``softmax_sum`` [B, Hq, Sq, 1].
* **Grouped-query backward**: ``dK_fullhead`` [B, Hq, Skv, Dqk] and ``dV_fullhead`` [B, Hq, Skv, Dv]
  are virtual tensors in the inputs' dtype, reduced over the head groups into dK/dV; the engine
  holds them in its workspace. The H200 recording (B=4, Hq=16, Hkv=4, S=1024, D=64, bf16) shows
  exactly their 16 MiB more than the dense backward.
* **The engine's own scratch** (`ENGINE_WORKSPACE`): a table from measurement, not derivable
  without cuDNN. Elsewhere it is named in the run's notes and not charged.

Backward also materialises ``grad_out`` in ``out``'s layout when its innermost stride is not 1
(``permute_to_matching_layout``, cuDNN >= 9.5.1), e.g. the expanded gradient of ``out.sum()``.
"""
from __future__ import annotations

from typing import Any

import torch

#: the cuDNN engine's workspace of the fused SDPA forward and backward kernels, bytes, by compute
#: capability. Measured on an H200 (sm90), torch 2.11.0+cu130 (shared/gpu-truth/h200-2026-11-27):
#: 256 bytes forward and 256 backward in every recorded call — sdpa_backends.py (B=4, H=16,
#: L=1024, D=64, bf16, causal, with and without GQA) and compiled_gpt.py --mode eager (B=8, H=12,
#: L=512, D=64, bf16 autocast, causal): backward 17,039,616 = 16 MiB dQ_accum + 256 KiB
#: softmax_sum + 256, and 12,779,776 = 12 MiB + 192 KiB + 256.
ENGINE_WORKSPACE: dict[tuple[int, int], int] = {(9, 0): 256}
ENGINE_NOTE = ("cuDNN attention's engine workspace on this compute capability (measured only on sm90: "
               "vram.run.kernels.sdpa_cudnn.ENGINE_WORKSPACE)")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _engine(cc: tuple[int, int]) -> tuple[int, list[tuple[str, Any]]]:
    """The engine's measured scratch on `cc`, or 0 and a note naming what is not charged."""
    if cc in ENGINE_WORKSPACE:
        return ENGINE_WORKSPACE[cc], []
    return 0, [("note", ENGINE_NOTE)]


def _workspace(nbytes: int, base: int) -> list[tuple[str, Any]]:
    """``CUDACachingAllocator::get()->allocate(workspace_size)``, freed when the call returns (a
    0-byte request takes nothing)."""
    return [("tmp", nbytes), ("free", base)] if nbytes > 0 else []


def cudnn_forward_plan(args: tuple[Any, ...], cc: tuple[int, int]) -> list[tuple[str, Any]]:
    """``_cudnn_attention_forward``: the philox seed and offset (int64 scalars on the GPU), then
    ``run_cudnn_SDP_fprop``: ``o`` in q's layout, ``softmaxstats`` fp32 [B, H, Sq, 1] when training,
    the graph's workspace."""
    plan: list[tuple[str, Any]] = [("out", 6), ("out", 7), ("out", 0)]
    if len(args) > 4 and args[4]:
        plan.append(("out", 1))
    engine, note = _engine(cc)
    return plan + _workspace(engine, 0) + note


def _grad_out_copy(grad_out: torch.Tensor, out: torch.Tensor) -> int:
    """Bytes of ``permute_to_matching_layout(o, dO_)`` when dO's innermost stride is not 1:
    ``dO.permute(o's outer-to-inner order).contiguous()`` (nothing if that is already contiguous)."""
    if grad_out.dim() == 0 or grad_out.stride(-1) == 1:
        return 0
    order = sorted(range(out.dim()), key=lambda d: -out.stride(d))  # stable, as std::stable_sort
    return 0 if grad_out.permute(order).is_contiguous() else _nbytes(grad_out)


def cudnn_backward_plan(args: tuple[Any, ...], cc: tuple[int, int]) -> list[tuple[str, Any]]:
    """``_cudnn_attention_backward`` (dense): ``dq, dk, dv = empty_like(q, k, v)``, then
    ``run_cudnn_SDP_bprop``: the matching-layout ``grad_out`` copy, the graph's workspace."""
    grad_out, q, k, v, out = args[0], args[1], args[2], args[3], args[4]
    b, hq, sq, dqk = q.shape
    skv, dv = k.size(2), v.size(3)
    plan: list[tuple[str, Any]] = [("out", 0), ("out", 1), ("out", 2)]
    if 0 in (q.numel(), k.numel(), v.numel(), out.numel(), grad_out.numel()):
        return plan  # run_cudnn_SDP_bprop: nothing for 0-element tensors
    copy = _grad_out_copy(grad_out, out)
    if copy:
        plan.append(("tmp", copy))
    workspace = b * hq * sq * dqk * 4 + b * hq * sq * 4  # dQ_accum, softmax_sum
    if k.size(1) != hq or v.size(1) != hq:  # dK_fullhead, dV_fullhead
        workspace += b * hq * skv * (dqk + dv) * q.element_size()
    engine, note = _engine(cc)
    plan += _workspace(workspace + engine, 1 if copy else 0)
    return plan + ([("free", 0)] if copy else []) + note
