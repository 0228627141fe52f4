"""What an aten op's arguments and schema say, for lazy host tensors (`vram.run.memory.lazy_host`):
how many elements a factory call makes (before running it), the tensors an op writes, the
overload that takes a ``generator=``.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._pytree import tree_leaves


def _size_numel(size: Any) -> int | None:
    """Elements of a size list (``empty/zeros/ones/full/rand/randn(size, ...)``), else None."""
    ok = isinstance(size, (list, tuple)) and all(type(n) is int for n in size)
    return math.prod(size) if ok else None


def factory_numel(name: str, args: Any, kwargs: dict[str, Any]) -> int | None:
    """The elements a CPU factory call makes, read off its arguments at the torch-function level
    (``torch.zeros(2, 3)``, ``torch.randint(0, 9, (4,))``, ``torch.arange(8)``) or the aten level
    (sizes as lists); None when not plain numbers. A hint: deciding "small, so real" early skips
    the lazy path, and a wrong answer only makes a tensor real or lazy, never a wrong value."""
    if name in ("arange", "range"):
        nums = args[:3]
        if not nums or len(args) > 3 or not all(type(x) in (int, float) for x in nums):
            return None
        start, end, step = (0, nums[0], 1) if len(nums) == 1 else (*nums[:2], nums[2] if len(nums) == 3 else 1)
        if step == 0:
            return None
        span = (end - start) / step
        return max(0, math.ceil(span) if name == "arange" else math.floor(span) + 1)
    if name == "randperm":
        return args[0] if args and type(args[0]) is int else None
    if name == "eye":
        dims = args[:2]
        return dims[0] * dims[-1] if dims and all(type(n) is int for n in dims) else None
    if name in ("linspace", "logspace"):
        steps = args[2] if len(args) > 2 else kwargs.get("steps")
        return steps if type(steps) is int else None
    if name == "randint":
        return _size_numel(kwargs["size"] if "size" in kwargs else args[-1] if args else None)
    if "size" in kwargs:
        return _size_numel(kwargs["size"])
    if args and all(type(n) is int for n in args) and name not in ("full", "empty_strided", "empty_permuted"):
        return _size_numel(args)  # varargs sizes: torch.zeros(2, 3)
    return _size_numel(args[0]) if args else None


def written_tensors(func: Any, args: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an aten op writes (its schema's mutable arguments)."""
    if not func._schema.is_mutable:
        return []
    found: list[torch.Tensor] = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(a.name)
        found.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return found


def with_generator(func: Any) -> Any:
    """The overload of `func` that takes a ``generator=`` (``rand.default`` → ``rand.generator``,
    ``randint.low`` → ``randint.low_generator``)."""
    if any(a.name == "generator" for a in func._schema.arguments):
        return func
    name = "generator" if func._overloadname == "default" else func._overloadname + "_generator"
    return getattr(func.overloadpacket, name)
