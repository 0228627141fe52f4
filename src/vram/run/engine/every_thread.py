"""The run's function mode wherever the script's code runs: on the threads it starts, and in the
finalizers Python's garbage collector runs while the mode is off.

PyTorch keeps the torch function mode stack per thread (``PythonTorchFunctionTLS``, carried only
into the autograd engine's threads by ``at::ThreadLocalState``), so a ``threading.Thread`` started
in a run begins without the mode that sends ``cuda`` to the simulated GPU; and a mode is off its
stack while its own ``__torch_function__`` runs (torch/csrc/utils/python_arg_parser.cpp
``StashTorchFunctionModeGuard``), so a ``__del__`` that the cyclic collector runs there meets
CUDA without it. On a GPU neither has a mode to lose: data loaders' pin-memory threads,
prefetchers, asynchronous checkpoint writers and finalizers allocate as the main thread does.

`install` puts the mode on each thread started while the run lasts (``Thread._bootstrap_inner``,
which calls ``run``: every ``Thread`` subclass and ``ThreadPoolExecutor`` worker), and, through
``gc.callbacks``, on the collecting thread for the length of a collection, with torch functions
enabled (the handler runs its own calls with them off), when it is not on that thread's stack
already (the collector cannot re-enter itself: the pushes and pops pair up).
"""
from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_BOOTSTRAP = "_bootstrap_inner"
_C: Any = torch._C  # the function-mode stack and state (some without stubs)
_ENABLED = _C._TorchFunctionState.ENABLED
_pushed = threading.local()  # per collecting thread: the modes pushed at "start", popped at "stop"


def on_stack(mode: TorchFunctionMode) -> bool:
    """Is `mode` on this thread's torch function mode stack?"""
    return any(_C._get_function_stack_at(i) is mode for i in range(_C._len_torch_function_stack()))


def install(mode: TorchFunctionMode, running: Callable[[], bool]) -> Callable[[], None]:
    """Put `mode` on new threads and into collections while `running()`; returns the restore."""
    original: Any = getattr(threading.Thread, _BOOTSTRAP)

    def bootstrap_inner(thread: threading.Thread) -> None:
        if not running():
            original(thread)
            return
        with mode:
            original(thread)

    def collecting(phase: str, info: dict[str, Any]) -> None:
        stack = _pushed.__dict__.setdefault("modes", [])
        if phase == "start":
            if not running():
                stack.append(None)
                return
            state = _C._get_torch_function_state()
            _C._set_torch_function_state(_ENABLED)  # off for the handler's own calls
            push = not on_stack(mode)
            if push:
                _C._push_on_torch_function_stack(mode)
            stack.append((state, push))
        elif stack and (entry := stack.pop()) is not None:
            state, push = entry
            if push and _C._len_torch_function_stack():
                _C._pop_torch_function_stack()
            _C._set_torch_function_state(state)

    setattr(threading.Thread, _BOOTSTRAP, bootstrap_inner)
    gc.callbacks.append(collecting)

    def restore() -> None:
        setattr(threading.Thread, _BOOTSTRAP, original)
        gc.callbacks.remove(collecting)
    return restore
