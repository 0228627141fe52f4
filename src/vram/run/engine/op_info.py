"""What the PrivateUse1 engine reads from an op's schema, read once per op
(`vram.run.engine.privateuse1`): its name, its returns' alias annotations and, for each return
that aliases an input, which argument that is. Reading ``op._schema`` builds new Python objects
for every argument and annotation on each access."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves

_OPS: dict[Any, OpInfo] = {}


class OpInfo:
    """One op's schema as the engine reads it."""

    __slots__ = ("name", "returns", "sources")

    def __init__(self, op: Any) -> None:
        schema = op._schema
        self.name: str = op.overloadpacket.__name__
        #: each return's ``alias_info`` (None for a new tensor)
        self.returns: tuple[Any, ...] = tuple(r.alias_info for r in schema.returns)
        #: for each aliasing return, the (position, name) of the first argument sharing its alias
        #: set (``Tensor(a!) self`` -> ``Tensor(a!)``); None where there is none
        self.sources: tuple[tuple[int, str] | None, ...] = tuple(
            None if alias is None else next(
                ((j, a.name) for j, a in enumerate(schema.arguments)
                 if a.alias_info is not None and set(a.alias_info.before_set) & set(alias.before_set)), None)
            for alias in self.returns)

    def source(self, i: int, args: Any, kwargs: Any) -> Any:
        """The argument that return `i` aliases, as passed (positionally or by name)."""
        found = self.sources[i]
        if found is None:
            raise StopIteration  # as ``next`` over no matching argument
        j, name = found
        return args[j] if j < len(args) else kwargs.get(name)


def of(op: Any) -> OpInfo:
    info = _OPS.get(op)
    if info is None:
        info = _OPS[op] = OpInfo(op)
    return info


def tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensors among an op's arguments, in ``tree_leaves((args, kwargs))`` order: an aten op's
    arguments are tensors, lists of them and plain values (anything deeper goes to pytree)."""
    found: list[torch.Tensor] = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, torch.Tensor):
                    found.append(x)
                elif not isinstance(x, (int, float, bool, type(None))):
                    return [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        elif isinstance(a, dict):
            return [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return found
