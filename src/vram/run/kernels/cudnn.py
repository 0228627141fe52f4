"""cuDNN on the simulated GPU: batch norm in training (which backend runs, which outputs it makes),
the plans of cuDNN convolutions and batch norm (`cudnn_plan`: their workspaces, from
`vram.run.kernels.cudnn_conv`), the end-of-run note for scratch left uncharged (`uncharged_note`), and
cuDNN's recurrent layers (refused).
"""
from __future__ import annotations

from typing import Any

import torch

from . import cudnn_conv as _conv

#: batch-norm ops on a CPU build of torch -> the indices of their ``training``/``train`` flag (None:
#: always training) and of ``eps``; backward ops take ``grad_out`` first
_BN_ARGS = {"native_batch_norm": (5, 7), "_batch_norm_with_update": (None, 6),
            "native_batch_norm_backward": (7, 8), "batch_norm_backward": (7, 8)}


def cudnn_batch_norm(x: torch.Tensor, weight: Any, training: bool, eps: float) -> bool:
    """Normalization.cpp ``_select_batch_norm_backend`` on a CUDA build with cuDNN: no bfloat16
    input or weight, a half input only with a float weight, a weight, 3 or more dims, a batch of at
    most 880,801 (training) or 65,535 (inference), eps ≥ 1e-5 (CUDNN_BN_MIN_EPSILON)."""
    if not isinstance(weight, torch.Tensor) or torch.bfloat16 in (x.dtype, weight.dtype):
        return False
    if x.dtype == torch.float16 and weight.dtype != torch.float32:
        return False
    return x.dim() >= 3 and x.shape[0] <= (880801 if training else 65535) and eps >= 1e-5


def cudnn_plan(name: str, args: tuple[Any, ...], outs: list[Any],
               cc: tuple[int, int]) -> list[tuple[str, Any]] | None:
    """The plan of a convolution cuDNN runs (`vram.run.kernels.cudnn_conv.conv_plan`) or of batch norm
    in training when cuDNN runs it (`cudnn_batch_norm`; inference has no workspace): outputs, then
    the workspace; None for other ops."""
    plan = _conv.conv_plan(name, args, outs, cc)
    if plan is not None or name not in _BN_ARGS:
        return plan
    flag, eps = _BN_ARGS[name]
    first = 1 if name.endswith("backward") else 0
    if len(args) <= eps or not isinstance(args[first], torch.Tensor):
        return None
    x, weight = args[first], args[first + 1]
    training = flag is None or args[flag] is True
    if not training or not cudnn_batch_norm(x, weight, True, args[eps]):
        return None
    return _conv.bn_plan(name, x, weight, outs, cc)


def uncharged_note(calls: dict[str, int]) -> str:
    """The end-of-run note for the calls `uncharged_scratch` named ("" when none ran)."""
    if not calls:
        return ""
    lines = ["vram run: kernel scratch not charged (a GPU's peak can exceed these figures by the largest "
             "such buffer live at that moment):"]
    lines += [f"  {n:,} call(s) with {what}" for what, n in calls.items()]
    return "\n".join(lines)


def cudnn_batch_norm_outputs(name: str, args: tuple[Any, ...], out: Any) -> Any:
    """``native_batch_norm`` in inference returns what CUDA's does: ``_batch_norm_impl_index``
    (Normalization.cpp) hands it to ``cudnn_batch_norm`` when `cudnn_batch_norm` (with bias and
    running statistics given) says so, and in inference that returns ``save_mean``/``save_var`` as
    ``empty({0})`` (cudnn/BatchNorm.cpp): only the output is allocated. Other ops and cases: `out`
    as it is."""
    flag, eps = _BN_ARGS["native_batch_norm"]
    if name != "native_batch_norm" or len(args) <= eps or args[flag] is not False or not isinstance(out, tuple):
        return out
    x, w, b, rm, rv = args[:5]
    if not all(isinstance(t, torch.Tensor) for t in (x, w, b, rm, rv)) or not cudnn_batch_norm(x, w, False, args[eps]):
        return out
    return (out[0], *(o.new_empty((0,)) for o in out[1:]))



#: recurrent ops whose CUDA memory is not modelled (refused: a wrong figure is worse than a stop).
#: On CUDA, ``aten/src/ATen/native/RNN.cpp`` sends ``lstm``/``gru``/``rnn_*`` to cuDNN
#: (``_cudnn_rnn``: a flat weight buffer, workspace and reserve space sized by cuDNN's own
#: ``cudnnGetRNNTempSpaceSizes``) and, without cuDNN, the cells to fused kernels
#: (``_thnn_fused_lstm_cell``: gates without bias, a saved workspace); on meta the CPU
#: decomposition runs instead (biased gates, chunk, pointwise ops), which allocates differently.
RNN_OPS = frozenset({"lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell", "rnn_tanh_cell",
                     "rnn_relu_cell"})


def rnn_refusal(name: str) -> str:
    """The one-line stop for `RNN_OPS` on the simulated GPU."""
    return (f"vram run: torch.{name} on the simulated GPU is not modelled (nn.LSTM/GRU/RNN and their "
            "cells: CUDA runs cuDNN's RNN kernels, whose workspace and reserve sizes come from cuDNN, "
            "or fused cell kernels; the CPU decomposition allocates differently), so memory figures "
            "would be wrong")
