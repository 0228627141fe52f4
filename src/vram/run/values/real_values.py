"""The real-values mode of a simulated run (``vram run --values real``).

By default a simulated run knows only values that need no model arithmetic (`vram.run.values.known`:
factories, host data, small ops on those), and a read of any other value gets a placeholder.
In this mode every simulated storage keeps a CPU copy of its contents, whatever its size, and
every aten op also runs on those copies: losses, logits, gradients and parameters after an
optimizer step have the values the CPU computes, so data-dependent programs (``if loss.item() <
best``, ``generate()`` stopping at EOS, MoE routing, ``1 / mse.item()``) take the branch the
data gives. The simulated allocator sees exactly what it sees in the default mode: the copies
are host memory, never charged.

Cost: host memory for a copy of every live simulated storage (about the run's
``memory_allocated()``, plus what the CPU kernels need while they run) and the CPU time of the
model's arithmetic. Before a copy is made, `SimState.reserve` checks the host's available memory
(`vram.devices.host.available_memory`: ``MemAvailable``, and a cgroup limit where one is set)
and stops the run with `HostMemoryError` when the copy would leave less than
`vram.run.memory.storages.HOST_RESERVE` free: a run whose values do not fit is refused, never
continued with some values missing.

Kernels that exist only for CUDA have CPU implementations here (`CUDA_ONLY`): the fused
attention kernels a GPU's ``scaled_dot_product_attention`` runs (flash, memory-efficient,
cuDNN, and their variable-length forms for jagged nested tensors, sequence by sequence), computed
by PyTorch's CPU flash kernel or, with dropout, by the math formula with a
mask drawn from the CPU generator and kept for the backward. Any other op that fails on the CPU
leaves its outputs unknown, and a read of them is reported as in the default mode (with the
reason), never answered silently.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_map

from .limits import HostMemoryError

if TYPE_CHECKING:  # the run state is passed in; values sit below the storages that hold them
    from vram.run.memory.storages import ChargedStorage, SimState

__all__ = ["CUDA_ONLY", "HostMemoryError"]
_META = torch.device("meta")
_aten = torch.ops.aten

# -- CUDA-only kernels on the CPU -------------------------------------------------------------------
def _shaped_like_meta(func: Any, args: Any, kwargs: Any) -> Any:
    """The op's outputs on meta (sizes, dtypes, and where it returns None), as CPU zeros."""
    def meta(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=_META)
        return x
    out = func(*tree_map(meta, args), **tree_map(meta, kwargs))
    return [torch.zeros(o.size(), dtype=o.dtype) if isinstance(o, torch.Tensor) else o for o in out]


def _repeat_kv(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention: `t` (key or value) with each head repeated for its query heads."""
    groups = q.size(-3) // t.size(-3)
    return t if groups == 1 else t.repeat_interleave(groups, -3)


def _fold_kv(grad: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The gradient of a repeated key/value head: the sum over its query heads."""
    groups = grad.size(-3) // t.size(-3)
    if groups == 1:
        return grad
    return grad.unflatten(-3, (t.size(-3), groups)).sum(-3)


def _scores_mask(q: torch.Tensor, k: torch.Tensor, bias: Any, causal: bool) -> Any:
    """The additive mask of an attention: the bias, and -inf above the diagonal when causal
    (top-left aligned, as the kernels' ``is_causal``)."""
    mask = None if bias is None else bias.to(torch.float32)
    if causal:
        upper = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).triu(1)
        causal_mask = torch.zeros(upper.shape).masked_fill(upper, -math.inf)
        mask = causal_mask if mask is None else mask + causal_mask
    return mask


