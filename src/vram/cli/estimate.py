"""``vram estimate`` on the command line: model import, ``--input`` parsing, output (needs torch).

The parser lives in `vram.cli.commands`; this module is imported only when the subcommand runs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

from vram.estimate.engine import estimate, max_batch

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


def _load_factory(target: str) -> Any:
    """MODULE:FACTORY (or path/to/file.py:FACTORY) -> the callable."""
    import importlib
    import importlib.util

    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"invalid model {target!r}: expected MODULE:FACTORY, e.g. mymodels:gpt2_small")
    if module_name.endswith(".py"):
        if not os.path.isfile(module_name):
            raise OSError(f"can't open file {module_name!r}: no such file")
        spec = importlib.util.spec_from_file_location(os.path.basename(module_name)[:-3], module_name)
        if spec is None or spec.loader is None:
            raise ValueError(f"cannot import {module_name!r}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"cannot import {module_name!r}: {e}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{target} is not callable: FACTORY() must return an nn.Module")
    return obj


def run_estimate(args: argparse.Namespace) -> int:
    """Run ``vram estimate`` for parsed `args`; prints the report (or JSON), returns the status."""
    if not args.input:
        raise ValueError("give the model's inputs with --input, e.g. --input 8x512:int64")
    model_dtype = _dtype(args.dtype) if args.dtype else None
    shapes = [_parse_input(spec, model_dtype if model_dtype is not None else torch.float32)
              for spec in args.input]
    if args.grad_accum < 1 or args.iterations < 1:
        raise ValueError("--grad-accum and --iterations must be positive")
    factory = _load_factory(args.model)

    def build() -> Any:
        model = factory()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"{args.model}() returned {type(model).__name__}, not an nn.Module")
        return model.to(model_dtype) if model_dtype is not None else model

    def inputs(batch: int | None = None) -> Any:
        ts = tuple(torch.empty([batch if batch is not None else s[0], *s[1:]], dtype=dt, device="meta")
                   for s, dt in shapes)
        return ts[0] if len(ts) == 1 else ts

    kw: dict[str, Any] = dict(optimizer=None if args.optimizer == "none" else args.optimizer, amp=args.amp,
                              checkpoint=args.checkpoint, grad_accum=args.grad_accum,
                              iterations=args.iterations, gpu=args.gpu, context=args.context, conf=args.conf,
                              arch=args.arch)
    try:
        best = max_batch(build, inputs, **kw) if args.max_batch else None
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
        return 0
    if args.max_batch:
        if best:
            print(f"largest batch that fits: {best} (the first dimension of every --input); at that batch:\n")
        else:
            print("batch 1 does not fit; what batch 1 needs:\n")
    print(result)
    return 0
