"""Multi-GPU layouts for ``vram estimate --ddp/--fsdp/--tp/--pp`` (layer 4; needs torch).

A `Layout` is the degrees of a device mesh with torchtitan's dimension order
(``torchtitan/distributed/parallel_dims.py``): ``pp`` × ``dp_replicate`` (``--ddp``) ×
``dp_shard`` (``--fsdp``) × ``tp``; the product is the world size, rank r has the row-major
coordinates of r. `RankPlan` applies it to one rank's model inside that rank's simulation, in
torchtitan's order (``parallelize_llama``): pipeline split, tensor parallel, then data parallel:

* ``--pp N``: the model's one top-level ``nn.ModuleList`` (found as ``--checkpoint`` finds it) is
  split into N contiguous stages of ``ceil(L/N)`` blocks by ``torch.distributed.pipelining.
  pipeline()`` (split points at ``SplitPoint.BEGINNING`` of blocks), each rank building its
  ``build_stage``; the step is ``Schedule1F1B`` (or ``ScheduleGPipe``) over ``--microbatches``
  (default N) micro-batches, the loss the sum of the last stage's outputs (its target, one
  int64 label per sample, is allocated on the last stage). A model without such a list is refused.
* ``--tp N``: a user's model cannot be tensor-parallelized automatically, so a plan is required:
  ``--tp-plan MODULE:FUNC``, ``FUNC(model, tp_mesh)`` calling ``parallelize_module``; never guessed.
* ``--fsdp N``: FSDP2 ``fully_shard`` on each block (the elements of the outermost ModuleLists,
  else each direct child: the blocks ``--checkpoint`` wraps), then on the root, over the
  ``dp_shard`` mesh; with ``--ddp M`` too, over the 2-D ``(dp_replicate, dp_shard)`` mesh: HSDP.
  The model is built on meta, sharded, then ``to_empty(device="cuda")``: only shards are allocated.
* ``--ddp N`` alone: ``DistributedDataParallel`` (PyTorch's Reducer) over ``dp_replicate``;
  ``nn.parallel.DistributedDataParallel`` takes no DTensor parameters, so ``--ddp`` with ``--tp``
  needs ``--fsdp`` (HSDP) and is otherwise refused.

Ranks whose programs allocate the same are simulated once (`Layout.representatives`): replicas
(``dp_replicate``) always; ``dp_shard`` ranks when ``torch.chunk`` gives every parameter the same
dim-0 shard on each (FSDP2's ``_init_sharded_param``; uneven shards give the last ranks smaller
optimizer states) and there is no tensor parallel plan (whose shapes are unknown beforehand).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn

from vram.run.runtime import active_sim

from .model import load_factory, sum_outputs, to_gpu
from .trace import Tracker, checkpoint_targets, wrap_checkpointed

__all__ = ["Layout", "RankPlan", "DIMS"]

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")   # torchtitan's mesh order
_FLAG = {"pp": "--pp", "dp_replicate": "--ddp", "dp_shard": "--fsdp", "tp": "--tp"}
SCHEDULES = ("1F1B", "GPipe")


@dataclass(frozen=True)
class Layout:
    """Degrees of each mesh dimension (1: not split), the TP plan and the pipeline schedule."""

    ddp: int = 1
    fsdp: int = 1
    tp: int = 1
    pp: int = 1
    tp_plan: str | None = None
    microbatches: int | None = None
    schedule: str = "1F1B"

    @property
    def sizes(self) -> dict[str, int]:
        return {"pp": self.pp, "dp_replicate": self.ddp, "dp_shard": self.fsdp, "tp": self.tp}

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def mesh_dims(self) -> list[tuple[str, int]]:
        return [(d, n) for d, n in self.sizes.items() if n > 1]

    def describe(self) -> str:
        dims = " x ".join(f"{_FLAG[d][2:]} {n}" for d, n in self.mesh_dims)
        extra = " (HSDP)" if self.ddp > 1 and self.fsdp > 1 else ""
        if self.pp > 1:
            extra += f"; schedule {self.schedule}, {self.n_microbatches} micro-batches"
        return f"{dims}{extra} = {self.world_size} GPUs"

    @property
    def n_microbatches(self) -> int:
        return self.microbatches if self.microbatches is not None else self.pp

    def check(self) -> None:
        """One-line errors for layouts that cannot be built."""
        for d, n in self.sizes.items():
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"{_FLAG[d]} must be a positive number of GPUs, got {n!r}")
        if self.tp > 1 and not self.tp_plan:
            raise ValueError("--tp needs --tp-plan MODULE:FUNC, a function (model, tp_mesh) that calls "
                             "parallelize_module: a model cannot be tensor-parallelized without knowing its layers")
        if self.tp_plan and self.tp == 1:
            raise ValueError("--tp-plan is given without --tp N (N >= 2)")
        if self.tp > 1 and self.ddp > 1 and self.fsdp == 1:
            raise ValueError("--ddp with --tp: DistributedDataParallel takes no DTensor parameters; "
                             "use --fsdp (with --ddp: HSDP) for data parallel over a TP model")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown --schedule {self.schedule!r}: expected {' or '.join(SCHEDULES)}")
        if self.microbatches is not None and (self.pp == 1 or self.microbatches < 1):
            raise ValueError("--microbatches needs --pp N (N >= 2) and must be positive")
        if self.world_size < 2:
            raise ValueError("a multi-GPU layout needs at least 2 GPUs (without --ddp/--fsdp/--tp/--pp, "
                             "vram estimate models one GPU)")

    def check_compile(self, mode: str | None) -> None:
        """One-line errors for the layouts ``--compile`` does not model. Modelled, each graph
        compiled as ``vram run`` compiles it: ``--ddp`` (``torch.compile(DistributedDataParallel(
        model))``: Dynamo's DDPOptimizer splits the graph at the buckets,
        ``torch/_dynamo/backends/distributed.py``) and ``--fsdp``, with ``--ddp`` too (HSDP)
        (``torch.compile`` of the ``fully_shard`` model: FSDP2's hooks are ``_dynamo_disable``d,
        so the graphs between them take the unsharded, plain parameters), and ``--pp`` (each
        rank's stage module compiled, which its stage then calls: `run_compiled`); ``--checkpoint``
        with each (with ``--fsdp``, ``checkpoint_wrapper`` before ``fully_shard``:
        `checkpoints_before_sharding`). Refused: tensor parallel, whose compiled graphs take
        DTensors (and the device mesh), which ``vram run`` runs eagerly (a tensor subclass)."""
        if mode is None:
            return
        if self.tp > 1:
            raise ValueError("--compile with --tp is not modelled: tensor parallel's compiled graphs take DTensors, "
                             "which vram run runs eagerly (--ddp, --fsdp and --pp are modelled compiled)")

    def coords(self, rank: int) -> dict[str, int]:
        """Row-major coordinates of `rank` on the mesh (as ``init_device_mesh`` lays ranks out)."""
        out: dict[str, int] = {}
        for d in reversed(DIMS):
            n = self.sizes[d]
            out[d], rank = rank % n, rank // n
        return {d: out[d] for d in DIMS}

    def representatives(self, model: nn.Module) -> dict[int, list[int]]:
        """Simulated rank -> the ranks it stands for (see the module doc)."""
        shapes = [tuple(p.shape) for p in {id(p): p for p in model.parameters()}.values()]
        shard_of: dict[int, tuple[Any, ...]] = {}
        if self.fsdp > 1 and self.tp == 1:
            for i in range(self.fsdp):
                shard_of[i] = tuple(_chunk_dim0(s, self.fsdp, i) for s in shapes)
        groups: dict[tuple[Any, ...], list[int]] = {}
        for r in range(self.world_size):
            c = self.coords(r)
            shard = shard_of.get(c["dp_shard"], c["dp_shard"]) if self.fsdp > 1 else 0
            groups.setdefault((c["pp"], c["tp"], shard), []).append(r)
        return {ranks[0]: ranks for ranks in groups.values()}

    def to_json(self) -> dict[str, Any]:
        return dict(asdict(self), world_size=self.world_size, mesh=dict(self.mesh_dims))


def _chunk_dim0(shape: tuple[int, ...], n: int, i: int) -> tuple[int, ...]:
    """Rank i's dim-0 shard of `shape` as FSDP2 takes it: ``torch.chunk(param, n, dim=0)[i]``."""
    if not shape:
        return shape
    chunks = torch.chunk(torch.empty(shape, device="meta"), n, dim=0)
    return tuple(chunks[i].shape) if i < len(chunks) else (0, *shape[1:])


def pipeline_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the blocks of the model's one top-level ModuleList, for the PP split."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)
             and not any(n.startswith(o + ".") for o, _ in model.named_modules() if o and o != n
                         and isinstance(_, nn.ModuleList))]
    if len(lists) != 1 or not len(lists[0][1]):
        raise ValueError("--pp splits the model's top-level nn.ModuleList into stages, and "
                         f"{type(model).__name__} has {len(lists)} non-empty ones; it cannot be split")
    name, blocks = lists[0]
    return [f"{name}.{i}" for i in range(len(blocks))]


