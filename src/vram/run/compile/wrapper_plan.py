"""What an Inductor CUDA wrapper's ``call`` allocates, read from its source, in order.

Inductor's Python wrapper (torch/_inductor/codegen/wrapper.py) allocates each buffer it owns with
``bufN = empty_strided_cuda(size, stride, dtype)`` (``torch.empty_strided`` on the current CUDA
device: the storage holds the largest offset, ``1 + sum((size - 1) * stride)`` elements), reuses
one by name (``bufM = bufN; del bufN  # reuse`` or ``reinterpret_tensor(bufN, ...); del bufN  #
reuse``: no allocation), frees with ``del bufN``, and lets extern ATen ops allocate their own
outputs (``bufN = torch.ops.aten.<op>.default(...)``: what that CUDA kernel allocates, modelled by
`vram.run.kernels`). `buffer_events` lists those in the wrapper's order.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

_ALLOC = re.compile(r"^\s*(buf\d+) = empty_strided_cuda\(\(([^)]*)\), \(([^)]*)\), torch\.(\w+)\)")
_EXTERN = re.compile(r"^\s*(buf\d+) = torch\.ops\.(\w+)\.(\w+)\.(\w+)\(")
_DEL = re.compile(r"\bdel ((?:buf\d+)(?:, buf\d+)*)")
_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(frozen=True)
class BufferEvent:
    """One step of the wrapper: ``alloc`` (`nbytes` requested), ``extern`` (an ATen op, `op`,
    allocating its own outputs) or ``free`` (the wrapper's last reference to `name` dropped)."""

    kind: str
    name: str
    nbytes: int = 0
    op: str = ""


def storage_bytes(size: tuple[int, ...], stride: tuple[int, ...], dtype: str) -> int:
    """Bytes ``torch.empty_strided(size, stride, dtype=dtype)`` requests (0 for an empty tensor)."""
    if dtype not in _ITEMSIZE:
        raise ValueError(f"empty_strided_cuda with dtype torch.{dtype}: its size is not known here")
    if len(size) != len(stride):
        raise ValueError(f"empty_strided_cuda with size {size} and stride {stride} of different lengths")
    if math.prod(size) == 0:
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(size, stride))) * _ITEMSIZE[dtype]


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def call_body(source: str) -> list[str]:
    """The lines of the wrapper's ``call`` (a method of ``Runner`` or a module function)."""
    lines = source.splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(r"^\s*def call\(", line)), None)
    if start is None:
        raise ValueError("not an Inductor wrapper: no 'def call(' in the source")
    indent = len(lines[start]) - len(lines[start].lstrip())
    body = []
    for line in lines[start + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        body.append(line)
    return body


def buffer_events(source: str) -> list[BufferEvent]:
    """The wrapper's allocations, extern-op calls and frees of its own buffers, in its order."""
    events: list[BufferEvent] = []
    for line in call_body(source):
        if (m := _ALLOC.match(line)) is not None:
            nbytes = storage_bytes(_ints(m.group(2)), _ints(m.group(3)), m.group(4))
            events.append(BufferEvent("alloc", m.group(1), nbytes))
        elif (m := _EXTERN.match(line)) is not None:
            events.append(BufferEvent("extern", m.group(1), op=f"{m.group(2)}.{m.group(3)}.{m.group(4)}"))
        if "# reuse" in line:
            continue
        for group in _DEL.findall(line):
            events.extend(BufferEvent("free", name.strip()) for name in group.split(","))
    return events
