"""cuDNN convolution and batch norm in training on the simulated GPU: the layout of their outputs
and the workspace each call takes (layer 4; needs torch).

Paths are relative to ``aten/src/ATen/native``:

* **Which convolutions run on cuDNN** (``Convolution.cpp`` ``_select_conv_backend``): CUDA inputs of
  2 or 3 spatial dims (1-D ones are viewed as 2-D: ``view4d``), real floating dtypes, cuDNN
  enabled; a depthwise convolution (groups == input channels > 1) only in channels_last
  (``use_cudnn_depthwise``; contiguous ones may take the native depthwise kernel: not charged).
* **Output layout** (``cudnn/ConvShared.cpp``): ``cudnn_conv_suggest_memory_format(input, weight)`` =
  channels_last when either is channels_last (``ChannelsLast3d`` for 5-D), else contiguous; the
  backward's ``grad_input`` takes (grad_output, weight)'s, ``grad_weight`` (input, grad_output)'s;
  transposed convolutions (``cudnn_convolution_transpose*``) follow the same rule.
  The meta kernels answer contiguous, so `CUDA_META` restrides their outputs. Operands not in the
  layout are copied first (``.contiguous(memory_format)``; `_forward`, `_backward` give the order).
* **Workspace** (``cudnn/Conv_v8.cpp`` ``run_single_conv``, benchmark off): each call allocates
  ``plan.getWorkspaceSize()`` after its output and frees it on return; the backward runs
  backward-data (after ``grad_input``) then backward-filter (after ``grad_weight``). The size is
  cuDNN's: `vram.run.kernels.cudnn_sm90` holds the ones measured on sm90; any other call is charged
  0 B and counted in a note (`ESTIMATED`).
* **Survivable OOM** (``run_single_conv``, ``try_configs``): a plan cached for the key is tried first,
  then the heuristics' engine configs in order, each failed workspace allocation caught
  (``c10::OutOfMemoryError``: the allocator has already freed its cache, retried and counted
  ``num_ooms``) and the next config tried; the plan that runs is cached. Only the first config's size
  is measured, so a fallback is modelled as a config needing no workspace (the caps of the real
  recordings did not bind: not derived from data). `vram.run.memory.storages.SimState.cudnn_workspace`
  carries this out.
* **Batch norm** (``cudnn/BatchNorm.cpp``): training allocates the output, the saved statistics, then
  the workspace (freed on return); the backward grad_input, grad_weight, grad_bias, then its workspace.
  Its workspace is a plain ``at::empty``: an OOM there is not caught.
"""
from __future__ import annotations

from typing import Any

import torch

from .cudnn_sm90 import BN_WORKSPACE, CONV_WORKSPACE, MEASURED_ON

ESTIMATED = ("cuDNN workspaces (convolution, batch norm) of calls not in vram's sm90 table (measured on an "
             "H200, torch 2.11, cudnn.benchmark and cudnn.deterministic off), estimated at 0 B: cuDNN sizes "
             "each by the engine its heuristics pick (Conv_v8.cpp run_conv_plan, cudnn/BatchNorm.cpp), "
             "which a CPU machine cannot ask")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def suggest_memory_format(t: torch.Tensor) -> torch.memory_format:
    """``TensorBase::suggest_memory_format``: channels_last when the strides say so."""
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous():
        return torch.channels_last
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d) and not t.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format


def conv_layout(a: torch.Tensor, b: torch.Tensor) -> torch.memory_format:
    """``cudnn_conv_suggest_memory_format`` (cuDNN ≥ 8.0.5): float64 stays contiguous; a 4-D
    weight with either tensor channels_last gives channels_last, a 5-D one channels_last_3d."""
    if torch.float64 in (a.dtype, b.dtype):
        return torch.contiguous_format
    formats = (suggest_memory_format(a), suggest_memory_format(b))
    if b.dim() == 4 and torch.channels_last in formats:
        return torch.channels_last
    if b.dim() == 5 and torch.channels_last_3d in formats:
        return torch.channels_last_3d
    return torch.contiguous_format


def on_cudnn(x: Any, w: Any, transposed: bool, groups: int) -> bool:
    """Whether CUDA runs this convolution on cuDNN (`module docstring`)."""
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)) or not torch.backends.cudnn.enabled:
        return False
    if x.dim() not in (3, 4, 5) or x.dtype not in _FLOATS or w.dtype != x.dtype or x.numel() == 0:
        return False
    depthwise = not transposed and x.dim() in (4, 5) and x.shape[1] == groups > 1 and w.shape[0] % groups == 0
    return not depthwise or conv_layout(x, w) != torch.contiguous_format


