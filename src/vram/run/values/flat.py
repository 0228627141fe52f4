"""``tree_map`` and ``tree_leaves`` (``torch.utils._pytree``) over an aten op's arguments and
results, without pytree's node lookups for what they nearly always are: tensors, plain values and
lists or tuples of them. Pytree stays the reference: anything else (a ``torch.Size``, which pytree
maps into a plain tuple, a dict, a namedtuple, deeper nesting) goes to it."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

#: exact types pytree treats as leaves (with tensors, of any class)
_PLAIN = frozenset({int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout,
                    torch.memory_format})
_SEQUENCES = (list, tuple)


def _leaf(x: Any) -> bool:
    return isinstance(x, torch.Tensor) or type(x) in _PLAIN


def _flat(x: Any) -> bool:
    """A leaf, or a list or tuple of leaves."""
    if _leaf(x):
        return True
    if type(x) is list or type(x) is tuple:
        for y in x:
            if not _leaf(y):
                return False
        return True
    return False


def map_call(fn: Callable[[Any], Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``tree_map(fn, (args, kwargs))``: `fn` applied to every leaf, in pytree's order."""
    if type(args) is not tuple or type(kwargs) is not dict or not all(_flat(a) for a in args) \
            or not all(_flat(v) for v in kwargs.values()):
        return tree_map(fn, (args, kwargs))

    def one(x: Any) -> Any:
        if type(x) is list:
            return [fn(y) for y in x]
        if type(x) is tuple:
            return tuple(fn(y) for y in x)
        return fn(x)

    mapped = tuple(one(a) for a in args)
    return mapped, {k: one(v) for k, v in kwargs.items()}


def tensors_of(x: Any) -> list[torch.Tensor]:
    """``[t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]``."""
    if isinstance(x, torch.Tensor):
        return [x]
    if type(x) is tuple or type(x) is list:
        found: list[torch.Tensor] = []
        for y in x:
            if isinstance(y, torch.Tensor):
                found.append(y)
            elif type(y) is list or type(y) is tuple:
                for z in y:
                    if isinstance(z, torch.Tensor):
                        found.append(z)
                    elif type(z) not in _PLAIN:
                        return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]
            elif type(y) not in _PLAIN:
                return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]
        return found
    if type(x) in _PLAIN:
        return []
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]