def _probabilities(q: torch.Tensor, k: torch.Tensor, bias: Any, causal: bool, scale: Any
                   ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """softmax(scale · q kᵀ + mask) in float32 (as the fused kernels accumulate), its rows'
    log-sum-exp, and the scale."""
    factor = scale if scale is not None else 1.0 / math.sqrt(q.size(-1))
    s = q.to(torch.float32) @ k.to(torch.float32).transpose(-2, -1) * factor
    mask = _scores_mask(q, k, bias, causal)
    if mask is not None:
        s = s + mask
    return torch.softmax(s, -1), torch.logsumexp(s, -1), factor


def _math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Any, causal: bool, scale: Any,
                    keep: Any, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with dropout mask `keep` (weights kept are scaled by 1/(1-p)): the output in
    the inputs' dtype, and the log-sum-exp of the scaled scores."""
    attn, lse, _ = _probabilities(q, k, bias, causal, scale)
    if keep is not None:
        attn = attn * keep / (1 - p)
    return (attn @ v.to(torch.float32)).to(q.dtype), lse


def _math_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Any,
                             causal: bool, scale: Any, keep: torch.Tensor, p: float) -> tuple[torch.Tensor, ...]:
    """The gradients of `_math_attention` for q, k, v (by the chain rule, in float32: the
    kernels run below autograd, so no graph can be recorded here)."""
    attn, _, factor = _probabilities(q, k, bias, causal, scale)
    dropped = attn * keep / (1 - p)
    g = grad.to(torch.float32)
    dv = dropped.transpose(-2, -1) @ g
    dp = (g @ v.to(torch.float32).transpose(-2, -1)) * keep / (1 - p)
    ds = attn * (dp - (dp * attn).sum(-1, keepdim=True)) * factor
    dq, dk = ds @ k.to(torch.float32), ds.transpose(-2, -1) @ q.to(torch.float32)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Any, p: float, causal: bool, scale: Any,
             block: ChargedStorage | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused attention forward's output and log-sum-exp ([B, H, L], float32). Without dropout
    PyTorch's CPU flash kernel; with dropout the math, its mask kept on the output's block for
    the backward."""
    k, v = _repeat_kv(q, k), _repeat_kv(q, v)
    if p == 0.0:
        return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
    keep = torch.empty(q.shape[:-1] + (k.size(-2),)).bernoulli_(1 - p)  # the CPU generator: sim.device_rng
    if block is not None:
        block.aux = keep
    return _math_attention(q, k, v, bias, causal, scale, keep, p)


def _backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, bias: Any, p: float, causal: bool, scale: Any, block: ChargedStorage | None,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `_forward` for query, key and value."""
    kr, vr = _repeat_kv(q, k), _repeat_kv(q, v)
    if p == 0.0:
        lse_cpu = lse.to(torch.float32).transpose(1, 2).contiguous().transpose(1, 2)  # its own layout
        gq, gk, gv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, kr, vr, out, lse_cpu, 0.0, causal, attn_mask=bias, scale=scale)
    else:
        keep = block.aux if block is not None else None
        if keep is None:
            raise RuntimeError("the dropout mask of this attention's forward is gone")
        gq, gk, gv = _math_attention_backward(grad, q, kr, vr, bias, causal, scale, keep, p)
    return gq, _fold_kv(gk, k), _fold_kv(gv, v)


def _flash(sim: SimState, func: Any, args: Any, kwargs: Any, cpu: Any, out: Any) -> Any:
    q, k, v = cpu[0][:3]
    p, causal = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0), args[4] if len(args) > 4 else \
        kwargs.get("is_causal", False)
    res = _shaped_like_meta(func, args, kwargs)
    res[0], lse = _forward(q, k, v, None, p, causal, kwargs.get("scale"), _block(sim, out))
    res[1].copy_(lse)
    return tuple(res)


def _flash_backward(sim: SimState, func: Any, args: Any, kwargs: Any, cpu: Any, out: Any) -> Any:
    a, kw = cpu
    return _backward(a[0], a[1], a[2], a[3], a[4], a[5], None, a[10], a[11], kw.get("scale"), sim.block_of(args[4]))


def _efficient(sim: SimState, func: Any, args: Any, kwargs: Any, cpu: Any, out: Any) -> Any:
    (q, k, v, bias, *rest), kw = cpu
    p = rest[1] if len(rest) > 1 else kw.get("dropout_p", 0.0)
    causal = rest[2] if len(rest) > 2 else kw.get("is_causal", False)
    res = _shaped_like_meta(func, args, kwargs)
    res[0], lse = _forward(q, k, v, bias, p, causal, kw.get("scale"), _block(sim, out))
    res[1][..., :lse.size(-1)].copy_(lse[..., :res[1].size(-1)])  # padded to 32 (or empty: no lse asked)
    return tuple(res)


def _efficient_backward(sim: SimState, func: Any, args: Any, kwargs: Any, cpu: Any, out: Any) -> Any:
    (grad, q, k, v, bias, o, lse, _, _, p, mask, *rest), kw = cpu
    if bias is not None and mask[3]:
        raise NotImplementedError("no CPU values for the gradient of an attention bias")
    causal = rest[0] if rest else kw.get("is_causal", False)
    gq, gk, gv = _backward(grad, q, k, v, o, lse[..., :q.size(-2)], bias, p, causal, kw.get("scale"),
                           sim.block_of(args[5]))
    return gq, gk, gv, None if bias is None or not mask[3] else torch.zeros_like(bias)


