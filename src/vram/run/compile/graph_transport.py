"""A Dynamo graph sent to the compile process node by node.

Pickling a ``GraphModule`` sends its Python code, which the other side traces again with FX's
symbolic tracer (``torch.fx.graph_module._deserialize_graph_module``): a factory call with
constant arguments (``torch.arange(512, device=...)``) then runs at trace time and becomes a
tensor constant, which is not the graph Dynamo traced. So the nodes themselves are sent: op,
name, target (functions pickle by their qualified name) and arguments, other nodes named.
"""
from __future__ import annotations

from typing import Any

import torch


class NodeRef:
    """Another node of the graph, by name."""

    def __init__(self, name: str) -> None:
        self.name = name


def graph_nodes(graph: torch.fx.Graph) -> list[tuple[str, str, Any, Any, Any]]:
    """The graph's nodes as plain values; ValueError for a node that reads a module attribute
    (``get_attr``: a tensor of the run, which the compile process does not have)."""
    nodes = []
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module"):
            raise ValueError(f"a graph node reading the module ({node.op} {node.target})")
        args = torch.fx.node.map_arg(node.args, lambda n: NodeRef(n.name))  # type: ignore[arg-type,return-value]
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: NodeRef(n.name))  # type: ignore[arg-type,return-value]
        nodes.append((node.op, node.name, node.target, args, kwargs))
    return nodes


def graph_module(nodes: list[tuple[str, str, Any, Any, Any]]) -> torch.fx.GraphModule:
    """The ``GraphModule`` of `graph_nodes`' answer."""
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

    for op, name, target, args, kwargs in nodes:
        node = graph.create_node(op, target, resolve(args), resolve(kwargs), name=name)
        env[name] = node
    return torch.fx.GraphModule(torch.nn.Module(), graph)
