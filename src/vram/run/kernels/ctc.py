"""CTC loss on CUDA (layer 4; needs torch): ``native/cuda/LossCTC.cu`` and the choice of cuDNN's
kernel (``native/LossCTC.cpp`` ``ctc_loss_impl``, ``native/cudnn/LossCTC.cpp``).

``ctc_loss_gpu_template`` (forward, ``_ctc_loss``), per call: ``target_lengths_t`` and
``input_lengths_t`` (``at::tensor(lengths, kLong)``: made on the host, copied to the GPU, 8 B per
batch entry each), ``tg_batch_offsets.cuda()`` (8 B per entry), then ``log_alpha``
([batch, T, 2 S + 1], S the longest target) and ``neg_log_likelihood`` ([batch]); the three index
tensors die when it returns (declared last, freed first: input lengths, target lengths, offsets).

``ctc_loss_backward_gpu_template`` (``_ctc_loss_backward``): the same three index tensors, then
``log_beta = empty_like(log_alpha)`` and ``grad = full_like(log_probs)`` (contiguous). A problem with
``2 T + (24 batch) / 10 + (2 labels) / 10 > 450`` (``is_large``) then computes the blanks'
subtrahend with ATen ops: ``log_alpha.as_strided(..) + log_beta.as_strided(..)`` ([batch, T, S + 1])
and its ``at::logsumexp(.., 2, true)`` (ReduceOps.cpp ``logsumexp_out_impl``: ``amax`` keeping the
dim, its ``abs()`` and ``== INFINITY`` mask for ``masked_fill_``, ``(self - maxes).exp_()`` summed
into the result), both dying at the end of that statement (the result first); with
``zero_infinity`` the gradient becomes ``at::where(nll.view(1, batch, 1) == INFINITY, zeros({}),
grad)`` (the new gradient is the output, the first freed by the assignment). The index tensors and
``log_beta`` die when it returns. Smaller problems run one kernel (nothing more).

cuDNN's CTC kernel (``_use_cudnn_ctc_loss``: cuDNN on, blank 0, 1-D int32 targets, float32 3-D
``log_probs``, targets under 256 and no longer than their inputs; int lists also need targets on
the host and every input of full length, tensors need int32 lengths) sizes its workspace with
``cudnnGetCTCLossWorkspaceSize`` at run time: a call that takes it is refused (`cudnn_refusal`).

Both paths read the lengths to the host (``ctc_loss.Tensor``: ``.to(kCPU)``), and the longest
target sizes ``log_alpha``: lengths whose values a run does not know are a data-dependent read.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .reductions import reduction_plan
from .scratch import _Plan

Steps = list[tuple[str, Any]]
_INT64 = 8


def _index_tensors(p: _Plan, batch: int) -> None:
    for key in ("target_lengths", "input_lengths", "offsets"):
        p.tmp(key, _INT64 * batch)


def _logsumexp(p: _Plan, x: torch.Tensor, sms: int, max_threads_sm: int) -> None:
    """``at::logsumexp(x, 2, /*keepdim=*/true)`` into ``lse`` (module doc)."""
    kept = torch.empty((*x.shape[:2], 1), dtype=x.dtype, device="meta")
    p.splice(reduction_plan("amax", (x, [2], True), [kept], sms, max_threads_sm),
             [("maxes", kept.numel() * kept.element_size())], "amax")
    p.tmp("abs", kept.numel() * kept.element_size())
    p.tmp("infinite", kept.numel())
    p.free("infinite", "abs")
    p.tmp("shifted", x.numel() * x.element_size())
    p.splice(reduction_plan("sum", (x, [2], True), [kept], sms, max_threads_sm),
             [("lse", kept.numel() * kept.element_size())], "sum")
    p.free("shifted", "maxes")


def ctc_plan(name: str, args: tuple[Any, ...], outs: list[Any], sms: int, max_threads_sm: int) -> Steps | None:
    """``_ctc_loss`` / ``_ctc_loss_backward`` as the module doc says; None for other ops."""
    if name == "_ctc_loss" and len(outs) == 2 and isinstance(args[0], torch.Tensor):
        p = _Plan()
        _index_tensors(p, args[0].shape[1])
        p.steps += [("out", 1), ("out", 0)]
        p.free("input_lengths", "target_lengths", "offsets")
        return p.steps
    if name != "_ctc_loss_backward" or len(args) < 7 or not isinstance(args[1], torch.Tensor):
        return None
    log_probs, log_alpha = args[1], args[6]
    zero_infinity = bool(args[8]) if len(args) > 8 else False
    steps, (t, batch, labels) = _Plan(), log_probs.shape
    _index_tensors(steps, batch)
    steps.tmp("log_beta", log_alpha.numel() * log_alpha.element_size())
    large = 2 * t + (24 * batch) // 10 + (2 * labels) // 10 > 450
    if large and zero_infinity:  # the gradient is replaced by at::where's output below
        steps.tmp("grad", log_probs.numel() * log_probs.element_size())
    else:
        steps.steps.append(("out", 0))
    if large:
        s = (log_alpha.shape[2] - 1) // 2
        summed = torch.empty((batch, log_alpha.shape[1], s + 1), dtype=log_alpha.dtype, device="meta")
        steps.tmp("alpha_beta", summed.numel() * summed.element_size())
        _logsumexp(steps, summed, sms, max_threads_sm)
        steps.free("lse", "alpha_beta")
    if large and zero_infinity:  # at::where's arguments, right to left as GCC evaluates them
        steps.tmp("zeros", log_probs.element_size())
        steps.tmp("infinite_nll", batch)
        steps.steps.append(("out", 0))
        steps.free("grad", "infinite_nll", "zeros")
    steps.free("log_beta", "input_lengths", "target_lengths", "offsets")
    return steps.steps


def backward_output(grad: Any, log_probs: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``_ctc_loss_backward``'s gradient on meta (it has no meta kernel): ``full_like(log_probs)``
    with ``LEGACY_CONTIGUOUS_MEMORY_FORMAT``."""
    return torch.empty(log_probs.shape, dtype=log_probs.dtype, device="meta")


