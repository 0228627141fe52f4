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


class HigherOrder:
    """A higher-order operator (``torch.ops.higher_order.<name>``, which does not pickle), by name."""

    def __init__(self, name: str) -> None:
        self.name = name


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
        target = HigherOrder(node.target.name()) if isinstance(node.target, torch._ops.HigherOrderOperator) \
            else node.target
        nodes.append((node.op, node.name, target, args, kwargs))
    return {"nodes": nodes, "subgraphs": subgraphs}


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

    for op, name, target, args, kwargs in nodes:
        if isinstance(target, HigherOrder):
            target = getattr(torch.ops.higher_order, target.name)
        node = graph.create_node(op, target, resolve(args), resolve(kwargs), name=name)
        env[name] = node
    return torch.fx.GraphModule(root, graph)
