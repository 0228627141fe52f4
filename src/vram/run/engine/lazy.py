"""Lazy host tensors under the PrivateUse1 engine (`vram.run.memory.lazy_host`).

A CPU-built model costs nothing until something needs its bytes: large CPU factories make meta
tensors with a recipe, which the function mode plays as CPU tensors. Recording their ops needs a
``TorchDispatchMode`` — and any active dispatch mode makes every tensor "subclass-like" to
autograd (``c10::impl::dispatch_mode_enabled``, ATen/TensorSubclassLikeUtils.h), the very thing
this engine exists to avoid. So `LazyHostMode` is on the dispatch stack only while lazy host
tensors live: pushed by the first large CPU factory (when no other dispatch mode is active), and
popped, with the CPU generator's deferred draws settled, at the first torch call after the last
one died — usually the end of ``model.to("cuda")``, before any training step.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode, _push_mode
from torch.utils._pytree import tree_leaves, tree_map

from vram.run.memory.lazy_host import seeded
from vram.run.memory.storages import SimState

from .dynamo_guard import import_dynamo_when_compiling
from .function_mode import draws_host_default

_META = torch.device("meta")
#: the runs whose `LazyHostMode` is on the dispatch stack
_PUSHED: set[SimState] = set()


@import_dynamo_when_compiling
class LazyHostMode(TorchDispatchMode):
    """Records the ops of lazy host tensors (as `vram.run.engine.meta.DispatchMode` does for the
    default engine); every other op passes through to its kernel (the engine's fallback)."""

    def __init__(self, sim: SimState, run_on_device: Any) -> None:
        super().__init__()
        self.sim = sim
        self.run_on_device = run_on_device  # the engine's op walk: (op, *args, **kwargs) -> outputs

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunction():
            return self._dispatch(func, args, kwargs)

    def _dispatch(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        sim, host = self.sim, self.sim.host
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not inputs and (sim.host_factory or (sim.host_call and kwargs.get("device") == _META)):
            # a large CPU factory (the function mode said so), or a tensor a call on lazy host tensors
            # makes with their options inside C++ (``one_hot``'s zeros): a host tensor, as on the CPU
            return host.factory(func, args, kwargs)
        if not (host.live and any(host.of(t) is not None for t in inputs)):
            if host.ledger.owing and seeded(func) and draws_host_default(func, kwargs, inputs, sim):
                host.ledger.settle()  # the CPU generator is about to be used: pay the deferred draws
            return func(*args, **kwargs)
        if kwargs.get("layout") not in (None, torch.strided):
            # a sparse tensor made of lazy components (``sparse_coo_tensor(indices, torch.ones(nnz))``):
            # it holds them, as on the CPU, so they are computed now
            args, kwargs = tree_map(lambda t: host.real(t) if host.of(t) is not None else t, (args, kwargs))
            return func(*args, **kwargs)
        device = kwargs.get("device")
        if sim.target is not None or any(sim.block_of(t) is not None for t in inputs) or (
                isinstance(device, torch.device) and device.type not in ("cpu", "meta")):
            # a move or a copy to a simulated GPU: its walk, reading the lazy inputs' geometry only;
            # a lazy tensor written from the GPU gains the op as a step
            out = self.run_on_device(func, *args, **kwargs)
            host.record(func, args, kwargs, out, new_outputs=False)
            return out
        return host.on_host(func, args, kwargs, inputs, sim.explicit_meta)

def ready(sim: SimState, run_on_device: Any) -> bool:
    """Can a large CPU factory be lazy now? Yes when `LazyHostMode` is the innermost dispatch
    mode, or no dispatch mode is active (then it is pushed); a script's own mode (a tracker)
    keeps CPU factories real rather than be popped from under it."""
    mode = _get_current_dispatch_mode()
    if mode is not None:
        return isinstance(mode, LazyHostMode) and mode.sim is sim
    _push_mode(LazyHostMode(sim, run_on_device))
    _PUSHED.add(sim)
    return True


def retire(sim: SimState, end: bool = False) -> None:
    """Pop `LazyHostMode` once no lazy host tensor lives (and it is the innermost mode), after
    paying the CPU generator's deferred draws, so autograd sees no dispatch mode again; at the
    `end` of the simulated run, wherever it is on the stack (modes above it are put back).
    Called before every torch function of the run: nothing to do unless `ready` pushed one."""
    if sim not in _PUSHED or (sim.host.live and not end):
        return
    above: list[Any] = []
    while (mode := _get_current_dispatch_mode()) is not None:
        if isinstance(mode, LazyHostMode) and mode.sim is sim:
            sim.host.ledger.settle()
            _pop_mode()
            _PUSHED.discard(sim)
            break
        if not end:
            break
        above.append(_pop_mode())
    for mode in reversed(above):
        _push_mode(mode)
    if end:
        _PUSHED.discard(sim)


@contextmanager
def outside_backward(sim: SimState, roots: Any) -> Iterator[None]:
    """Run a backward from simulated `roots` without `LazyHostMode` when a live lazy host tensor
    keeps it pushed (a CPU dataset built with ``torch.randint``, a meta copy of a model).

    The graph task takes the dispatch modes it starts with to the autograd engine's device
    thread, where a GPU has none: with it there, autograd takes its tensor-subclass formulas,
    and an exception (an OOM) leaving the mode's ``__torch_dispatch__`` is still pending when
    the node's stream guard unwinds, so the Python device guard's ``type_()`` fails inside a
    ``noexcept`` ``exchangeStream`` and the process aborts ("terminate called without an active
    exception"; torch/csrc/acc/Module.cpp). A backward from lazy host roots keeps the mode.
    """
    mode = _get_current_dispatch_mode()
    if not (isinstance(mode, LazyHostMode) and mode.sim is sim) or any(
            sim.host.of(t) is not None for t in tree_leaves(roots)):
        yield
        return
    _pop_mode()
    try:
        yield
    finally:
        _push_mode(mode)