_NAMES = ("log_probs", "targets", "input_lengths", "target_lengths", "blank")


def arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``torch.ctc_loss``'s arguments by name."""
    return dict(zip(_NAMES, args), **{k: v for k, v in kwargs.items() if k in _NAMES})


def takes_cudnn(given: dict[str, Any], cudnn_enabled: bool, values: Callable[[Any], list[int] | None]) -> bool:
    """Whether ``torch.ctc_loss`` with `given` (`arguments`) takes cuDNN's kernel on a GPU (module
    doc); `values` reads a lengths argument (None: not known, then the rest decides)."""
    lp, tg = given.get("log_probs"), given.get("targets")
    il, tl = given.get("input_lengths"), given.get("target_lengths")
    if not (cudnn_enabled and isinstance(lp, torch.Tensor) and isinstance(tg, torch.Tensor)
            and given.get("blank", 0) == 0 and tg.dim() == 1 and tg.dtype == torch.int32
            and tg.is_contiguous() and lp.dtype == torch.float32 and lp.dim() == 3):
        return False
    tensors = isinstance(il, torch.Tensor) and isinstance(tl, torch.Tensor)
    if tensors and not (il.dtype == torch.int32 and tl.dtype == torch.int32):
        return False
    if not tensors and tg.device.type != "cpu":
        return False
    ils, tls = values(il), values(tl)
    if ils is None or tls is None:
        return True
    if not tensors and any(n != lp.shape[0] for n in ils):
        return False
    return all(t < 256 and t <= i for t, i in zip(tls, ils))


def cudnn_refusal() -> str:
    """The one-line stop for a CTC loss that takes cuDNN's kernel."""
    return ("vram run: torch.ctc_loss through cuDNN is not modelled (blank 0, 1-D int32 targets, float32 "
            "log_probs: CUDA runs cudnnCTCLoss, whose workspace cuDNN sizes at run time); with int64 targets, "
            "or inside torch.backends.cudnn.flags(enabled=False), CUDA's own kernel runs, which is modelled")


CUDA_META = {torch.ops.aten._ctc_loss_backward.default: backward_output}
