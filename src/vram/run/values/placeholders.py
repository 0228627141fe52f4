"""Reads of tensor values a simulated GPU does not have (for `vram.run.runtime`; layer 4).

Values that need the model's arithmetic (a loss, logits, gradient norms) do not exist on a
simulated GPU. By default a read of one — ``.item()``, ``bool(t)``, printing, a host copy, a
data-dependent shape — is answered with a placeholder (zeros, see `vram.run.values.known`) and recorded
in a `ValueReport` by the script line and expression that read it; with ``strict_values`` it
raises `DataDependentError` instead, which names that line: ``train.py:57: loss.item() needs
tensor values, which a simulated GPU does not have``. Lines come from the innermost frame of user
code (outside torch and vram) and, on Python ≥ 3.11, the expression from the code's positions.
"""
from __future__ import annotations

import dis
import functools
import json
import linecache
import os
import sys
from dataclasses import asdict, dataclass
from types import FrameType
from typing import Any

from vram.allocator.history import PACKAGE_DIR as _VRAM_DIR

#: what meta kernels say when an op needs values they do not have (data-dependent output shapes,
#: ``.item()`` inside a kernel, an op with no meta kernel)
DATA_ERRORS = ("meta tensor", "meta device", "no data", "data-dependent", "data dependent",
               "register_meta", "Meta tensors", "has no data")


def needs_data(e: BaseException) -> bool:
    """Did an op fail on meta because it needs its inputs' values?"""
    return any(s in str(e) for s in DATA_ERRORS)


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


_TESTS = ("POP_JUMP", "JUMP_IF", "UNARY_NOT", "TO_BOOL")  # instructions that test a value


def _positions(frame: FrameType) -> Any:
    """The positions of the instruction the frame is executing; for a test (``if x:``, ``while
    not x``, ``and``/``or``), those of the instruction that produced the tested value, since a
    test's own span is the whole statement."""
    return _instruction_positions(frame.f_code, frame.f_lasti)


@functools.lru_cache(maxsize=1024)
def _instruction_positions(code: Any, lasti: int) -> Any:
    """`_positions` for one instruction, cached: a loop reads a value at the same place every step."""
    positions = list(code.co_positions())
    instructions = {i.offset: i for i in dis.get_instructions(code)}
    ins = instructions.get(lasti)
    if ins is not None and ins.opname.startswith(_TESTS):
        previous = [o for o in instructions if o < lasti and instructions[o].opname not in ("CACHE", "NOP")]
        while previous and instructions[previous[-1]].opname.startswith(_TESTS):
            previous.pop()
        if previous:
            return positions[previous[-1] // 2]
    return positions[lasti // 2]


def expression(frame: FrameType) -> str | None:
    """The source text of the expression the frame is executing (Python ≥ 3.11 positions)."""
    try:
        pos = _positions(frame)
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


@dataclass
class Site:
    """One place in the script whose reads were answered with placeholder values."""

    file: str
    line: int
    expression: str
    reads: int
    assumed: str        # what the first read returned, e.g. "0.0", "False", "zeros [8, 512]"
    derived: bool       # from values computed on placeholders (not a placeholder itself)


class ValueReport:
    """The reads of a simulated run that got placeholders, by script line."""

    def __init__(self) -> None:
        self.sites: dict[tuple[str, int, str], Site] = {}

    def record(self, what: str, assumed: str, derived: bool = False) -> None:
        frame = user_frame()
        file, line = (frame.f_code.co_filename, frame.f_lineno) if frame is not None else ("<unknown>", 0)
        expr = (expression(frame) if frame is not None else None) or what
        site = self.sites.get((file, line, expr))
        if site is None:
            self.sites[file, line, expr] = Site(file, line, expr, 1, assumed, derived)
        else:
            site.reads += 1

    def render(self) -> str:
        """The report for stderr at the end of a run ("" when no placeholder was used)."""
        if not self.sites:
            return ""
        total = sum(s.reads for s in self.sites.values())
        lines = [f"vram run: {total:,} read(s) of values a simulated GPU does not have were answered "
                 f"with placeholders (zeros) at {len(self.sites)} place(s):"]
        for s in self.sites.values():
            kind = "computed from placeholders" if s.derived else "placeholder"
            lines.append(f"  {s.file}:{s.line}: {s.expression}  x{s.reads:,}  -> {s.assumed} ({kind})")
        lines.append("  Branches and shapes that follow these values may differ from a GPU run: --strict-values "
                     "stops at the first such read, --values real computes them on the CPU.")
        lines += [f"  {note}" for note in self.notes()]
        return "\n".join(lines)

    def notes(self) -> list[str]:
        """What the report's assumptions change beyond single values: sizes of data-dependent
        outputs (``nonzero``, boolean masks, ``torch.where(mask)``) computed from placeholders."""
        shapes = sum(s.reads for s in self.sites.values() if s.assumed.startswith("output shape"))
        if not shapes:
            return []
        return [f"Sizes assumed: {shapes:,} data-dependent output shape(s) above were computed from placeholder "
                "values, so the tensors made from them have assumed sizes, not the GPU's (a mixture-of-experts "
                "router over placeholder logits gives every token the same experts: tokens per expert are "
                "assumed, and so is the memory of each expert's step)."]

    def blame(self, places: list[tuple[str, int]]) -> str:
        """The note for a script that failed after a placeholder read on one of its traceback's
        `places` (file, line; innermost last), e.g. ``1 / mse.item()`` with a 0.0 placeholder:
        the failure comes from the simulation's assumed value, not from the script ("" if none). A
        failure on another line is blamed, as possible, on the nearest data-dependent size assumed
        above it in the same file (an empty ``nonzero`` indexed later)."""
        for file, line in reversed(places):
            for s in self.sites.values():
                if (s.file, s.line) == (file, line):
                    return (f"vram run: the script failed at {file}:{line} after `{s.expression}` was answered "
                            f"with a placeholder ({s.assumed}); on a GPU it has the model's value there, so "
                            "this failure is the simulation's, not the script's (--strict-values stops at "
                            "such reads instead)")
        if places:  # no read on the failing line: the nearest size assumed above it in the innermost file
            file, line = places[-1]
            above = [s for s in self.sites.values()
                     if s.file == file and s.line < line and s.assumed.startswith("output shape")]
            if above:
                s = max(above, key=lambda s: s.line)
                return (f"vram run: the script failed at {file}:{line} after `{s.expression}` at line {s.line} "
                        f"was answered with a placeholder ({s.assumed}); this failure may be the simulation's, "
                        "not the script's (--strict-values stops at such reads instead)")
        return ""

    def as_json(self) -> str:
        return json.dumps({"placeholder_reads": [asdict(s) for s in self.sites.values()], "notes": self.notes()},
                          indent=1)
