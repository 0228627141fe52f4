"""One rank of a multi-GPU ``vram estimate`` (``python -m vram.estimate.ranks CONFIG.json``).

Started by `vram.estimate.distributed` through ``vram run``'s launcher
(`vram.run.distributed.launcher`), so it has torchrun's environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` …) and the point-to-point mailbox. Each simulated run opens its own simulated
GPUs, process group and device mesh (`vram.estimate.layout.RankPlan`). The config names the
model factory, the inputs, `estimate`'s settings, the layout and the mode: ``estimate`` (the
report at ``batch``), ``fits`` (does ``batch`` fit) or ``search`` (this rank's largest batch).
The answer goes to ``OUT/rankR.json``; a failure is one line under ``"error"``.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

__all__ = ["main"]


def _inputs(config: dict[str, Any], batch: int | None) -> Any:
    """The inputs: (shape, dtype) in forward's order, or (shape, dtype, name) keywords."""
    specs = config["inputs"]
    ts = tuple(torch.empty([batch if batch is not None else spec[0][0], *spec[0][1:]],
                           dtype=getattr(torch, spec[1]), device="meta") for spec in specs)
    if specs and len(specs[0]) > 2:
        return {spec[2]: t for spec, t in zip(specs, ts)}
    return ts[0] if len(ts) == 1 else ts


def answer(config: dict[str, Any], rank: int) -> dict[str, Any]:
    """What this rank was asked (see the module doc)."""
    from .engine import estimate, fits, probe
    from .layout import Layout, RankPlan
    from .model import load_factory
    from .search import search_largest

    if config["cwd"] not in sys.path:
        sys.path.insert(0, config["cwd"])
    os.chdir(config["cwd"])
    factory = load_factory(config["model"])
    dtype = getattr(torch, config["dtype"]) if config["dtype"] else None

    def build() -> Any:
        model = factory()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"{config['model']}() returned {type(model).__name__}, not an nn.Module")
        return model.to(dtype) if dtype is not None else model

    layout = Layout(**config["layout"])
    kw = dict(config["kw"])

    def plan(batch: int | None) -> RankPlan:
        return RankPlan(layout, rank, _inputs(config, batch))

    mode, batch = config["mode"], config["batch"]
    if mode == "search":
        return {"max_batch": search_largest(lambda b: probe(build, _inputs(config, b), parallel=plan(b), **kw),
                                            progress=sys.stderr)}
    if mode == "fits":
        return {"fits": fits(build, _inputs(config, batch), parallel=plan(batch), **kw)}
    from vram.devices.gpus import resolve_gpu
    from vram.run.distributed import nccl

    nccl.reset()
    result = estimate(build, _inputs(config, batch), parallel=plan(batch), **kw)
    result.settings["layout"] = layout.describe()
    result.settings["rank"] = rank
    return {"estimate": result.to_json(), "nccl": nccl.rank_figure(resolve_gpu(kw.get("gpu", "80GiB"), kw.get("arch")))}


def main(argv: list[str] | None = None) -> int:
    from vram.run.distributed.rank import write_result
    from vram.units import parse_size

    args = sys.argv[1:] if argv is None else argv
    with open(args[0]) as f:
        config = json.load(f)
    rank = int(os.environ["RANK"])
    try:
        out, status = answer(config, rank), 0
    except Exception as e:  # noqa: BLE001 - the model's or the layout's failure, on one line
        first = str(e).splitlines()[0] if str(e) else ""
        out, status = {"error": f"{type(e).__name__}: {first}" if not isinstance(e, ValueError) else first}, 1
    with open(os.path.join(config["out"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    write_result(status, parse_size(config["kw"].get("context", 0), "context"))
    return status


if __name__ == "__main__":
    sys.exit(main())
