"""Predict a training step's GPU memory before running it (``vram estimate``; needs torch).

`estimate` runs `iterations` real training steps of a model under `vram.run.runtime.simulated_cuda`
— tensors on ``meta``, every storage charged to the byte-faithful simulated caching allocator —
and watches every allocation and free:

* **Peaks.** Allocated and reserved bytes, per phase (forward, backward, optimizer step), for the
  first iteration and for the steady state (iterations 2..N: the maximum over them, which is what
  must fit); ``peak_device_used`` is the steady-state reserved peak plus the CUDA context and other
  processes' memory — what nvidia-smi would show.
* **Categories** of the blocks live at the steady-state allocated peak: parameters, buffers,
  gradients (storages that are or become a ``.grad``), optimizer state (everything in
  ``optimizer.state``, plus a GradScaler's scale and growth tracker; Adam's ``step`` counters live
  on the CPU unless ``capturable``/``fused``, so they cost no GPU memory), activations (storages
  saved for backward, seen by a ``saved_tensors_hooks`` pack hook; under `checkpoint`, also the
  inputs of checkpointed blocks and what their recomputation keeps), cuBLAS workspaces, and
  temporaries (the rest: inputs not saved, outputs, the loss, kernel scratch). Allocated bytes are
  block sizes (512-byte multiples), as ``memory_allocated()`` counts them; ``cache_fragmentation``
  is reserved − allocated at that moment. The same breakdown at the end of the steady-state forward
  pass is in ``forward_end``.
* **By module**: the activations live at the peak, by the innermost module whose forward allocated
  them (global forward pre/post hooks keep a module stack; names are ``named_modules`` paths).

The model is never touched: an ``nn.Module`` (on CPU or meta) is cloned onto ``meta`` with
``copy.deepcopy`` (parameters and buffers replaced by empty meta tensors, so no data is copied); a
zero-argument factory is called inside the simulation under ``torch.device("meta")`` (no host
memory, no initialisation cost; one that fails on meta is called as it is) — what it puts on
"cuda" itself is charged as it does so. The meta model is then moved with ``model.to("cuda")``,
so parameters and buffers are charged exactly as ``model.cuda()`` charges a CPU model: one block
each, in ``Module._apply`` order, tied weights once. Inputs (tensors, ``torch.Size``s, in a
tensor / tuple / list / dict) become new simulated CUDA tensors of the same shape and dtype at the
start of every iteration, as a data loader's ``batch.cuda()`` would; pass meta tensors to avoid
host memory. The GPU is one simulated H100 (sm90: 32 MiB cuBLAS workspaces).

`max_batch` finds the largest batch for which `iterations` steps run without OOM with real
simulated runs (`fits`), the batches to run chosen from the room each fitting run left
(`vram.estimate.search`).

Cost: GPT-2 small (batch 8 × 512, AdamW, 3 iterations) takes 1.1–1.5 s of CPU warm, ~4–5 s in a
fresh process (torch's one-time imports, each distinct op's meta kernel once), on a 2-core machine
under load; ``benchmarks/bench_estimate.py`` measures it and shows where the time goes.
"""
from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn as nn

from vram.devices.gpus import CUDA_CONTEXT, GpuPreset, resolve_gpu
from vram.frontend import memory as _memory
from vram.run.distributed.nccl import NcclOutOfMemoryError
from vram.run.runtime import active_sim, simulated_cuda
from vram.units import parse_size

from .model import build_model, default_step, describe_inputs, make_optimizer, materialize, to_gpu
from .search import Probe, search_largest
from .trace import CATEGORIES, Tracker, apply_checkpoint, unpack

__all__ = ["estimate", "max_batch", "fits", "EstimateResult", "CATEGORIES", "PHASES"]

PHASES = ("forward", "backward", "optimizer")
_UNBOUNDED = 1 << 42  # 4 TiB: the GPU a run that ran out of memory is repeated on, to report needs
_AMP = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
        "float16": torch.float16}