class RankPlan:
    """One rank of a `Layout`, applied inside its simulation (see `vram.estimate.engine._run`)."""

    def __init__(self, layout: Layout, rank: int, example_inputs: Any = None) -> None:
        self.layout, self.rank = layout, rank
        self.devices = layout.world_size   # one node: every rank sees every GPU, owns cuda:RANK
        self.device = rank
        self.example_inputs = example_inputs
        self.mesh: Any = None
        self.step: Callable[[nn.Module, Any, Any], None] | None = None
        self.schedule: Any = None
        self._pp_blocks: list[str] = []

    def enter(self) -> None:
        """``set_device``, ``init_process_group("nccl")`` (torchrun's env://), the device mesh."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        torch.cuda.set_device(self.device)
        dist.init_process_group("nccl")
        dims = self.layout.mesh_dims
        self.mesh = init_device_mesh("cuda", tuple(n for _, n in dims), mesh_dim_names=tuple(d for d, _ in dims))
        if self.layout.pp > 1:
            self.step = self._pipeline_step

    def place(self, m: nn.Module, tr: Tracker, checkpoint: Any = None) -> nn.Module:
        """Split, parallelize and shard `m` (on meta, or as the factory built it) onto this GPU;
        `checkpoint` (a ``checkpoint=`` policy): its modules are wrapped by ``checkpoint_wrapper``
        before ``fully_shard`` (`checkpoints_before_sharding`)."""
        lay = self.layout
        if lay.pp > 1:
            m = self._stage(m)
        if lay.tp > 1:
            assert lay.tp_plan is not None
            plan = load_factory(lay.tp_plan, "--tp-plan")
            plan(m, self.mesh["tp"])
        if lay.fsdp > 1:
            from torch.distributed.fsdp import fully_shard

            dp = self.mesh["dp_replicate", "dp_shard"] if lay.ddp > 1 else self.mesh["dp_shard"]
            if checkpoint:
                wrap_checkpointed(m, checkpoint)
            for block in checkpoint_targets(m, True):
                fully_shard(block, mesh=dp)
            fully_shard(m, mesh=dp)
            self._tag_fsdp_buffers(tr)
        if any(p.device.type == "meta" for p in (*m.parameters(), *m.buffers())):
            # a model built on meta: its shards made empty (FSDP, TP), or moved as `to_gpu` moves one
            m = m.to_empty(device="cuda") if lay.fsdp > 1 or lay.tp > 1 else to_gpu(m, active_sim())
        else:
            m = m.to("cuda")
        if lay.ddp > 1 and lay.fsdp == 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            with tr.allocating_as("ddp_buckets"):
                ddp = DDP(m, device_ids=[self.device], process_group=self.mesh["dp_replicate"].get_group())
            pre = ddp._pre_forward

            def pre_forward(*a: Any, **k: Any) -> Any:   # rebuilds the buckets after the first step
                with tr.allocating_as("ddp_buckets"):
                    return pre(*a, **k)
            ddp._pre_forward = pre_forward  # type: ignore[method-assign]
            m = ddp
        return m

    def checkpoints_before_sharding(self, compiled: bool) -> bool:
        """Compiled FSDP2 blocks are checkpointed by ``checkpoint_wrapper`` before ``fully_shard``
        (torchtitan's order, `wrap_checkpointed`), not by estimate's forward after it: the
        graph breaks at each block's FSDP2 hooks and the block's own frame is compiled."""
        return compiled and self.layout.fsdp > 1

    def _tag_fsdp_buffers(self, tr: Tracker) -> None:
        """FSDP2's collectives, as `_fsdp_param_group` calls them, allocate as their category."""
        import torch.distributed.fsdp._fully_shard._fsdp_param_group as group

        def tagged(fn: Any, category: str) -> Any:
            def run(*a: Any, **k: Any) -> Any:
                if fn.__name__ == "foreach_reduce":
                    for g in a[1]:   # the unsharded gradients being reduced
                        tr.mark(g, "gradients")
                with tr.allocating_as(category):
                    return fn(*a, **k)
            run.__name__ = fn.__name__
            return run

        for name, cat in (("foreach_all_gather", "all_gather_buffers"),
                          ("foreach_all_gather_copy_out", "all_gather_buffers"),
                          ("foreach_reduce", "reduce_scatter_buffers")):
            fn = getattr(group, name)
            setattr(group, name, tagged(getattr(fn, "__wrapped_fsdp__", fn), cat))
            getattr(group, name).__wrapped_fsdp__ = getattr(fn, "__wrapped_fsdp__", fn)

    # pipeline parallel
    def _stage(self, m: nn.Module) -> nn.Module:
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline

        from .model import micro_inputs

        lay = self.layout
        blocks = pipeline_blocks(m)
        if len(blocks) < lay.pp:
            raise ValueError(f"--pp {lay.pp}: the model has only {len(blocks)} blocks to split")
        per = -(-len(blocks) // lay.pp)
        split = {blocks[i * per]: SplitPoint.BEGINNING for i in range(1, lay.pp) if i * per < len(blocks)}
        if len(split) != lay.pp - 1:
            raise ValueError(f"--pp {lay.pp}: {len(blocks)} blocks in stages of {per} leave a stage empty")
        self._pp_blocks = blocks
        mb = micro_inputs(self.example_inputs, lay.n_microbatches)
        pipe = pipeline(m, mb_args=mb if isinstance(mb, tuple) else (mb,), split_spec=split)
        stage_index = self.layout.coords(self.rank)["pp"]
        self._pp_stage = pipe.build_stage(stage_index, torch.device("cuda", self.device))
        cls = Schedule1F1B if lay.schedule == "1F1B" else ScheduleGPipe
        self.schedule = cls(self._pp_stage, n_microbatches=lay.n_microbatches,
                            loss_fn=lambda y, target: sum_outputs(y))
        self._pp_index = stage_index
        return self._pp_stage.submod

    def run_compiled(self, compiled: nn.Module) -> None:
        """A pipeline stage calls the compiled module in its schedule's forwards
        (``stage.submod = torch.compile(stage.submod)``); other layouts call it from the step."""
        if self.layout.pp > 1:
            self._pp_stage.submod = compiled

    def blocks(self, m: nn.Module) -> list[nn.Module] | None:
        """A pipeline stage's blocks (its share of the split ModuleList, which torch.export turned
        into an ``InterpreterModule``: ``--checkpoint`` wraps each, as on one GPU); None otherwise."""
        if not self._pp_blocks:
            return None
        names = {n for n, _ in m.named_modules()}
        return [m.get_submodule(n) for n in self._pp_blocks if n in names]

    def _pipeline_step(self, m: nn.Module, inputs: Any, opt: Any) -> None:
        """One schedule step (forward and backward of every micro-batch), optimizer, zero_grad.

        The last stage's target and micro-batch losses die before the optimizer step, as the
        default step deletes its loss and as torchtitan's ``pp_forward_backward_step`` returns
        (``trainer.py``: only the losses' sum outlives it)."""
        first, last = self._pp_index == 0, self._pp_index == self.layout.pp - 1
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        kw: dict[str, Any] = {}
        if last:
            kw = {"target": torch.zeros(_batch_of(inputs), dtype=torch.int64, device="cuda"), "losses": []}
        self.schedule.step(*(args if first else ()), **kw)
        del kw
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            m.zero_grad(set_to_none=True)


def _batch_of(inputs: Any) -> int:
    t = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
    return int(t.shape[0])

