"""``vram estimate --ddp/--fsdp/--tp/--pp``: a training step's memory on every rank of a layout.

The ranks run as ``vram run --nproc-per-node`` runs them (`vram.run.distributed.launcher`: one
process per rank, torchrun's environment, vram's simulated NCCL process group, p2p mailbox),
each executing `vram.estimate.ranks` on its own simulated GPU; only the ranks that
`Layout.representatives` picks are simulated, and the report says which stood for which.

``max_batch``: without pipeline stages no rank waits for another, so each simulated rank searches
its own largest per-rank micro-batch (`search.search_largest`, real runs) and the layout's is the
smallest; with ``--pp`` the stages exchange activations, so every probe is one launch of all
simulated ranks.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vram.devices.nccl import with_nccl
from vram.run.distributed.launcher import Launch, launch, outside_lines
from vram.units import format_size

from .engine import EstimateResult
from .layout import Layout
from .search import search_largest

__all__ = ["LayoutEstimate", "estimate_layout", "estimate_on_layout"]


@dataclass
class LayoutEstimate:
    """Per-rank estimates of a layout; ``results`` holds the simulated ranks only."""

    layout: Layout
    stands_for: dict[int, list[int]]            #: simulated rank -> every rank it stands for
    results: dict[int, EstimateResult]
    max_batch: int | None = None
    coords: dict[int, dict[str, int]] = field(default_factory=dict)
    #: simulated rank -> NCCL memory outside the allocator, {"bytes": int | None, "lines": [...]}
    nccl: dict[int, dict[str, Any]] = field(default_factory=dict)

    def nvidia_smi(self, rank: int) -> int | None:
        """Steady-state peak reserved + CUDA context + other processes + NCCL
        (`vram.devices.nccl`); None when NCCL's figure is not derived (the report says why)."""
        sim = self.simulated_as(rank)
        return with_nccl(self.results[sim].peak_device_used, self.nccl.get(sim, {}).get("bytes"))

    def simulated_as(self, rank: int) -> int:
        """The simulated rank whose run stands for `rank`."""
        return next(r for r, rs in self.stands_for.items() if rank in rs)

    def result_of(self, rank: int) -> EstimateResult:
        return self.results[self.simulated_as(rank)]

    def to_json(self) -> dict[str, Any]:
        return {"layout": self.layout.to_json(), "max_batch": self.max_batch,
                "ranks": {str(r): {"coords": self.coords[r], "simulated_as": self.simulated_as(r)}
                          for r in sorted(self.coords)},
                "estimates": {str(r): res.to_json() for r, res in sorted(self.results.items())},
                "nccl": {str(r): n for r, n in sorted(self.nccl.items())},
                "nvidia_smi": {str(r): self.nvidia_smi(r) for r in sorted(self.coords)}}

    def __str__(self) -> str:
        from .report import render

        lay = self.layout
        per = ("each data-parallel rank's batch, split into micro-batches" if lay.pp > 1
               else "each rank's batch")
        lines = [f"vram estimate on {lay.describe()}; the --input batch is {per}"
                 + (f"; largest that fits: {self.max_batch}" if self.max_batch is not None else "")]
        sim = ", ".join(f"rank {s} (for ranks {_ranges(rs)})" for s, rs in self.stands_for.items())
        lines.append(f"  simulated: {sim}")
        lines.append(f"  {'rank':>4}  {'mesh coordinates':<40} {'peak allocated':>16} {'peak reserved':>16} "
                     f"{'nvidia-smi est.':>16}  fits")
        for r in sorted(self.coords):
            res, smi = self.result_of(r), self.nvidia_smi(r)
            c = ", ".join(f"{k} {v}" for k, v in self.coords[r].items() if lay.sizes[k] > 1)
            lines.append(f"  {r:>4}  {c:<40} {format_size(res.peak_allocated):>16} "
                         f"{format_size(res.peak_reserved):>16} {format_size(smi) if smi is not None else 'n/d':>16}"
                         f"  {'yes' if res.fits else 'NO'}")
        lines += ["  " + ln for ln in outside_lines({s: (self.results[s].context, self.nccl.get(s))
                                                      for s in self.stands_for})]
        for s, rs in self.stands_for.items():
            lines += ["", f"=== rank {s} (stands for ranks {_ranges(rs)}) ===",
                      render(self.results[s], nccl=self.nccl.get(s, {}).get("bytes"))]
        return "\n".join(lines)