@dataclass
class EstimateResult:
    """What `estimate` found; byte counts are ints. ``str()`` is a readable report."""

    peak_allocated: int                  #: steady state (iterations ≥ 2), ``max_memory_allocated``
    peak_reserved: int                   #: steady state, ``max_memory_reserved``
    peak_device_used: int                #: peak_reserved + context + other processes (nvidia-smi)
    fits: bool                           #: every iteration ran without OOM on `gpu`
    gpu: int
    context: int
    other_processes: int
    phases: dict[str, dict[str, dict[str, int]]]  #: {"first"|"steady": {phase: {peak_allocated, peak_reserved}}}
    categories: dict[str, int]           #: at the steady-state allocated peak (see CATEGORIES)
    by_module: dict[str, int]            #: activations at that peak by innermost module, largest first
    peak_at: dict[str, Any]              #: {"iteration": i, "phase": name} of that peak
    forward_end: dict[str, int]          #: the breakdown at the end of the steady-state forward pass
    forward_end_by_module: dict[str, int]  #: activations then, by innermost module
    resident: int                        #: allocated after the last iteration (kept between steps)
    parameters_count: int
    settings: dict[str, Any]
    oom: dict[str, Any] | None = None    #: where the run on `gpu` ran out of memory, if it did
    trace_seconds: float = 0.0
    first_peak_allocated: int = 0
    first_peak_reserved: int = 0
    model_name: str = ""
    inputs: list[str] = field(default_factory=list)
    module_types: dict[str, str] = field(default_factory=dict)  #: module name -> class name
    #: `categories` as the tensors asked for them (before the allocator's rounding and unsplit remainders)
    categories_requested: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict of every field."""
        return {k: copy.deepcopy(v) for k, v in self.__dict__.items()}

    def __str__(self) -> str:
        from .report import render

        return render(self)


@dataclass
class _Run:
    tracker: Tracker | None
    oom: dict[str, Any] | None
    seconds: float
    resident: int = 0
    peak_allocated: int = 0  #: on the tracked GPU, over the whole run
    peak_reserved: int = 0
    #: ``torch.cuda.memory._snapshot()`` at the end of a run made with ``record`` (history from its start)
    snapshot: dict[str, Any] | None = None
    #: bytes the tracked GPU held outside the caching allocator at the end (NCCL's communicators)
    outside: int = 0


@contextmanager
def _own_gpu() -> Iterator[None]:
    """Leave `vram.simulate`'s GPUs (``vram.memory_allocated()`` …) as they were before the run."""
    saved = _memory._runtime
    try:
        yield
    finally:
        _memory._runtime = saved


def _checked_run(step: Any, amp: Any, loss: Any, grad_accum: int, iterations: int) -> Any:
    """`_run`'s arguments checked (and not inside a simulation already); autocast's dtype."""
    if active_sim() is not None:
        raise RuntimeError("vram.estimate cannot run inside simulated_cuda(): it simulates its own GPU")
    amp_dtype = _AMP.get(amp.lower()) if isinstance(amp, str) else amp
    if amp is not None and amp_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"amp must be None, 'bf16' or 'fp16', got {amp!r}")
    if step is not None and (amp is not None or loss is not None or grad_accum != 1):
        raise ValueError("amp, loss and grad_accum apply to the default step; a custom step does its own")
    if not isinstance(grad_accum, int) or grad_accum < 1 or not isinstance(iterations, int) or iterations < 1:
        raise ValueError("grad_accum and iterations must be positive ints")
    return amp_dtype


def _placed(model: Any, sim: Any, tr: Tracker, parallel: Any, checkpoint: Any, compiled: bool = False) -> nn.Module:
    """The model built, on the simulated GPU (or laid out for its rank), in training mode, its
    parameters and buffers marked, checkpointed as asked."""
    m = build_model(model, sim)
    tr.attach(m)
    early = checkpoint if parallel is not None and parallel.checkpoints_before_sharding(compiled) else None
    m = to_gpu(m, sim) if parallel is None else parallel.place(m, tr, early)
    m.train()
    for p in m.parameters():
        tr.mark(p, "parameters")
    for b in m.buffers():
        tr.mark(b, "buffers")
    if checkpoint and early is None:
        apply_checkpoint(m, checkpoint, tr, None if parallel is None else parallel.blocks(m), compiled)
    return m


