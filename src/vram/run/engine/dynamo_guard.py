"""Meta kernels and dispatch modes that do not import ``torch._dynamo`` until something compiles.

``torch._disable_dynamo`` (torch/_compile.py) wraps a function so that, on its first call, it
imports ``torch._dynamo`` to build the "disabled" function, cached on the function as
``__dynamo_disable``. PyTorch wraps each ``TorchDispatchMode`` subclass's ``__torch_dispatch__``
(torch/utils/_python_dispatch.py) and the elementwise references that are the meta kernels of ops
without a C++ one (``normal_``: ``elementwise_type_promotion_wrapper``, torch/_prims_common/
wrappers.py), so a simulated run's first tensor imported ``torch._dynamo``: a second or more of
start-up. Until ``torch._dynamo`` is imported nothing can be compiling and there is nothing to
disable: `_lazily` puts in that cache a function that calls the original until then, and torch's
disabled function from then on.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

Mode = TypeVar("Mode", bound=type)
_DEFERRED: list[bool] = []  # the meta kernels' wrappers are done (once per process)


def _lazily(raw: Callable[..., Any], recursive: bool = True) -> None:
    """Fill `raw`'s ``__dynamo_disable`` cache with a stand-in for ``torch._dynamo.disable``."""
    if getattr(raw, "__dynamo_disable", None) is not None:
        return

    def call(*args: Any, **kwargs: Any) -> Any:
        disable = getattr(sys.modules.get("torch._dynamo"), "disable", None)
        if disable is None:  # not imported (or still importing): nothing is compiling
            return raw(*args, **kwargs)
        disabled = disable(raw, recursive, wrapping=False)
        setattr(raw, "__dynamo_disable", disabled)  # from now on, as torch has it
        return disabled(*args, **kwargs)

    setattr(raw, "__dynamo_disable", call)


def import_dynamo_when_compiling(cls: Mode) -> Mode:
    """Class decorator for a ``TorchDispatchMode`` subclass (see the module docstring); a torch
    whose wrapper has no ``__wrapped__`` is left as it is."""
    raw = getattr(cls.__dict__.get("__torch_dispatch__"), "__wrapped__", None)
    if raw is not None:
        _lazily(raw)
    return cls


def defer_dynamo_in_meta_kernels() -> None:
    """The same for every ``torch._disable_dynamo`` wrapper reached through the decomposition and
    meta tables' functions (their ``__wrapped__`` chains); once per process, a few milliseconds."""
    if _DEFERRED or "torch._dynamo" in sys.modules:
        return
    _DEFERRED.append(True)
    import torch._decomp as decomp
    from torch._compile import _disable_dynamo

    inner = _disable_dynamo(lambda: None).__code__
    names = inner.co_freevars
    for table in (decomp.decomposition_table, decomp.meta_table):
        for f in list(table.values()):
            for _ in range(32):  # a chain of decorators, each with __wrapped__
                if f is None:
                    break
                if getattr(f, "__code__", None) is inner and f.__closure__ is not None:
                    cells = dict(zip(names, (c.cell_contents for c in f.__closure__)))
                    if callable(cells.get("fn")):
                        _lazily(cells["fn"], bool(cells.get("recursive", True)))
                f = getattr(f, "__wrapped__", None)
