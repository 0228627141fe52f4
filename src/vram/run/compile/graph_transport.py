"""A Dynamo graph sent to the compile process node by node.

Pickling a ``GraphModule`` sends its Python code, which the other side traces again with FX's
symbolic tracer (``torch.fx.graph_module._deserialize_graph_module``): a factory call with
constant arguments (``torch.arange(512, device=...)``) then runs at trace time and becomes a
tensor constant, which is not the graph Dynamo traced. So the nodes themselves are sent: op,
name, target (functions pickle by their qualified name; one made inside another function, as
``torch.nn.functional.max_pool2d`` is by ``boolean_dispatch``, is sent by the name its module gives
it: `FunctionRef`; an operator by its path under ``torch.ops``: `Operator`) and arguments, other
nodes named, and the innermost module of Dynamo's ``nn_module_stack`` (its source path and class
name: the class itself may not import in the compile process), which AOTAutograd copies to the
nodes it traces from each node (``fx.proxy``'s preserved node meta), so the compiled forward can
say which module made each tensor it saves (`module_of`).
"""
from __future__ import annotations

from typing import Any

import torch


class NodeRef:
    """Another node of the graph, by name."""

    def __init__(self, name: str) -> None:
        self.name = name


class HigherOrder:
    """A higher-order operator (``torch.ops.higher_order.<name>``, which does not pickle), by name."""

    def __init__(self, name: str) -> None:
        self.name = name


class FunctionRef:
    """A function made inside another (``__qualname__`` with ``<locals>``, which pickle cannot name),
    by the qualified name FX's code generation gives it (``torch.fx.node._get_qualified_name``:
    its module and ``__name__``), which is where its module holds it; a stand-in the run put in
    ``torch.cuda`` by its name there (the compile process has its own for the simulated card)."""

    def __init__(self, qualified: str) -> None:
        self.qualified = qualified

    def resolve(self) -> Any:
        import importlib

        module, _, name = self.qualified.rpartition(".")
        return getattr(importlib.import_module(module), name)


class Operator:
    """An ATen or custom operator, an overload (``torch.ops.aten.linear.default``) or its packet
    (``torch.ops.aten.linear``), which do not pickle (their schema's pybind11 functions), by its
    path under ``torch.ops`` (``"aten.linear.default"``, its ``str``). Dynamo's graph of a
    ``torch.export``-made module calls them (a pipeline stage's ``InterpreterModule``s)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def resolve(self) -> Any:
        found: Any = torch.ops
        for part in self.path.split("."):
            found = getattr(found, part)
        return found


def _sent_target(target: Any) -> Any:
    """A node's target as it travels: a higher-order operator by name, an operator by its path
    under ``torch.ops``, a function made inside another by its module's name for it (ValueError
    when the module does not hold it there)."""
    if isinstance(target, torch._ops.HigherOrderOperator):
        return HigherOrder(target.name())
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return Operator(str(target))
    if callable(target) and "<locals>" in getattr(target, "__qualname__", ""):
        try:
            ref = FunctionRef(torch.fx.node._get_qualified_name(target))
            found = ref.resolve()
        except (AttributeError, ImportError, RuntimeError, ValueError):
            found = None
        if found is not target:  # the run's stand-in for a torch.cuda function (get_device_capability)
            name = next((n for n, v in vars(torch.cuda).items() if v is target), None)
            ref, found = FunctionRef(f"torch.cuda.{name}"), target if name else None
        if found is not target:
            raise ValueError(f"a graph node calling a function defined inside another ({target.__qualname__})")
        return ref
    return target


def graph_nodes(graph: torch.fx.Graph, owner: torch.nn.Module | None = None) -> dict[str, Any]:
    """The graph's nodes as plain values, and the subgraphs its ``get_attr`` nodes read from
    `owner` (a higher-order op's body: FlexAttention's ``score_mod`` and ``mask_mod``), each sent
    the same way; ValueError for another module attribute (a tensor of the run, which the
    compile process does not have, or a module call)."""
    nodes, subgraphs = [], {}
    for node in graph.nodes:
        if node.op == "call_module" or (node.op == "get_attr" and owner is None):
            raise ValueError(f"a graph node reading the module ({node.op} {node.target})")
        if node.op == "get_attr":
            value = getattr(owner, str(node.target), None)
            if not isinstance(value, torch.fx.GraphModule):
                raise ValueError(f"a graph node reading the module ({node.op} {node.target})")
            subgraphs[str(node.target)] = graph_nodes(value.graph, value)
        args = torch.fx.node.map_arg(node.args, lambda n: NodeRef(n.name))  # type: ignore[arg-type,return-value]
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: NodeRef(n.name))  # type: ignore[arg-type,return-value]
        nodes.append((node.op, node.name, _sent_target(node.target), args, kwargs, module_of(node)))
    return {"nodes": nodes, "subgraphs": subgraphs}


def module_of(node: Any) -> tuple[str, str] | None:
    """The innermost entry of `node`'s ``nn_module_stack``: Dynamo's source of the module
    (``"L['self'].blocks.0"``) and its class's name (a class, or already its name); None for a
    node made outside every module (a graph input, an op in the frame's own code)."""
    stack = getattr(node, "meta", {}).get("nn_module_stack") or {}
    if not stack:
        return None
    path, cls = list(stack.values())[-1]
    return str(path), cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"


def graph_module(sent: dict[str, Any]) -> torch.fx.GraphModule:
    """The ``GraphModule`` of `graph_nodes`' answer, its subgraphs as its attributes."""
    root = torch.nn.Module()
    for name, sub in sent["subgraphs"].items():
        setattr(root, name, graph_module(sub))
    nodes = sent["nodes"]
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}

    def resolve(value: Any) -> Any:
        if isinstance(value, NodeRef):
            return env[value.name]
        if isinstance(value, (list, tuple)):
            resolved = [resolve(v) for v in value]
            return type(value)(resolved) if not hasattr(value, "_fields") else type(value)(*resolved)
        if isinstance(value, dict):
            return {k: resolve(v) for k, v in value.items()}
        if isinstance(value, slice):
            return slice(resolve(value.start), resolve(value.stop), resolve(value.step))
        return value

    for op, name, target, args, kwargs, module in nodes:
        if isinstance(target, HigherOrder):
            target = getattr(torch.ops.higher_order, target.name)
        elif isinstance(target, (FunctionRef, Operator)):
            target = target.resolve()
        if op == "call_function" and _device_constant(target, args, kwargs):
            env[name] = _constant_on_device(graph, name, args, kwargs)
            continue
        node = graph.create_node(op, target, resolve(args), resolve(kwargs), name=name)
        if module is not None:
            node.meta["nn_module_stack"] = {module[0]: module}
        env[name] = node
    return torch.fx.GraphModule(root, graph)