def _run(model: Any, example_inputs: Any, *, step: Any, optimizer: Any, loss: Any, amp: Any,
         checkpoint: Any, grad_accum: int, iterations: int, gpu: GpuPreset, context: int, conf: str | None,
         keep: bool = True, parallel: Any = None, record: bool = False,
         compile: str | None = None) -> _Run:  # noqa: A002
    """Run the steps on a simulated GPU; OOM ends the run (recorded), other errors propagate.

    `parallel` (`vram.estimate.layout.RankPlan`, one rank of a multi-GPU layout): the simulation
    has its ``devices`` GPUs and the tracked one is its ``device``; ``enter()`` starts the process
    group, ``place(model, tracker)`` replaces ``model.to("cuda")`` (sharding, wrapping), and its
    ``step``, when set, replaces the default step (pipeline schedules). `record`: the allocation
    history from the first request, without stacks, is kept in the result's ``snapshot``.
    """
    amp_dtype = _checked_run(step, amp, loss, grad_accum, iterations)
    t0 = time.perf_counter()
    tr: Tracker | None = None
    oom = None
    devices = 1 if parallel is None else parallel.devices
    with _own_gpu(), simulated_cuda(gpu=gpu, context=context, conf=conf, device_count=devices):
        sim = active_sim()
        if record:
            _memory._record_memory_history("all", context=None)
        if parallel is not None:
            parallel.enter()
            step = parallel.step if parallel.step is not None else step
        tr = Tracker(sim, 0, False) if parallel is None else Tracker(sim, parallel.device, True)
        uninstall = tr.install(module_hooks=compile is None)
        hooks: list[Any] = []
        try:
            try:
                m = _placed(model, sim, tr, parallel, checkpoint, compile is not None)
                opt = make_optimizer(optimizer, m)
                if opt is not None:
                    def pre(o: Any, a: Any, k: Any, m: nn.Module = m) -> None:
                        tr.set_phase("optimizer")
                        tr.mark_grads(m)

                    hooks.append(opt.register_step_pre_hook(pre))
                    hooks.append(opt.register_step_post_hook(lambda o, a, k: tr.mark_optimizer(o)))
                if compile is not None:
                    m = tr.compiled(m, compile)
                    if parallel is not None:
                        parallel.run_compiled(m)
                scaler = torch.amp.GradScaler("cuda") if amp_dtype is torch.float16 else None
                inputs = None
                for it in range(1, iterations + 1):
                    tr.start_iteration(it)
                    inputs = materialize(example_inputs)  # the previous batch dies after the new one
                    if step is not None:
                        tr.auto = True
                        with torch.autograd.graph.saved_tensors_hooks(tr.pack, unpack):
                            step(m, inputs, opt)
                        tr.auto = False
                    else:
                        default_step(m, inputs, opt, tr, loss, amp_dtype, scaler, grad_accum)
                    tr.mark_grads(m)
                    if opt is not None:
                        tr.mark_optimizer(opt)
                    if scaler is not None:
                        for t in (scaler._scale, scaler._growth_tracker):
                            if t is not None:
                                tr.mark(t, "optimizer_state")
                    tr.set_phase("end")
                del inputs
            except (torch.OutOfMemoryError, NcclOutOfMemoryError) as e:   # NCCL's buffers count too
                tr.auto = False
                oom = {"iteration": tr.iteration, "phase": tr.phase if tr.iteration else "setup",
                       "message": str(e)}
            resident = tr.stat_a.current
            peak_allocated = _memory.max_memory_allocated(0 if parallel is None else parallel.device)
            peak_reserved = _memory.max_memory_reserved(0 if parallel is None else parallel.device)
            snapshot = _memory._snapshot() if record else None
            outside = _memory.get_device(0 if parallel is None else parallel.device).outside
            for h in hooks:
                h.remove()
        finally:
            uninstall()
    return _Run(tr if keep else None, oom, time.perf_counter() - t0, resident, peak_allocated, peak_reserved, snapshot,
                outside)