def _cudnn(sim: SimState, func: Any, args: Any, kwargs: Any, cpu: Any, out: Any) -> Any:
    (q, k, v, bias, _, *rest), kw = cpu
    p = rest[0] if rest else kw.get("dropout_p", 0.0)
    causal = rest[1] if len(rest) > 1 else kw.get("is_causal", False)
    res = _shaped_like_meta(func, args, kwargs)
    res[0], lse = _forward(q, k, v, bias, p, causal, kw.get("scale"), _block(sim, out))
    if res[1] is not None and res[1].numel():
        res[1].copy_(lse.reshape(res[1].shape))
    return tuple(res)


def _cudnn_backward(sim: SimState, func: Any, args: Any, kwargs: Any, cpu: Any, out: Any) -> Any:
    (grad, q, k, v, o, lse, _, _, bias, _, _, _, _, p, causal), kw = cpu
    return _backward(grad, q, k, v, o, lse.reshape(lse.shape[:3]), bias, p, causal, kw.get("scale"),
                     sim.block_of(args[4]))


# -- the variable-length kernels jagged nested tensors call (cu_seqlens): each sequence on its own
def _spans(cu: Any) -> list[tuple[int, int]]:
    if cu is None:
        raise NotImplementedError("no CPU values for a direct dense call of a variable-length attention kernel")
    bounds = [int(b) for b in cu.tolist()]
    return list(zip(bounds[:-1], bounds[1:]))


def _sequence(t: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    """Rows ``[start, end)`` of a packed ``[total, H, D]`` tensor as ``[1, H, L, D]``."""
    return t[span[0]:span[1]].transpose(0, 1).unsqueeze(0)


def _no_dropout(p: float, causal_type: int = 0) -> None:
    if p:
        raise NotImplementedError("no CPU values for variable-length attention with dropout")
    if causal_type > 1:
        raise NotImplementedError("no CPU values for variable-length attention causal from the bottom right")


def _flash_varlen(sim: SimState, func: Any, args: Any, kwargs: Any, cpu: Any, out: Any) -> Any:
    """``_flash_attention_forward`` over ``cu_seqlens``: out ``[total_q, H, D]``, logsumexp
    ``[H, total_q]`` (``mha_varlen_fwd``'s unpadded layout)."""
    (q, k, v, cu_q, cu_k, _, _, p, causal, *_), kw = cpu
    _no_dropout(p)
    res = _shaped_like_meta(func, args, kwargs)
    for sq, sk in zip(_spans(cu_q), _spans(cu_k)):
        if sq[1] > sq[0]:
            o, lse = _forward(_sequence(q, sq), _sequence(k, sk), _sequence(v, sk), None, 0.0, causal,
                              kw.get("scale"), None)
            res[0][sq[0]:sq[1]] = o[0].transpose(0, 1)
            res[1][:, sq[0]:sq[1]] = lse[0]
    return tuple(res)


def _flash_varlen_backward(sim: SimState, func: Any, args: Any, kwargs: Any, cpu: Any, out: Any) -> Any:
    (g, q, k, v, o, lse, cu_q, cu_k, _, _, p, causal, *_), kw = cpu
    _no_dropout(p)
    grads = [torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)]
    for sq, sk in zip(_spans(cu_q), _spans(cu_k)):
        if sq[1] > sq[0]:
            gq, gk, gv = _backward(_sequence(g, sq), _sequence(q, sq), _sequence(k, sk), _sequence(v, sk),
                                   _sequence(o, sq), lse[:, sq[0]:sq[1]].unsqueeze(0), None, 0.0, causal,
                                   kw.get("scale"), None)
            for grad, part, span in zip(grads, (gq, gk, gv), (sq, sk, sk)):
                grad[span[0]:span[1]] = part[0].transpose(0, 1)
    return tuple(grads)