#: said by the run when a compiled graph holds a tensor constant with data (`_constant_on_device`)
CONSTANTS_HELD = ("a tensor constant made inside a compiled graph (torch.tensor(data, device='cuda')) is held "
                  "by the compiled graph on a GPU (a block of its bytes, from 512 B): not charged")


def _device_constant(target: Any, args: Any, kwargs: Any) -> bool:
    """Is the node ``torch.tensor(data, ..., device=cuda)`` with data that names no other node?"""
    device = kwargs.get("device")
    if getattr(target, "__name__", "") != "tensor" or getattr(target, "__module__", None) not in ("torch", None):
        return False
    if not (isinstance(device, torch.device) and device.type == "cuda"):
        return False
    found: list[bool] = []
    torch.fx.node.map_aggregate((args, kwargs), lambda v: found.append(isinstance(v, NodeRef)) or v)
    return not any(found)


def _constant_on_device(graph: torch.fx.Graph, name: str, args: Any, kwargs: Any) -> torch.fx.Node:
    """``torch.tensor(data, device="cuda")`` in a graph: on a GPU, AOTAutograd's trace makes the
    data a real CUDA constant that the graph copies on each call (``lift_fresh_copy``: a buffer of
    its shape and dtype). This process's CUDA kernels run on the host, so the constant would be a
    host tensor there (FakeTensorMode propagates constants by running them); it becomes an
    ``empty`` on the device filled by ``copy_`` from the host constant: the same buffer per call.
    The constant itself, a block held by the compiled graph, is named (`CONSTANTS_HELD`)."""
    from .cuda_process import GUESSED

    host_kwargs = {k: v for k, v in kwargs.items() if k != "device"}
    value = torch.tensor(*args, **host_kwargs)
    if value.numel():
        GUESSED.add(CONSTANTS_HELD)
    host = graph.create_node("call_function", torch.tensor, tuple(args), host_kwargs, name=f"{name}_host")
    empty = graph.create_node("call_function", torch.empty, (tuple(value.shape),),
                              {"dtype": value.dtype, "device": kwargs["device"]}, name=f"{name}_empty")
    return graph.create_node("call_method", "copy_", (empty, host), {}, name=name)