def _summarise(run: _Run, gpu: int, context: int, others: int) -> dict[str, Any]:
    tr = run.tracker
    assert tr is not None
    last = max((k[0] for k in tr.records), default=0)
    steady_its = range(2, last + 1) if last >= 2 else range(1, last + 1)
    phases: dict[str, dict[str, dict[str, int]]] = {"first": {}, "steady": {}}
    for label, its in (("first", range(1, 2)), ("steady", steady_its)):
        for ph in PHASES:
            recs = [tr.records[(i, ph)] for i in its if (i, ph) in tr.records]
            if recs:
                phases[label][ph] = {"peak_allocated": max(r.peak for r in recs),
                                     "peak_reserved": max(r.peak_reserved for r in recs)}
    order = {ph: k for k, ph in enumerate(("forward", "backward", "optimizer", "end"))}
    steady = sorted(((i, order[ph], ph, r) for (i, ph), r in tr.records.items() if i in steady_its),
                    key=lambda x: x[:2])
    first = [r for (i, ph), r in tr.records.items() if i == 1]
    zero = dict.fromkeys(tr.categories, 0)
    cats, mods, peak_at = dict(zero), {}, {"iteration": 0, "phase": "setup"}
    requested: dict[str, int] = {}
    if steady:
        i, _, ph, rec = max(steady, key=lambda x: x[3].peak)  # the first of equal peaks
        cats, mods = tr.breakdown(rec.event, rec.reserved_at_peak, requested)
        peak_at = {"iteration": i, "phase": ph}
    fwd_it = max((i for i in tr.forward_end if i in steady_its), default=None)
    fwd, fwd_mods = tr.breakdown(tr.forward_end[fwd_it], 0) if fwd_it is not None else (dict(zero), {})
    fwd["cache_fragmentation"] = 0
    peak_reserved = max((x[3].peak_reserved for x in steady), default=0)
    return dict(
        peak_allocated=max((x[3].peak for x in steady), default=0), peak_reserved=peak_reserved,
        peak_device_used=peak_reserved + context + others, phases=phases, categories=cats,
        categories_requested=requested,
        by_module=mods, peak_at=peak_at, forward_end=fwd, forward_end_by_module=fwd_mods,
        resident=run.resident, first_peak_allocated=max((r.peak for r in first), default=0),
        first_peak_reserved=max((r.peak_reserved for r in first), default=0),
        module_types=dict(tr.types))


# -- public API --------------------------------------------------------------------------------------
#: ``torch.compile`` modes `estimate` runs (``torch._inductor.list_mode_options``'s, "default" for None)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def check_compile(compile: str | None, parallel: Any) -> None:  # noqa: A002
    """`compile` is a mode, and with a multi-GPU layout one `Layout.check_compile` models."""
    if compile is None:
        return
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile={compile!r}: not a torch.compile mode ({', '.join(COMPILE_MODES)})")
    if parallel is not None:
        layout = getattr(parallel, "layout", None)
        if layout is None:
            raise ValueError("compile with a multi-GPU layout: parallel must be a vram.estimate.layout.RankPlan")
        layout.check_compile(compile)


