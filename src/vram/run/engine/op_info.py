"""What the PrivateUse1 engine reads from an op's schema, read once per op
(`vram.run.engine.privateuse1`): its name, its returns' alias annotations and, for each return
that aliases an input, which argument that is. Reading ``op._schema`` builds new Python objects
for every argument and annotation on each access."""
from __future__ import annotations

from typing import Any

import torch

from vram.run.values.flat import tensors_of

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
    """The tensors among an op's arguments, in ``tree_leaves((args, kwargs))`` order (the leaves of
    ``[*args, *kwargs.values()]``, whose flat case `tensors_of` takes without pytree)."""
    return tensors_of([*args, *kwargs.values()])


_SCALAR_OVERLOADS: dict[tuple[Any, tuple[int, ...]], Any] = {}
_NUMBER = (bool, int, float, complex)
#: by op: the positions of its schema's ``Tensor`` arguments (reading ``op._schema`` builds them anew)
_TENSOR_PLACES: dict[Any, tuple[int, ...]] = {}


def scalar_overload(op: Any, args: tuple[Any, ...]) -> Any:
    """The overload to run when a Python number sits where `op`'s schema wants a Tensor.

    A ``.Scalar`` overload's composite kernel wraps its number (``wrapped_scalar_tensor``) and
    calls the ``.Tensor`` one (``remainder``, ``fmod``, ``bitwise_and``, ``xlogy``, ``copysign``:
    ``aten/src/ATen/native/BinaryOps.cpp``); a Python kernel receives the wrapped number as the
    Python number (``torch::jit::toPyObject``), which the ``.Tensor`` overload refuses when called
    from Python ("Expected a value of type 'Tensor'": only ``add``/``sub``/``mul``/``div``
    accept numbers as tensors). The overload of the same op with ``Scalar`` in those places
    computes the same (type promotion treats a wrapped number and a Scalar alike); `op` itself
    when no number is misplaced or no overload fits."""
    tensor_places = _TENSOR_PLACES.get(op)
    if tensor_places is None:
        tensor_places = _TENSOR_PLACES[op] = tuple(
            i for i, a in enumerate(op._schema.arguments) if isinstance(a.type, torch.TensorType))
    places = tuple(i for i in tensor_places if i < len(args) and isinstance(args[i], _NUMBER))
    if not places:
        return op
    schema_args = op._schema.arguments
    found = _SCALAR_OVERLOADS.get((op, places))
    if found is None:
        found = op
        packet = op.overloadpacket
        for name in packet.overloads():
            other = getattr(packet, name)
            theirs = other._schema.arguments
            if len(theirs) == len(schema_args) and all(
                    str(t.type) == ("number" if i in places else str(a.type))
                    for i, (a, t) in enumerate(zip(schema_args, theirs))):
                found = other
                break
        _SCALAR_OVERLOADS[(op, places)] = found
    return found
