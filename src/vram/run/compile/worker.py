"""The compile process: ``python -m vram.run.compile.worker CARD_JSON``, started once per ``vram run``
by `vram.run.compile.client` and reused for every graph Dynamo hands to ``torch.compile``'s backend.

It makes itself a process where Inductor compiles for ``cuda`` (`cuda_process.prepare`, with the
simulated card's properties), then answers requests read from stdin, one length-prefixed pickle
each: a Dynamo graph (its nodes, `graph_transport`, devices already ``cuda:0``), the example
inputs' metadata, the ambient CUDA autocast and grad mode. The answer is the generated wrappers'
sources (forward, then backward when the graph trains), AOTAutograd's runtime layout of the
forward's outputs (`inductor_cuda.runtime_layout`), the SDPA kernels chosen and each Triton
kernel's autotuning configs (`autotune.kernel_configs`); or the named reason it is not modelled.
Anything the compile prints goes to stderr: stdout carries answers only.
"""
from __future__ import annotations

import json
import os
import pickle
import struct
import sys
import traceback
from typing import IO, Any

_HEADER = struct.Struct("<Q")


def write_frame(stream: IO[bytes], value: Any) -> None:
    """One length-prefixed pickle."""
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def read_frame(stream: IO[bytes]) -> Any:
    """The next length-prefixed pickle; EOFError when the other side closed."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)  # noqa: S301 - the parent vram run process, same user


class _ExampleValues:
    """Each node's value on fake tensors, ``requires_grad`` kept, in ``meta["example_value"]`` as
    Dynamo leaves it (``FakeTensorProp`` stores detached snapshots: no ``requires_grad``, which
    SDPA's routing reads)."""

    def __init__(self, gm: Any) -> None:
        import torch

        class Interpreter(torch.fx.Interpreter):
            def run_node(self, node: Any) -> Any:
                value = super().run_node(node)
                node.meta["example_value"] = value
                return value

        self.interpreter = Interpreter(gm)

    def run(self, *args: Any) -> Any:
        return self.interpreter.run(*args)


def _meta_input(shape: Any, stride: Any, dtype: str, requires_grad: bool, is_param: bool,
                is_leaf: bool = True, device: str = "meta") -> Any:
    """An example input on `device` (meta, or fake CUDA in a fake mode): a parameter, a leaf, or
    (requires grad, not a leaf) a clone of one."""
    import torch

    t = torch.empty_strided(shape, stride, dtype=getattr(torch, dtype), device=device)
    if is_param:
        return torch.nn.Parameter(t)
    if requires_grad and not is_leaf:
        with torch.enable_grad():
            return t.requires_grad_(True).clone()
    return t.requires_grad_(requires_grad)


def example_inputs(specs: list[tuple[Any, ...]]) -> tuple[list[Any], Any]:
    """The graph's example inputs (`backend.graph_request`'s specs) and the fake mode to trace
    them in. Static sizes: meta tensors and a fresh mode. Symbolic sizes (dynamic shapes): a
    ``ShapeEnv`` (no duck sizing: each of Dynamo's symbols stays its own), one symbol per symbol
    Dynamo passed as a graph input (its hint the size it had when Dynamo compiled), each size and
    stride its expression over them, the tensors fake CUDA tensors of that mode. A host scalar
    among the inputs (read with ``item()``) is traced there too, as a fake CPU tensor."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    if not any(spec[0] == "symint" or (len(spec) > 6 and spec[6]) or _host(spec) for spec in specs):
        return [_meta_input(*spec[:6]) for spec in specs], FakeTensorMode(allow_non_fake_inputs=True)
    env = ShapeEnv(duck_shape=False)
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    hints = {spec[1]: spec[2] for spec in specs if spec[0] == "symint" and spec[1].is_Symbol}
    symbols: dict[Any, Any] = {}

    def value(expr: Any, hint: int) -> Any:
        if isinstance(expr, int):
            return expr
        for free in sorted(expr.free_symbols, key=str):
            if free not in symbols:
                if free not in hints:
                    raise NotModelledInput(f"a size {expr} over a symbol that is not a graph input")
                symbols[free] = env.create_symbol(hints[free], ConstantSource(str(free)), DimDynamic.DYNAMIC)
        return env.create_symintnode(expr.xreplace(symbols), hint=hint, source=ConstantSource(str(expr)))

    inputs: list[Any] = []
    with mode:
        for spec in specs:
            if spec[0] == "symint":
                inputs.append(value(spec[1], spec[2]))
                continue
            shape, stride, *rest = spec[:6]
            symbolic = spec[6] if len(spec) > 6 else None
            if symbolic:
                shape = [value(e, h) for e, h in zip(symbolic[0], shape)]
                stride = [value(e, h) for e, h in zip(symbolic[1], stride)]
            inputs.append(_meta_input(shape, stride, *rest, device="cpu" if _host(spec) else "cuda"))
    return inputs, mode


def _host(spec: tuple[Any, ...]) -> bool:
    """A host (CPU) scalar among the inputs: a Python float Dynamo passes as a 0-d tensor."""
    return len(spec) > 7 and bool(spec[7])


class NotModelledInput(ValueError):
    """A graph input the compile process cannot make (named reason)."""


def compile_request(request: dict[str, Any]) -> dict[str, Any]:
    """Compile one graph (see the module docstring)."""
    import torch

    from .autotune import kernel_configs
    from .graph_transport import graph_module
    from .inductor_cuda import NotModelled, compile_for_cuda, fake_inputs, route_sdpa

    gm = graph_module(pickle.loads(request["graph"]))  # noqa: S301 - the parent vram run process, same user
    try:
        inputs, mode = example_inputs(request["inputs"])
    except NotModelledInput as e:
        return {"not_modelled": str(e)}
    autocast = getattr(torch, request["autocast"]) if request["autocast"] else None
    torch.backends.cuda.matmul.fp32_precision = request.get("fp32_precision") or "none"
    from .cuda_process import GUESSED
    from .matmul_padding import UNDECIDED, notice

    GUESSED.clear()
    UNDECIDED.clear()
    layout: dict[str, Any] = {}
    try:
        with torch.set_grad_enabled(request["grad"]):
            with mode:
                _ExampleValues(gm).run(*fake_inputs(inputs, mode))
            if mode.shape_env is not None:  # sizes the example run made from values (item()): not the compile's
                mode.shape_env.pending_fresh_unbacked_symbols.clear()
            backends = route_sdpa(gm, autocast, request["major"], request["minor"])
            for node in gm.graph.nodes:  # the compile makes its own fake tensors, in its own mode
                node.meta.pop("example_value", None)
            sources = compile_for_cuda(gm, inputs, autocast, layout, bool(request.get("cudagraphs")),
                                       request.get("static_inputs"), bool(request.get("max_autotune")),
                                       request.get("inductor_config"))
    except NotModelled as e:
        return {"not_modelled": str(e)}
    if layout.get("not_modelled"):
        return {"not_modelled": ", ".join(layout["not_modelled"])}
    kernels = {name: info for source in sources for name, info in kernel_configs(source).items()}
    return {"sources": sources, "layout": layout, "backends": backends, "kernels": kernels,
            "guessed": sorted(GUESSED | {line for line in [notice()] if line is not None})}


def main(argv: list[str]) -> int:
    card = json.loads(argv[0])
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what the compile prints goes to stderr
    sys.stdout = sys.stderr
    from . import cuda_process

    requests = sys.stdin.buffer
    try:
        cuda_process.prepare(**card)
    except Exception as e:  # the parent says why, once, and runs eagerly
        write_frame(answers, {"setup_error": f"{type(e).__name__}: {e}"})
        return 1
    write_frame(answers, {"ready": True})
    while True:
        try:
            request = read_frame(requests)
        except EOFError:
            return 0
        try:
            answer = compile_request(request)
        except Exception as e:
            traceback.print_exc()
            answer = {"error": f"{type(e).__name__}: {e}"}
        write_frame(answers, answer)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