def estimate(model: Any, example_inputs: Any, *, step: Callable[[nn.Module, Any, Any], None] | None = None,
             optimizer: Any = "adam", loss: Callable[[Any], torch.Tensor] | None = None,
             amp: str | None = None, checkpoint: Any = False, grad_accum: int = 1, iterations: int = 3,
             gpu: int | str = "80GiB", context: int | str = CUDA_CONTEXT, conf: str | None = None,
             arch: str | None = None, parallel: Any = None, compile: str | None = None) -> EstimateResult:  # noqa: A002
    """Predict the GPU memory of a training step by running `iterations` steps on a simulated GPU.

    `model`: an ``nn.Module`` (CPU or meta; never modified) or a zero-argument factory returning one.
    `example_inputs`: a tensor, ``torch.Size``, or a tuple/list (``model(*inputs)``) or dict
    (``model(**inputs)``) of them; only shapes and dtypes are used. `step(model, inputs,
    optimizer)` replaces the default step — forward; loss = the `"loss"` the model returns in a mapping
    (Hugging Face with labels), else the sum of the outputs' sums, or
    ``loss(out)``; backward; ``optimizer.step()``; ``optimizer.zero_grad(set_to_none=True)`` — whose
    forward and loss run under ``torch.autocast("cuda", dtype)`` for `amp` "bf16"/"fp16" (fp16 adds
    a ``GradScaler``), and which runs `grad_accum` forward/backward micro-steps (loss / grad_accum)
    per optimizer step. `optimizer`: "adam", "adamw" (lr 1e-3), "sgd" (lr 1e-2, no momentum: no
    state), a callable ``params -> Optimizer``, or None (forward/backward only; grads set to None
    after each step). `checkpoint`: True applies ``torch.utils.checkpoint`` (non-reentrant) to each
    element of the model's outermost ``nn.ModuleList``s, or, when it has none, to each direct child;
    a module class (or tuple of classes) checkpoints every instance instead. `gpu`, `context`
    (the CUDA context nvidia-smi adds, by default `vram.devices.gpus.CUDA_CONTEXT` as measured on an
    H200, like ``vram estimate``; 0 leaves it out), `conf` (``PYTORCH_CUDA_ALLOC_CONF``; None: the
    environment's) and `arch` (compute capability, e.g. "8.0": cuBLAS's workspace size) describe
    the GPU; `gpu` is a size ("24GiB") or a card ("A100-80GB", see `vram.devices.gpus`).
    `parallel`: one rank of a multi-GPU layout (`vram.estimate.layout.RankPlan`; see `_run`).
    `compile`: a ``torch.compile`` mode ("default", "reduce-overhead", "max-autotune",
    "max-autotune-no-cudagraphs"): the model runs compiled (``torch.compile(model, mode=)``, as
    ``vram run`` compiles, docs/estimate-accuracy.md §8), `checkpoint` too (each block's forward
    ``functools.partial(checkpoint, forward, use_reentrant=False)``: Dynamo traces it as the
    user's ``checkpoint(block, x)``); activations are what the compiled graphs save for backward,
    each attributed to the innermost module of the graph node that made it, else to "(compiled
    model)": the per-module hooks would break Dynamo's graph at every module, so they are off.

    If the steps run out of memory on `gpu`, ``fits`` is False, ``oom`` says where, and every
    figure comes from the same steps repeated on an unbounded GPU: what the step would need.
    """
    check_compile(compile, parallel)
    spec, ctx_b = resolve_gpu(gpu, arch), parse_size(context, "context")
    gpu_b = spec.total_memory
    kw = dict(step=step, optimizer=optimizer, loss=loss, amp=amp, checkpoint=checkpoint,
              grad_accum=grad_accum, iterations=iterations, conf=conf, parallel=parallel, compile=compile)
    run = _run(model, example_inputs, gpu=spec, context=ctx_b, **kw)  # type: ignore[arg-type]
    seconds = run.seconds
    oom = run.oom
    if oom is not None:
        unbounded = replace(spec, total_memory=_UNBOUNDED)
        run = _run(model, example_inputs, gpu=unbounded, context=ctx_b, **kw)  # type: ignore[arg-type]
        seconds += run.seconds
        if run.oom is not None:
            raise RuntimeError(f"the step needs more than {_UNBOUNDED >> 40} TiB of GPU memory")
    tr = run.tracker
    assert tr is not None
    others = 0
    fields = _summarise(run, gpu_b, ctx_b, others)
    root = tr.root
    assert root is not None
    n_params = sum(p.numel() for p in {id(p): p for p in root.parameters()}.values())
    opt_name = optimizer if isinstance(optimizer, str) or optimizer is None else getattr(
        optimizer, "__name__", type(optimizer).__name__)
    settings = {"optimizer": opt_name, "amp": amp if amp is None or isinstance(amp, str) else str(amp),
                "checkpoint": bool(checkpoint), "grad_accum": grad_accum, "iterations": iterations,
                "conf": conf, "custom_step": step is not None, "custom_loss": loss is not None,
                "gpu_name": spec.name, "arch": f"{spec.major}.{spec.minor}", "compile": compile}
    return EstimateResult(fits=oom is None, gpu=gpu_b, context=ctx_b, other_processes=others,
                          parameters_count=n_params, settings=settings, oom=oom,
                          trace_seconds=seconds, model_name=tr.types.get("(model)", type(root).__name__),
                          inputs=describe_inputs(example_inputs), **fields)


