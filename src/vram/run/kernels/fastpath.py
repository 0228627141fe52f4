"""``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` inference fast paths, as on a GPU.

In ``eval()`` without grad, ``MultiheadAttention.forward`` calls ``torch._native_multi_head_attention``
and ``TransformerEncoderLayer.forward`` ``torch._transformer_encoder_layer_fwd`` when the checks in
``torch/nn/modules/activation.py`` / ``transformer.py`` hold, one of them
``not torch.overrides.has_torch_function(tensor_args)``. vram's own torch-function mode makes that
true, so a simulated run took the layer-by-layer slow path, which allocates differently. Here:

* `patch_fast_paths` gives those three ``forward`` methods (``TransformerEncoder`` too) a
  ``torch.overrides.has_torch_function`` that ignores vram's modes (any other mode or a tensor
  subclass still counts, as it does on a GPU);
* `FUSED` runs the fused ops as their CUDA kernels do, op by op, so each allocation is the one the
  CUDA source makes (cited per step); the ops they call are vram's usual models;
* `fused_values` gives the outputs the values of the fused op's CPU kernel (the composites leave
  their scratch unwritten, so what they computed is not the op's value);
* the nested-tensor path (``TransformerEncoder`` with ``src_key_padding_mask``) packs the batch
  into a `vram.run.kernels.nested_fastpath.SimulatedNestedTensor` and runs each layer on its buffer.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves

from vram.run.values import known

from .functions import clone_with_globals
from .nested_fastpath import (
    SimulatedNestedTensor,
    from_mask,
    left_aligned,
    nested_attention,
    nested_values,
    padded_metadata,
    to_padded,
)
from .sdpa_choice import sdpa_args, select_sdpa_backend

_FUSED_SDPA = ("flash", "efficient", "cudnn")


def _overridden(a: Any) -> bool:
    """C++ ``check_has_torch_function``: not exactly a Tensor/Parameter and a ``__torch_function__``
    other than ``_disabled_torch_function_impl``."""
    if type(a) in (torch.Tensor, nn.Parameter, SimulatedNestedTensor):  # the last: a nested tensor on a GPU
        return False
    tf = getattr(a, "__torch_function__", None)
    return tf is not None and tf is not torch._C._disabled_torch_function_impl


def has_torch_function_besides(modes: tuple[type, ...]) -> Callable[[Any], bool]:
    """``torch.overrides.has_torch_function`` with the torch-function modes of types `modes` unseen."""
    def has_torch_function(args: Any) -> bool:
        if not torch._C._is_torch_function_enabled():
            return False
        stack = torch.overrides._get_current_function_mode_stack()
        return any(not isinstance(m, modes) for m in stack) or any(_overridden(a) for a in args)
    return has_torch_function


class _Namespace:
    """A module seen through `over`: attribute `name` is ``over[name]`` if given, else the module's."""

    def __init__(self, base: Any, **over: Any) -> None:
        self._base, self._over = base, over

    def __getattr__(self, name: str) -> Any:
        return self._over[name] if name in self._over else getattr(self._base, name)


def patch_fast_paths(modes: tuple[type, ...]) -> Callable[[], None]:
    """Let the fast-path checks of ``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` and
    ``nn.TransformerEncoder`` ignore torch-function modes of types `modes`; returns the restore."""
    check = has_torch_function_besides(modes)
    view = _Namespace(torch, overrides=_Namespace(torch.overrides, has_torch_function=check))
    classes = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder)
    originals = {cls: cls.__dict__["forward"] for cls in classes}
    for cls, forward in originals.items():
        cls.forward = clone_with_globals(forward, torch=view)  # type: ignore[method-assign]

    def restore() -> None:
        for cls, forward in originals.items():
            cls.forward = forward  # type: ignore[method-assign]
    return restore