def _ranges(ranks: list[int]) -> str:
    from vram.run.distributed.launcher import _ranges as ranges

    return ranges(ranks)


def rank_notices(err: str) -> list[str]:
    """The ``vram run:`` notices in the ranks' stderr (``[rankR]:`` lines), once each: what a
    rank's simulation does not model (a compiled graph it runs eagerly ...), said as one GPU's
    estimate says it."""
    said: dict[str, None] = {}
    for line in err.splitlines():
        text = _rank_line(line)[1]
        if text.startswith("vram run: "):
            said[text] = None
    return list(said)


def _rank_line(line: str) -> tuple[str, str]:
    """(rank, text) of a ``[rankR]:text`` line the launcher forwarded; ("", "") for any other line."""
    rank, sep, text = line.partition("]:")
    return (rank[5:], text) if sep and rank.startswith("[rank") else ("", "")


class _RankErrors(io.StringIO):
    """The ranks' stderr, kept; each rank's max-batch progress line (`search.search_largest`) also
    goes to `progress` as it comes, as ``max-batch: rank R: run …``."""

    def __init__(self, progress: Any) -> None:
        super().__init__()
        self.progress = progress

    def write(self, text: str) -> int:
        rank, line = _rank_line(text)
        if self.progress is not None and line.startswith("max-batch: "):
            print(f"max-batch: rank {rank}: {line[len('max-batch: '):]}", end="", file=self.progress, flush=True)
        return super().write(text)


def _launch(layout: Layout, simulated: list[int], config: dict[str, Any],
            progress: Any = None) -> dict[int, dict[str, Any]]:
    """One launch of the simulated ranks; their answers (an ``error`` raises, one line)."""
    work = tempfile.mkdtemp(prefix="vram-estimate-")
    try:
        config = dict(config, out=work)
        path = os.path.join(work, "config.json")
        with open(path, "w") as f:
            json.dump(config, f)
        spec = Launch(layout.world_size, ranks=simulated)
        out, err = io.StringIO(), _RankErrors(progress)
        launch(spec, [], "", [], out=out, err=err, command=["-m", "vram.estimate.ranks", path])
        for notice in rank_notices(err.getvalue()):
            print(notice, file=sys.stderr)
        answers: dict[int, dict[str, Any]] = {}
        for r in simulated:
            try:
                with open(os.path.join(work, f"rank{r}.json")) as f:
                    answers[r] = json.load(f)
            except (OSError, ValueError):
                tail = [ln for ln in err.getvalue().splitlines() if ln.strip()]
                raise RuntimeError(f"rank {r} ended without an answer: {tail[-1] if tail else 'no output'}") from None
        for r, a in answers.items():
            if "error" in a:
                raise (ValueError if "Error" not in a["error"].split(":")[0] else RuntimeError)(
                    f"rank {r}: {a['error']}")
        return answers
    finally:
        shutil.rmtree(work, ignore_errors=True)


