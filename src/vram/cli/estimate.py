"""``vram estimate`` on the command line: model import, ``--input`` parsing, output (needs torch).

The parser lives in `vram.cli.commands`; this module is imported only when the subcommand runs.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from vram.estimate.engine import estimate, max_batch
from vram.estimate.model import load_factory

_DTYPES = {"float32": "float32", "fp32": "float32", "float": "float32", "bf16": "bfloat16",
           "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "half": "float16",
           "float64": "float64", "double": "float64", "int64": "int64", "long": "int64",
           "int32": "int32", "int": "int32", "int16": "int16", "int8": "int8", "uint8": "uint8",
           "bool": "bool"}


def _dtype(name: str) -> Any:
    key = name.strip().lower().replace("torch.", "")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}: expected one of {', '.join(sorted(set(_DTYPES)))}")
    return getattr(torch, _DTYPES[key])


def _parse_input(spec: str, default: Any) -> tuple[list[int], Any]:
    """"8x512:int64" -> ([8, 512], torch.int64); the dtype defaults to `default`."""
    shape_text, _, dtype_text = spec.partition(":")
    try:
        shape = [int(d) for d in shape_text.lower().split("x")]
    except ValueError:
        raise ValueError(f"invalid --input {spec!r}: expected dimensions such as 8x512 or 8x512:int64") from None
    if not shape or any(d < 1 for d in shape):
        raise ValueError(f"invalid --input {spec!r}: dimensions must be positive")
    return shape, _dtype(dtype_text) if dtype_text else default


def _input_names(specs: list[str]) -> tuple[list[str | None], list[str]]:
    """"labels=8x512:int64" names a keyword argument of the model's forward; either every
    --input is named or none is (the model is then called with them in order)."""
    names: list[str | None] = []
    rest: list[str] = []
    for spec in specs:
        name, eq, tail = spec.partition("=")
        if eq and not name.isidentifier():
            raise ValueError(f"invalid --input {spec!r}: {name!r} is not an argument name")
        names.append(name if eq else None)
        rest.append(tail if eq else spec)
    if any(names) and not all(names):
        raise ValueError("--input: name every input (input_ids=8x512:int64 labels=8x512:int64) or none")
    if any(names) and len(set(names)) != len(names):
        raise ValueError("--input: an argument name is given twice")
    return names, rest


def run_estimate(args: argparse.Namespace) -> int:
    """Run ``vram estimate`` for parsed `args`; prints the report (or JSON), returns the status."""
    if not args.input:
        raise ValueError("give the model's inputs with --input, e.g. --input 8x512:int64")
    model_dtype = _dtype(args.dtype) if args.dtype else None
    names, specs = _input_names(args.input)
    shapes = [_parse_input(spec, model_dtype if model_dtype is not None else torch.float32)
              for spec in specs]
    if args.grad_accum < 1 or args.iterations < 1:
        raise ValueError("--grad-accum and --iterations must be positive")
    if (args.ddp, args.fsdp, args.tp, args.pp) != (1, 1, 1, 1) or args.tp_plan or args.microbatches is not None:
        return _run_layout(args, shapes, model_dtype, names)
    factory = load_factory(args.model)

    def build() -> Any:
        model = factory()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"{args.model}() returned {type(model).__name__}, not an nn.Module")
        return model.to(model_dtype) if model_dtype is not None else model

    def inputs(batch: int | None = None) -> Any:
        ts = tuple(torch.empty([batch if batch is not None else s[0], *s[1:]], dtype=dt, device="meta")
                   for s, dt in shapes)
        if names[0] is not None:
            return dict(zip(names, ts))
        return ts[0] if len(ts) == 1 else ts

    kw: dict[str, Any] = dict(optimizer=None if args.optimizer == "none" else args.optimizer, amp=args.amp,
                              checkpoint=args.checkpoint, grad_accum=args.grad_accum,
                              iterations=args.iterations, gpu=args.gpu, context=args.context, conf=args.conf,
                              arch=args.arch, compile=args.compile)
    try:
        best = max_batch(build, inputs, progress=sys.stderr, **kw) if args.max_batch else None
        result = estimate(build, inputs(best if best else None), **kw)
    except (ValueError, TypeError, OSError) as e:
        raise type(e)(str(e)) from None
    except Exception as e:  # noqa: BLE001 - the model's own failure, on one line
        raise RuntimeError(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if args.json:
        obj = result.to_json()
        if args.max_batch:
            obj = {"max_batch": best, "estimate": obj}
        print(json.dumps(obj))
        return 0 if result.fits else 1
    if args.max_batch:
        if best:
            print(f"largest batch that fits: {best} (the first dimension of every --input); at that batch:\n")
        else:
            print("batch 1 does not fit; what batch 1 needs:\n")
    print(result)
    return 0 if result.fits else 1  # EXIT_CODES: 1 is "does not fit"


def _run_layout(args: argparse.Namespace, shapes: list[tuple[list[int], Any]], model_dtype: Any,
                names: list[str | None]) -> int:
    """``--ddp/--fsdp/--tp/--pp``: every rank of the layout (`vram.estimate.distributed`)."""
    from vram.estimate.distributed import estimate_layout
    from vram.estimate.layout import Layout

    layout = Layout(ddp=args.ddp, fsdp=args.fsdp, tp=args.tp, pp=args.pp, tp_plan=args.tp_plan,
                    microbatches=args.microbatches, schedule=args.schedule)
    layout.check()
    layout.check_compile(args.compile)
    if args.pp > 1:
        micro = layout.n_microbatches
        if shapes[0][0][0] % micro and not args.max_batch:
            raise ValueError(f"--pp: the batch {shapes[0][0][0]} does not split into {micro} micro-batches")
    kw: dict[str, Any] = dict(optimizer=None if args.optimizer == "none" else args.optimizer, amp=args.amp,
                              checkpoint=args.checkpoint, grad_accum=args.grad_accum,
                              iterations=args.iterations, gpu=args.gpu, context=args.context, conf=args.conf,
                              arch=args.arch, compile=args.compile)
    inputs = [(shape, str(dt).replace("torch.", ""), *([name] if name else []))
              for (shape, dt), name in zip(shapes, names)]
    dtype = str(model_dtype).replace("torch.", "") if model_dtype is not None else None
    result = estimate_layout(args.model, inputs, layout, dtype=dtype, max_batch=args.max_batch,
                             progress=sys.stderr if args.max_batch else None, **kw)
    print(json.dumps(result.to_json()) if args.json else result)
    return 0 if all(r.fits for r in result.results.values()) else 1