# -- the fused kernels ---------------------------------------------------------------------------
def masked_softmax_cuda(x: torch.Tensor, mask: torch.Tensor, dim: int | None, mask_type: int | None) -> torch.Tensor:
    """``masked_softmax_cuda`` (native/cuda/SoftMax.cu): ``empty_like(input)`` first; the persistent
    kernel (row <= 1024 elements and <= 4096 bytes, contiguous mask, last dim) writes it; otherwise
    ``softmax(input.masked_fill(mask, -inf), dim)`` replaces it (a [B, T] padding mask viewed and
    expanded to the input first)."""
    out = torch.empty_like(x)
    if mask_type not in (0, 1, 2):
        raise RuntimeError("Mask Type should be 0 (src_mask), 1 (src_key_padding_mask), or 2 (default_mask)")
    bxt = (mask_type == 1 and x.dim() == 4 and mask.dim() == 2 and x.size(0) == mask.size(0)
           and x.size(2) == mask.size(1) and x.size(3) == mask.size(1))
    txt = (mask_type == 0 and x.dim() == 4 and mask.dim() == 2 and x.size(3) == mask.size(1)
           and x.size(2) == mask.size(0) and mask.size(0) == mask.size(1))
    if not (mask.shape == x.shape or bxt or txt):
        raise RuntimeError(f"Mask shape should match input. mask: {list(mask.shape)} input: {list(x.shape)}")
    if txt:
        mask = mask.expand(x.shape)
    dim = x.dim() - 1 if dim is None else dim
    n = x.size(dim)
    if n > 1024 or n * x.element_size() > 4096 or not mask.is_contiguous() or dim < x.dim() - 1:
        if bxt:
            mask = mask.view(mask.size(0), 1, 1, mask.size(1)).expand(x.shape)
        filled = x.masked_fill(mask, -math.inf)
        res = torch.softmax(filled, dim)
        del out, filled  # `output = at::softmax(...)` frees empty_like's block, then the temporary
        return res
    return out


def _masked_softmax(scores: torch.Tensor, mask: torch.Tensor | None, mask_type: int | None) -> torch.Tensor:
    """attention.cpp ``masked_softmax``: a non-bool mask becomes a bool copy (freed on return);
    without a mask, ``_softmax_out(scores, scores, ...)`` works in place."""
    if mask is None:
        torch.ops.aten._softmax.out(scores, scores.dim() - 1, False, out=scores)
        return scores
    if mask.dtype != torch.bool:
        mask = mask.to(torch.bool)
    return masked_softmax_cuda(scores, mask, scores.dim() - 1, mask_type)


def native_mha_cuda(args: tuple[Any, ...], kwargs: dict[str, Any], major: int, minor: int) -> tuple[Any, Any]:
    """``native_multi_head_attention_cuda`` (native/transformers/cuda/attention.cu), dense inputs."""
    names = ("query", "key", "value", "embed_dim", "num_head", "qkv_weight", "qkv_bias", "proj_weight",
             "proj_bias", "mask", "need_weights", "average_attn_weights", "mask_type")
    p: dict[str, Any] = {"mask": None, "need_weights": True, "average_attn_weights": True, "mask_type": None}
    p.update(zip(names, args))
    p.update(kwargs)
    query, key, value, mask = p["query"], p["key"], p["value"], p["mask"]
    d, heads, need_weights = p["embed_dim"], p["num_head"], p["need_weights"]
    if any(t.is_nested for t in (query, key, value)):
        raise NotImplementedError(_NESTED)
    b, dh = query.size(0), d // heads
    if query is key and key is value and not need_weights:
        # views of the input only to ask select_sdp_backend; no mask and a fused choice: SDPA
        q = query.view(b, -1, heads, dh).transpose(1, 2)
        backend = select_sdpa_backend(sdpa_args((q, q, q), {"attn_mask": mask}), major, minor)
        if mask is None and backend in _FUSED_SDPA:
            x = F.linear(query, p["qkv_weight"], p["qkv_bias"])  # [B, T, 3D]
            c = [t.view(b, -1, heads, dh).transpose(1, 2) for t in x.chunk(3, -1)]
            y = F.scaled_dot_product_attention(c[0], c[1], c[2], None, 0.0, False)
            past = y.transpose(1, 2).reshape(b, -1, d)  # a view of a [B, T, NH, DH] kernel output
            out = F.linear(past, p["proj_weight"], p["proj_bias"])
            del past, y, c, x  # the C++ locals, last declared first
            return out, None
    qkv = _qkv_projection(query, key, value, d, p["qkv_weight"])  # attention.cpp qkv_projection
    if qkv.numel() == 0:
        return torch.empty_like(query), None
    t = qkv.size(1)
    # transform_bias_rescale_qkv_cuda: at::empty({3, B, NH, T, DH}, qkv_bias.options()), split in 3
    q, k, v = torch.empty((3, b, heads, t, dh), dtype=p["qkv_bias"].dtype,
                          device=p["qkv_bias"].device).view(3 * b, heads, t, dh).split(b, 0)
    del qkv  # `qkv = Tensor(); // Not used any more, allow free`
    # bmm_nt, then masked_softmax; the bmm output is freed when the softmax result replaces it
    qkt = torch.bmm(q.view(b * heads, t, dh), k.view(b * heads, t, dh).transpose(2, 1)).view(b, heads, t, t)
    qkt = _masked_softmax(qkt, mask, p["mask_type"])
    # bmm_nn(q, qkt, v): the context is written into q's storage (bmm_out), "reuse storage for q"
    ctx = torch.bmm(qkt.view(b * heads, t, t), v.view(b * heads, t, dh), out=q.reshape(b * heads, t, dh))
    ctx = ctx.view(b, heads, t, dh)
    if not need_weights:
        qkt = None
    # transform0213_gemm_nt_bias: permute(0, 2, 1, 3).contiguous(), linear on [B*T, D]; its copy is
    # freed when it returns, the q/k/v block when this function does
    a = ctx.permute(0, 2, 1, 3).contiguous().view(b * t, d)
    proj = F.linear(a, p["proj_weight"], p["proj_bias"]).view(b, t, -1)
    del a
    if need_weights and p["average_attn_weights"]:
        assert qkt is not None
        qkt = qkt.sum(1)
        qkt.div_(heads)
    del ctx, q, k, v  # the q/k/v block: a local of the C++ function until it returns
    return proj, qkt