def fits(model: Any, example_inputs: Any, *, gpu: int | str = "80GiB", context: int | str = CUDA_CONTEXT,
         arch: str | None = None, **kwargs: Any) -> bool:
    """Whether `estimate`'s steps run on `gpu` without OOM (one simulated run, no report)."""
    return probe(model, example_inputs, gpu=gpu, context=context, arch=arch, **kwargs).fits


def probe(model: Any, example_inputs: Any, *, gpu: int | str, context: int | str, arch: str | None,
           **kwargs: Any) -> Probe:
    """`fits`, with the room a fitting run left: the card's memory less the smallest card on which
    the run's recorded requests replay without an OOM (`smallest_card`; `vram.estimate.search.Probe`).
    Not the card less peak allocated or reserved memory: fragmentation and the cache make the first
    optimistic, and reserved memory stops growing once the allocator frees its cache and retries
    near the card's size."""
    kw = dict(step=None, optimizer="adam", loss=None, amp=None, checkpoint=False, grad_accum=1,
              iterations=3, conf=None, parallel=None, compile=None)
    unknown = set(kwargs) - set(kw)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")
    kw.update(kwargs)
    check_compile(kw["compile"], kw["parallel"])
    card, ctx = resolve_gpu(gpu, arch), parse_size(context, "context")
    run = _run(model, example_inputs, gpu=card, context=ctx, keep=False, record=True, **kw)  # type: ignore[arg-type]
    if run.oom is not None:
        return Probe(False)
    assert run.snapshot is not None
    # every cudaMalloc of the run succeeds on a card of the context + its peak reserved: the same run
    # (what NCCL holds outside the allocator stays beside the context on the smaller cards)
    ctx += run.outside
    need = smallest_card(run.snapshot, ctx, ctx + run.peak_allocated, min(ctx + run.peak_reserved, card.total_memory))
    return Probe(True, None if need is None else card.total_memory - need, run.peak_allocated)


def smallest_card(snapshot: dict[str, Any], context: int, low: int, high: int) -> int | None:
    """The smallest GPU (bytes, to 2 MiB) in [`low`, `high`] on which the run recorded in `snapshot`
    (its whole allocation history) replays without an OOM, found by bisection: the same requests
    on a smaller card, with the allocator's frees of cached blocks and retries near its size
    (`vram.replay`). None when it does not replay within `high`. Exact for a program whose requests
    do not depend on the card's free memory; only a guide for `max_batch`, whose answers are runs."""
    from vram.replay.engine import replay, smallest_budget

    return smallest_budget(lambda gpu: replay(snapshot, gpu=gpu, context=context).ooms == 0, low - 1, high)


def max_batch(model: Any, make_inputs: Callable[[int], Any], *, gpu: int | str = "80GiB",
              context: int | str = CUDA_CONTEXT, arch: str | None = None, limit: int = 1 << 20,
              progress: Any = None, **kwargs: Any) -> int:
    """The largest batch size b for which ``make_inputs(b)`` trains `iterations` steps without OOM.

    Real simulated runs (`fits`), no extrapolation: the answer fits and the batch after it does
    not. Which batches are run is guided by the room each fitting run left (`search_largest`):
    typically 4–6 runs of `iterations` steps (a failing run stops at its OOM), never more than
    `vram.estimate.search.GUESSES` beyond doubling and bisection's ~2·log2(b). Returns 0 when batch
    1 does not fit, `limit` when it fits.
    `kwargs` are `estimate`'s (optimizer, amp, checkpoint, …). Fitting is assumed monotonic in the
    batch size, which allocator rounding can break by a few samples near the boundary. `progress`:
    see `search_largest`.
    """
    return search_largest(lambda b: probe(model, make_inputs(b), gpu=gpu, context=context, arch=arch, **kwargs),
                          limit, progress)