def _restride(t: Any, fmt: torch.memory_format) -> Any:
    """`t` laid out in `fmt` (on meta: no memory)."""
    if not isinstance(t, torch.Tensor) or t.dim() not in (4, 5):
        return t
    return t.contiguous(memory_format=fmt)


def _convolution(*args: Any, **kwargs: Any) -> Any:
    out = torch.ops.aten.convolution.default(*args, **kwargs)
    x, w, _, _, _, _, transposed, _, groups = args[:9]
    return _restride(out, conv_layout(x, w)) if on_cudnn(x, w, transposed, groups) else out


def _convolution_backward(*args: Any, **kwargs: Any) -> Any:
    grads = torch.ops.aten.convolution_backward.default(*args, **kwargs)
    g, x, w = args[:3]
    transposed, groups = args[7], args[9]
    if not on_cudnn(x, w, transposed, groups):
        return grads
    gi, gw, gb = grads
    mask = args[10]
    if mask[1]:  # convolution_backward: input.contiguous(backend_memory_format)
        x = _restride(x, conv_layout(x, w))
    go = g if suggest_memory_format(g) == suggest_memory_format(x) else _restride(g, suggest_memory_format(x))
    return _restride(gi, conv_layout(go, w)), _restride(gw, conv_layout(x, go)), gb


#: convolution ops whose meta kernel's output layout is not cuDNN's -> cuDNN's, on meta
CUDA_META = {torch.ops.aten.convolution.default: _convolution,
             torch.ops.aten.convolution_backward.default: _convolution_backward}


def _layout_name(fmt: torch.memory_format) -> str:
    return "contiguous" if fmt == torch.contiguous_format else str(fmt).split(".")[-1]


def _spatial(v: Any, n: int) -> tuple[int, ...]:
    """``expand_param_if_needed``: one value for every spatial dim."""
    v = tuple(int(i) for i in v)
    return v * n if len(v) == 1 else v


def conv_key(operation: str, x: torch.Tensor, w: torch.Tensor, fmt: torch.memory_format, stride: Any,
             padding: Any, dilation: Any, groups: int) -> tuple[object, ...]:
    """The table key of one cuDNN call run in layout `fmt`; a 1-D convolution as the 2-D one cuDNN
    runs."""
    n = w.dim() - 2
    xs, ws = tuple(x.shape), tuple(w.shape)
    st, pd, dl = _spatial(stride, n), _spatial(padding, n), _spatial(dilation, n)
    layout = _layout_name(fmt)
    if x.dim() == 3:  # view4d: [N, C, L] -> [N, C, 1, L]; the parameters gain a leading 1 / 0 / 1
        xs, ws = (*xs[:2], 1, xs[2]), (*ws[:2], 1, ws[2])
        st, pd, dl = (1, *st), (0, *pd), (1, *dl)
    return (operation, str(x.dtype).split(".")[-1], layout, xs, ws, st, pd, dl, int(groups))


def _workspace(table: dict[tuple[object, ...], int], key: tuple[object, ...],
               cc: tuple[int, int]) -> int | None:
    """The measured size, or None: another architecture, ``cudnn.benchmark`` (the find path), or
    deterministic engines only (``deterministicCuDNN() || deterministicAlgorithms()``)."""
    deterministic = torch.backends.cudnn.deterministic or torch.are_deterministic_algorithms_enabled()
    if cc not in MEASURED_ON or torch.backends.cudnn.benchmark or deterministic:
        return None
    return table.get(key)


class _Steps:
    """A plan under construction: named temporaries (operand copies, workspaces) and their frees."""

    def __init__(self, cc: tuple[int, int]) -> None:
        self.steps: list[tuple[str, Any]] = []
        self.index: dict[str, int] = {}
        self.count = 0
        self.cc = cc

    def _held(self, name: str) -> None:
        self.index[name] = self.count
        self.count += 1

    def copy(self, name: str, t: torch.Tensor, fmt: torch.memory_format) -> torch.Tensor:
        """``t.contiguous(fmt)``: a new tensor when `t` is not already laid out so."""
        if t.is_contiguous(memory_format=fmt) or t.numel() == 0:
            return t
        self._held(name)
        self.steps.append(("tmp", t.numel() * t.element_size()))
        return t.contiguous(memory_format=fmt)

    def workspace(self, table: dict[tuple[object, ...], int], key: tuple[object, ...],
                  survivable: bool = True) -> None:
        """One cuDNN call's workspace (known or estimated), freed when the call returns: a
        convolution's survives an OOM (``("cudnn", ...)``), batch norm's (``at::empty``) does not."""
        nbytes = _workspace(table, key, self.cc)
        if nbytes is None:
            self.steps.append(("note", ESTIMATED))
        if survivable:
            self._held("workspace")
            self.steps += [("cudnn", (key, nbytes or 0)), ("free", self.index.pop("workspace"))]
        elif nbytes:
            self._held("workspace")
            self.steps += [("tmp", nbytes), ("free", self.index.pop("workspace"))]

    def free(self, *names: str) -> None:
        for name in names:
            if name in self.index:
                self.steps.append(("free", self.index.pop(name)))