def estimate_layout(model: str, inputs: list[tuple[Any, ...]], layout: Layout, *, dtype: str | None = None,
                    max_batch: bool = False, progress: Any = None, **kw: Any) -> LayoutEstimate:
    """Estimate `model` ("MODULE:FACTORY") on every rank of `layout`; `inputs` are (shape, dtype
    name) in forward's order, or (shape, dtype name, argument name) passed as keywords, with the
    per-rank micro-batch first; `kw` are `vram.estimate.estimate`'s settings
    (optimizer, amp, checkpoint, grad_accum, iterations, gpu, context, conf, arch). `progress` (a
    text stream): ``max_batch``'s runs, one line each as it ends (``rank R:`` when a rank searches)."""
    import torch

    from .layout import pipeline_blocks
    from .model import load_factory

    layout.check()
    layout.check_compile(kw.get("compile"))
    if layout.pp > 1 and any(len(spec) > 2 for spec in inputs):
        raise ValueError("--pp feeds the first stage its inputs in forward's order: name no --input")
    if layout.pp > 1 and (kw.get("amp") or kw.get("grad_accum", 1) != 1):
        raise ValueError("--pp runs the pipeline schedule's step: --amp and --grad-accum do not apply to it")
    factory = load_factory(model)
    with torch.device("meta"):
        meta = factory()
    if not isinstance(meta, torch.nn.Module):
        raise TypeError(f"{model}() returned {type(meta).__name__}, not an nn.Module")
    stands_for = layout.representatives(meta)
    if layout.pp > 1:
        pipeline_blocks(meta)   # refuse a model without a top-level ModuleList before any rank starts
    simulated = sorted(stands_for)
    config = {"model": model, "cwd": os.getcwd(), "inputs": inputs, "dtype": dtype, "kw": kw,
              "layout": {k: v for k, v in layout.to_json().items() if k not in ("world_size", "mesh")},
              "mode": "estimate", "batch": None}
    best = None
    if max_batch:
        if layout.pp > 1:
            best = search_largest(lambda b: all(a["fits"] for a in _launch(
                layout, simulated, dict(config, mode="fits", batch=b)).values()), progress=progress)
        else:
            best = min(a["max_batch"] for a in _launch(layout, simulated, dict(config, mode="search"),
                                                       progress).values())
    answers = _launch(layout, simulated, dict(config, batch=best if best else None))
    results = {r: EstimateResult(**a["estimate"]) for r, a in answers.items()}
    return LayoutEstimate(layout, stands_for, results, best,
                          {r: layout.coords(r) for r in range(layout.world_size)},
                          {r: a["nccl"] for r, a in answers.items() if "nccl" in a})


def estimate_on_layout(model: Any, example_inputs: Any, layout: Any, *, max_batch: bool = False,
                       progress: Any = None, **kw: Any) -> LayoutEstimate:
    """``vram.estimate(model, inputs, layout=...)``: `estimate_layout` from Python.

    `layout` is a `Layout` or its fields as a dict (``{"fsdp": 8}``, ``{"tp": 2, "tp_plan":
    "mymodels:plan"}``). Every rank runs in its own process and rebuilds the model there, so
    `model` must be importable: ``"MODULE:FACTORY"`` or a module-level function (not one of
    ``__main__``, which the ranks would re-run); `example_inputs` a tensor, ``torch.Size``, a
    tuple/list of them or a dict of them (keyword arguments), the first dimension of the first
    each rank's batch; the other settings those of `vram.estimate.estimate` that a rank can
    receive: names, numbers, flags, not callables (``step``, ``loss``, an optimizer factory, checkpoint classes)."""
    import torch

    lay = layout if isinstance(layout, Layout) else Layout(**dict(layout)) if isinstance(layout, dict) else None
    if lay is None:
        raise TypeError(f"layout must be a vram.estimate.layout.Layout or a dict of its fields, not "
                        f"{type(layout).__name__}")
    if isinstance(model, str):
        target = model
    elif callable(model) and not isinstance(model, torch.nn.Module) and "<" not in getattr(model, "__qualname__", "<"):
        if model.__module__ == "__main__":
            raise ValueError("layout: the model factory is defined in __main__, which each rank would re-run; "
                             "move it to a module and pass it (or 'MODULE:FACTORY')")
        target = f"{model.__module__}:{model.__qualname__}"
    else:
        raise ValueError("layout: each rank rebuilds the model in its own process, so model must be "
                         "'MODULE:FACTORY' or a module-level factory function, not an nn.Module or a local function")
    named = isinstance(example_inputs, Mapping)
    items = list(example_inputs.items()) if named else [(None, t) for t in (
        example_inputs if isinstance(example_inputs, (tuple, list)) and not isinstance(
            example_inputs, torch.Size) else (example_inputs,))]
    inputs: list[tuple[Any, ...]] = []
    for name, t in items:
        if isinstance(t, torch.Size):
            t = torch.empty(t, device="meta")
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"layout: example_inputs must be tensors or torch.Size, not {type(t).__name__}")
        spec = (list(t.shape), str(t.dtype).replace("torch.", ""))
        inputs.append((*spec, str(name)) if named else spec)
    for name, value in kw.items():
        if callable(value) or (name == "checkpoint" and not isinstance(value, bool)):
            raise ValueError(f"layout: {name}={value!r} cannot be sent to the ranks (a name, number or flag only)")
    try:
        json.dumps(kw)
    except TypeError as e:
        raise ValueError(f"layout: a setting cannot be sent to the ranks: {e}") from None
    return estimate_layout(target, inputs, lay, max_batch=max_batch, progress=progress, **kw)
