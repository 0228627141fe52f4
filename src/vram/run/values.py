"""Tensor values on a simulated GPU: there are none (for `vram.run.runtime`; layer 4).

`DataDependentError` is what a simulated run raises when the script needs a value — ``.item()``,
``bool(t)``, printing, a host copy, ``nonzero``… It names the innermost line of user code (outside
torch and vram) and, on Python ≥ 3.11, the exact expression, from the code object's positions:
``train.py:57: loss.item() needs tensor values, which a simulated GPU does not have``.
"""
from __future__ import annotations

import linecache
import os
import sys
from types import FrameType
from typing import Any

from vram.allocator.history import PACKAGE_DIR as _VRAM_DIR


class DataDependentError(Exception):
    """An operation needs tensor values, which a simulated GPU does not have."""


def _library_dirs() -> tuple[str, ...]:
    import torch

    return (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, _VRAM_DIR, "<frozen")


def user_frame() -> FrameType | None:
    """The innermost frame of user code: outside torch, vram and the interpreter's machinery."""
    skip = _library_dirs()
    f: FrameType | None = sys._getframe(1)
    while f is not None:
        if not f.f_code.co_filename.startswith(skip):
            return f
        f = f.f_back
    return None


def expression(frame: FrameType) -> str | None:
    """The source text of the expression the frame is executing (Python ≥ 3.11 positions)."""
    try:
        pos = list(frame.f_code.co_positions())[frame.f_lasti // 2]
    except (AttributeError, IndexError):
        return None
    line, end_line, col, end_col = pos
    if line is None or end_line != line or col is None or end_col is None:
        return None
    linecache.checkcache(frame.f_code.co_filename)
    text = linecache.getline(frame.f_code.co_filename, line).encode()[col:end_col].decode(errors="replace")
    return text if text and len(text) <= 120 else None


def value_error(what: str, detail: str = "") -> DataDependentError:
    """A `DataDependentError` for `what` (e.g. "Tensor.item()"), located at the user's line."""
    frame = user_frame()
    text = f"needs tensor values, which a simulated GPU does not have{f' ({detail})' if detail else ''}"
    if frame is None:
        return DataDependentError(f"{what} {text}")
    expr = expression(frame) or what
    return DataDependentError(f"{frame.f_code.co_filename}:{frame.f_lineno}: {expr} {text}")


_SPECIAL = {"__bool__": "bool(tensor)", "__int__": "int(tensor)", "__float__": "float(tensor)",
            "__index__": "using a tensor as an index", "__repr__": "printing a tensor",
            "__format__": "formatting a tensor", "__array__": "numpy.asarray(tensor)"}


def describe(func: Any) -> str:
    """How to name a torch function in a message: "Tensor.item()", "torch.nonzero()", …"""
    name = getattr(func, "__name__", str(func))
    if name in _SPECIAL:
        return _SPECIAL[name]
    owner = getattr(func, "__qualname__", "").split(".")[0]
    return f"Tensor.{name}()" if owner.startswith("Tensor") else f"torch.{name}()"