def _padded_nested_attention(nt: SimulatedNestedTensor, heads: int, qkv_w: torch.Tensor, qkv_b: torch.Tensor,
                             proj_w: torch.Tensor, proj_b: torch.Tensor) -> torch.Tensor:
    """``native_multi_head_attention_cuda``'s general branch on a nested input (no mask, no weights):
    ``gemm_nt`` (``NestedTensor_matmul``: ``mm`` on the buffer), ``transform_bias_rescale_qkv_cuda``
    (the block padded to the longest sequence rounded up to 8, then its int32 offsets and sizes,
    ``2 * N + 1`` ints, freed), ``bmm_nt``, ``_nested_tensor_softmax_with_shape``
    (``NestedTensor_to_mask`` copied to the GPU, ``[N, T]`` bool, then ``_masked_softmax`` with mask
    type 1; the mask dies on return, then the scores), ``bmm_nn`` into q's storage, and
    ``transform0213_gemm_nt_bias``: ``nested_from_padded`` with the 0213 transform, then ``addmm``."""
    lengths = nt.lengths()
    n, d, total = len(lengths), int(nt.sizes[0, 1]), sum(lengths)
    dh, t = d // heads, max(lengths) + (8 - max(lengths) % 8) % 8
    qkv = torch.mm(nt.rows(), qkv_w.t())
    block = torch.empty((3, n, heads, t, dh), dtype=qkv_b.dtype, device=qkv_b.device)
    metadata = torch.empty(2 * n + 1, dtype=torch.int32, device=qkv_b.device)
    del metadata
    q, k, v = block.view(3 * n, heads, t, dh).split(n, 0)
    del qkv, block
    scores = torch.bmm(q.view(n * heads, t, dh), k.view(n * heads, t, dh).transpose(2, 1)).view(n, heads, t, t)
    mask = torch.empty((n, t), dtype=torch.bool, device=scores.device)
    probs = masked_softmax_cuda(scores, mask, 3, 1)
    del mask
    scores = probs
    del probs
    ctx = torch.bmm(scores.view(n * heads, t, t), v.view(n * heads, t, dh), out=q.reshape(n * heads, t, dh))
    del scores
    rows = torch.empty((total, d), dtype=ctx.dtype, device=ctx.device)  # nested_from_padded's output,
    padded_metadata(ctx.view(n, heads, t, dh), nt.sizes)  # then its metadata
    proj = torch.addmm(proj_b, rows, proj_w.t())
    del rows, ctx, q, k, v  # nested_a when transform0213 returns; the q/k/v block when the function does
    return proj


def _qkv_projection(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, d: int,
                    w: torch.Tensor) -> torch.Tensor:
    """attention.cpp ``qkv_projection``: ``gemm_nt`` is ``at::native::matmul(x, w.t())``."""
    if key is value:
        if query is key:
            return torch.matmul(query, w.t())
        wq, wkv = w.split_with_sizes([d, 2 * d], 0)
        return torch.cat([torch.matmul(query, wq.t()), torch.matmul(key, wkv.t())], 2)
    wq, wk, wv = w.chunk(3, 0)
    return torch.cat([torch.matmul(query, wq.t()), torch.matmul(key, wk.t()), torch.matmul(value, wv.t())], 2)