def _forward(x: torch.Tensor, w: torch.Tensor, conv: tuple[Any, ...], plan: _Steps) -> None:
    """``_convolution`` → ``cudnn_convolution`` → ``cudnn_convolution_forward_out``: the input in
    the layout (``input.contiguous(backend_memory_format)``), the output, the weight in the layout,
    the workspace; the weight copy dies when ``forward_out`` returns, the input's after."""
    fmt = conv_layout(x, w)
    plan.copy("input", x, fmt)
    plan.steps.append(("out", 0))
    plan.copy("weight", w, fmt)
    plan.workspace(CONV_WORKSPACE, conv_key("forward", x, w, fmt, *conv))
    plan.free("weight", "input")


def _backward(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, conv: tuple[Any, ...], mask: Any,
              plan: _Steps) -> None:
    """``convolution_backward`` (Cudnn) → ``cudnn_convolution_backward``: the input in the layout
    when grad_weight is wanted, ``grad_output.to(input.suggest_memory_format())``; backward-data
    (``grad_input``, then weight and grad_output in (grad_output, weight)'s layout, the workspace)
    and backward-filter (grad_output and input in (input, grad_output)'s layout, ``grad_weight``,
    the workspace), each call's copies dying when it returns (``ConvShared.cpp``)."""
    if mask[1]:
        x = plan.copy("input", x, conv_layout(x, w))
    go = g if suggest_memory_format(g) == suggest_memory_format(x) else \
        plan.copy("grad_output", g, suggest_memory_format(x))
    if mask[0]:
        fmt = conv_layout(go, w)
        plan.steps.append(("out", 0))
        plan.copy("data_weight", w, fmt)
        plan.copy("data_grad_output", go, fmt)
        plan.workspace(CONV_WORKSPACE, conv_key("backward_data", x, w, fmt, *conv))
        plan.free("data_grad_output", "data_weight")
    if mask[1]:
        fmt = conv_layout(x, go)
        plan.copy("filter_grad_output", go, fmt)
        plan.copy("filter_input", x, fmt)
        plan.steps.append(("out", 1))
        plan.workspace(CONV_WORKSPACE, conv_key("backward_filter", x, w, fmt, *conv))
        plan.free("filter_input", "filter_grad_output")
    plan.free("grad_output", "input")


def conv_plan(name: str, args: tuple[Any, ...], outs: list[Any],
              cc: tuple[int, int]) -> list[tuple[str, Any]] | None:
    """``convolution`` / ``convolution_backward`` on cuDNN: operand copies, outputs and workspaces
    in CUDA's order (`module docstring`); None for other ops and for convolutions cuDNN does not run."""
    plan = _Steps(cc)
    if name == "convolution" and len(args) >= 9:
        x, w, _, stride, padding, dilation, transposed, _, groups = args[:9]
        if not on_cudnn(x, w, transposed, groups):
            return None
        if transposed:
            return [("out", 0), ("note", ESTIMATED)]
        _forward(x, w, (stride, padding, dilation, groups), plan)
        return plan.steps
    if name != "convolution_backward" or len(args) < 11:
        return None
    g, x, w, _, stride, padding, dilation, transposed, _, groups, mask = args[:11]
    if not on_cudnn(x, w, transposed, groups):
        return None
    if transposed:
        return [*(("out", i) for i in range(len(outs))), ("note", ESTIMATED)]
    _backward(g, x, w, (stride, padding, dilation, groups), mask, plan)
    return plan.steps + [("out", i) for i in range(2, len(outs))]


def bn_plan(name: str, x: torch.Tensor, weight: torch.Tensor, outs: list[Any],
            cc: tuple[int, int]) -> list[tuple[str, Any]]:
    """cuDNN batch norm in training (forward: ``native_batch_norm``/``_batch_norm_with_update``;
    backward: ``*batch_norm_backward``): every output, then the workspace, freed on return."""
    direction = "backward" if name.endswith("backward") else "forward"
    key = (direction, str(x.dtype).split(".")[-1], str(weight.dtype).split(".")[-1],
           _layout_name(suggest_memory_format(x)), tuple(x.shape))
    plan = _Steps(cc)
    plan.steps += [("out", i) for i in range(len(outs))]
    plan.workspace(BN_WORKSPACE, key, survivable=False)
    return plan.steps