def _efficient_varlen(sim: SimState, func: Any, args: Any, kwargs: Any, cpu: Any, out: Any) -> Any:
    """``_efficient_attention_forward`` over ``cu_seqlens``: out ``[1, total_q, H, Dv]``, logsumexp
    ``[b, H, ceil(max_q / 32) * 32]`` (each sequence's rows first)."""
    (q, k, v, _, cu_q, cu_k, _, _, p, causal_type, *_), kw = cpu
    _no_dropout(p, causal_type)
    res = _shaped_like_meta(func, args, kwargs)
    for i, (sq, sk) in enumerate(zip(_spans(cu_q), _spans(cu_k))):
        if sq[1] > sq[0]:
            o, lse = _forward(_sequence(q[0], sq), _sequence(k[0], sk), _sequence(v[0], sk), None, 0.0,
                              causal_type == 1, kw.get("scale"), None)
            res[0][0, sq[0]:sq[1]] = o[0].transpose(0, 1)
            if res[1].size(-1):
                res[1][i, :, :sq[1] - sq[0]] = lse[0]
    return tuple(res)


def _efficient_varlen_backward(sim: SimState, func: Any, args: Any, kwargs: Any, cpu: Any, out: Any) -> Any:
    (g, q, k, v, bias, o, cu_q, cu_k, _, _, lse, p, _, _, causal_type, *_), kw = cpu
    if bias is not None:
        raise NotImplementedError("no CPU values for variable-length attention with a bias")
    _no_dropout(p, causal_type)
    grads = [torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)]
    for i, (sq, sk) in enumerate(zip(_spans(cu_q), _spans(cu_k))):
        if sq[1] > sq[0]:
            parts = _backward(_sequence(g[0], sq), _sequence(q[0], sq), _sequence(k[0], sk), _sequence(v[0], sk),
                              _sequence(o[0], sq), lse[i:i + 1, :, :sq[1] - sq[0]], None, 0.0, causal_type == 1,
                              kw.get("scale"), None)
            for grad, part, span in zip(grads, parts, (sq, sk, sk)):
                grad[0, span[0]:span[1]] = part[0].transpose(0, 1)
    return (*grads, torch.zeros(()))  # grad_bias: the meta kernel's 0-dim stand-in (no bias)


def _block(sim: SimState, out: Any) -> ChargedStorage | None:
    """The block of an attention forward's output (its dropout mask goes there)."""
    first = out[0] if isinstance(out, (tuple, list)) and out else None
    return sim.block_of(first) if isinstance(first, torch.Tensor) else None


def _histc(sim: SimState, func: Any, args: Any, kwargs: Any, cpu: Any, out: Any) -> Any:
    """``_histc_cuda`` (aten/src/ATen/native/cuda/SummaryOps.cu) counts integer tensors too (the CPU
    kernel takes floating types only; MoE layers count tokens per expert so): bounds cast to the
    input's type, the data's min and max when equal, widened by 1 when still equal; a value in
    [min, max] goes to bin ``(x - min) * bins / (max - min)`` (integer division), the last closed."""
    (x, bins, *rest), kw = cpu
    if x.is_floating_point():
        return func(*cpu[0], **cpu[1])
    lo, hi = int(rest[0] if rest else kw.get("min", 0)), int(rest[1] if len(rest) > 1 else kw.get("max", 0))
    if lo == hi:
        lo, hi = int(x.min()), int(x.max())
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    if lo > hi:
        raise RuntimeError("max must be larger than min")
    v = x.flatten().long()
    v = v[(v >= lo) & (v <= hi)]
    return torch.bincount(((v - lo) * bins // (hi - lo)).clamp_max(bins - 1), minlength=bins).to(x.dtype)


#: CPU values of aten ops that have only CUDA kernels: (sim, op, args, kwargs, CPU (args,
#: kwargs), the op's simulated outputs or None) -> the CPU outputs, shaped as the op's
CUDA_ONLY = {
    _aten._scaled_dot_product_flash_attention.default: _flash,
    _aten._scaled_dot_product_flash_attention_backward.default: _flash_backward,
    _aten._scaled_dot_product_efficient_attention.default: _efficient,
    _aten._scaled_dot_product_efficient_attention_backward.default: _efficient_backward,
    _aten._scaled_dot_product_cudnn_attention.default: _cudnn,
    _aten._scaled_dot_product_cudnn_attention_backward.default: _cudnn_backward,
    _aten.histc.default: _histc,
    _aten._flash_attention_forward.default: _flash_varlen,
    _aten._flash_attention_backward.default: _flash_varlen_backward,
    _aten._efficient_attention_forward.default: _efficient_varlen,
    _aten._efficient_attention_backward.default: _efficient_varlen_backward,
}