def encoder_layer_cuda(args: tuple[Any, ...], kwargs: dict[str, Any], major: int, minor: int) -> torch.Tensor:
    """``transformer_encoder_layer_forward`` (native/transformers/transformer.cpp), dense input."""
    names = ("src", "embed_dim", "num_heads", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias", "use_gelu",
             "norm_first", "layer_norm_eps", "ln1_w", "ln1_b", "ln2_w", "ln2_b", "w1", "b1", "w2", "b2",
             "mask", "mask_type")
    p: dict[str, Any] = {"mask": None, "mask_type": None}
    p.update(zip(names, args))
    p.update(kwargs)
    src, d, eps = p["src"], p["embed_dim"], p["layer_norm_eps"]
    nested = src if isinstance(src, SimulatedNestedTensor) else None
    if nested is not None:  # the layer runs on the buffer as [1, sum(L_i), D]
        if nested.buffer.numel() == 0:
            return SimulatedNestedTensor(nested.buffer, nested.sizes)
        src = nested.rows().unsqueeze(0)
    elif src.is_nested:
        raise NotImplementedError(_NESTED)
    elif src.numel() == 0:
        return src.clone()

    def norm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, [d], w, bias, eps)

    x = norm(src, p["ln1_w"], p["ln1_b"]) if p["norm_first"] else src
    if nested is not None:
        attention_input = SimulatedNestedTensor(x.view(-1), nested.sizes)
        weights = (p["num_heads"], p["qkv_weight"], p["qkv_bias"], p["proj_weight"], p["proj_bias"])
        fused = nested_attention(attention_input, *weights, major, minor)
        x = (fused if fused is not None else _padded_nested_attention(attention_input, *weights)).unsqueeze(0)
        del attention_input, fused
    else:
        x = native_mha_cuda((x, x, x, d, p["num_heads"], p["qkv_weight"], p["qkv_bias"], p["proj_weight"],
                             p["proj_bias"], p["mask"], False, True, p["mask_type"]), {}, major, minor)[0]
    x.add_(src)
    if not p["norm_first"]:
        x = norm(x, p["ln1_w"], p["ln1_b"])
    pre_ffn = x
    if p["norm_first"]:
        x = norm(x, p["ln2_w"], p["ln2_b"])
    # ffn / linear_for_ffn: _addmm_activation(b1, x[B*T, D], w1.t(), use_gelu), then addmm(b2, ., w2.t())
    bt = x.size(0) * x.size(1)
    h = torch._addmm_activation(p["b1"], x.view(bt, x.size(2)), p["w1"].t(), use_gelu=bool(p["use_gelu"]))
    h = h.view(x.size(0), x.size(1), -1)
    x = torch.addmm(p["b2"], h.view(bt, h.size(2)), p["w2"].t()).view(h.size(0), h.size(1), -1)
    del h
    x.add_(pre_ffn)
    if not p["norm_first"]:
        x = norm(x, p["ln2_w"], p["ln2_b"])
    del pre_ffn  # freed when the C++ function returns
    return x if nested is None else SimulatedNestedTensor(x.view(-1), nested.sizes)


_NESTED = ("vram run: nested tensors into nn.MultiheadAttention / TransformerEncoderLayer's fused kernels "
           "outside nn.TransformerEncoder's nested-tensor fast path are not modelled")


#: the aten op behind each fused function: its CPU kernel gives the composite's outputs their values
_ATEN = {torch._native_multi_head_attention: torch.ops.aten._native_multi_head_attention.default,
         torch._transformer_encoder_layer_fwd: torch.ops.aten._transformer_encoder_layer_fwd.default}


def fused_values(sim: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    """The values of a fused op's outputs: those its CPU kernel computes from the inputs' values
    (`known.propagate`: unknown inputs leave them unknown). The composites in `FUSED` allocate what
    the CUDA kernels allocate but never write their scratch (``empty`` q/k/v, the persistent
    softmax's output), so what they computed is not the op's value (``--values real`` read it)."""
    if isinstance(out, SimulatedNestedTensor) or func is torch.nested.to_padded_tensor:
        nested_values(sim, func, args, kwargs, out)
        return
    op = _ATEN.get(func)
    if op is not None:
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        with _disable_current_modes():  # the CPU kernel on host copies, below the simulation
            known.propagate(sim, op, args, kwargs, out, inputs)


#: fused ops -> their CUDA composite, called with (args, kwargs, major, minor) under the function mode
FUSED: dict[Any, Callable[[tuple[Any, ...], dict[str, Any], int, int], Any]] = {
    torch._native_multi_head_attention: native_mha_cuda,
    torch._transformer_encoder_layer_fwd: encoder_layer_cuda,
    torch._nested_tensor_from_mask: from_mask,
    torch._nested_tensor_from_mask_left_aligned: left_aligned,
    torch.nested.to_padded_tensor: to_padded,
}


def fused_device_block(sim: Any, args: tuple[Any, ...]) -> Any:
    """The simulated block a fused call's first argument lives in (a nested tensor's: its buffer's)."""
    first = args[0] if args else None
    return sim.block_of(first.buffer if isinstance(first, SimulatedNestedTensor) else first)
