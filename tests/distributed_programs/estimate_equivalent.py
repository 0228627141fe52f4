"""The training loop `vram estimate --ddp/--fsdp/--tp/--pp` runs, written by hand: the model of
``tiny_stack.stack`` under DDP, FSDP2 (each block, then the root), HSDP (``--hsdp R``: FSDP2 over
a 2-D (replicate, shard) mesh), tensor parallel (``tp``: ``tiny_stack.tp_plan``'s Colwise/Rowwise
``parallelize_module`` of each block; with ``--sp``, ``tiny_stack.sp_plan``'s sequence parallel
over ``norm_stack``), FSDP2 over TP (``fsdp_tp``: a (dp_shard, tp) mesh, the TP
plan, then ``fully_shard`` over dp_shard) or pipeline parallel (``pp``: ``pipeline()`` split at the
blocks, one stage per rank, ``--schedule`` 1F1B or GPipe over ``--microbatches``); Adam, three
steps of a fresh ``--batch`` x 256 batch each; prints the peak allocated and reserved over
iterations 2-3 (the estimate's steady state).

Under ``vram run --nproc-per-node`` it reads ``torch.cuda.max_memory_allocated``/``reserved`` after
resetting the peaks before iteration 2. With ``--tracker`` it is rank 0 on the CPU with PyTorch's
fake process group and prints the peak "Total" of ``FSDPMemTracker`` (FSDP, HSDP, FSDP over TP)
or ``MemTracker`` (DDP, TP) over iterations 2-3, storages rounded to 512 bytes as the trackers
round CUDA ones."""
import argparse
import os

import torch
import torch.distributed as dist
from tiny_stack import norm_stack, sp_plan, stack, tp_plan
from torch.distributed.device_mesh import init_device_mesh

p = argparse.ArgumentParser()
p.add_argument("mode", choices=["ddp", "fsdp", "hsdp", "tp", "fsdp_tp", "pp"])
p.add_argument("--world", type=int, default=2)
p.add_argument("--replicate", type=int, default=2, help="HSDP: replicas (the shard degree is world / this)")
p.add_argument("--tp", type=int, default=2, help="fsdp_tp: the TP degree (the shard degree is world / this)")
p.add_argument("--batch", type=int, default=64)
p.add_argument("--seq", type=int, default=None, help="inputs batch x seq x 256 instead of batch x 256")
p.add_argument("--sp", action="store_true", help="tp: tiny_stack.norm_stack under sp_plan (sequence parallel)")
p.add_argument("--schedule", choices=["1F1B", "GPipe"], default="1F1B")
p.add_argument("--microbatches", type=int, default=None, help="pp: default one per stage")
p.add_argument("--checkpoint", action="store_true",
               help="checkpoint_wrapper (non-reentrant) around each block: after the TP plan, before DDP or "
                    "fully_shard (torchtitan's order); a pipeline stage's blocks after build_stage")
p.add_argument("--compile", nargs="?", const="outer", choices=["outer", "inner"], default=None,
               help="torch.compile the wrapped model (ddp: torch.compile(DistributedDataParallel(model)); pp:"
                    " the stage's module, which the schedule's stage then calls); ddp 'inner':"
                    " DistributedDataParallel(torch.compile(model)), nanoGPT's train.py order")
p.add_argument("--history", default=None,
               help="record the allocation history from the start and dump it here (.rankR added per rank)")
p.add_argument("--tracker", action="store_true")
a = p.parse_args()
if a.history:
    torch.cuda.memory._record_memory_history("all", context=None)


def wrap_blocks(blocks):
    """Activation checkpointing of each block of `blocks` (a ModuleList, or a pipeline stage's
    container of blocks), as users write it."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    for name, block in list(blocks.named_children()):
        setattr(blocks, name, checkpoint_wrapper(block))

if a.tracker:
    from torch.distributed._tools import mem_tracker
    from torch.testing._internal.distributed import fake_pg  # noqa: F401  registers backend "fake"

    def rounded(self):
        return -(-self.size * self.element_size // 512) * 512
    mem_tracker._WeakRefInfo._calculate_mem_consumed = rounded
    dist.init_process_group("fake", rank=0, world_size=a.world)
    dev = torch.device("cpu")
else:
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl")
rank = dist.get_rank()
micro = a.microbatches or a.world

if a.mode == "ddp":
    model = stack().to(dev)
    if a.checkpoint:
        wrap_blocks(model.blocks)
    if a.compile == "inner":
        model = torch.compile(model)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=None if a.tracker else [dev.index])
    if a.compile == "outer":
        model = torch.compile(model)
elif a.mode == "pp":
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline
    with torch.device("meta"):
        whole = stack()
    n = len(whole.blocks)
    per = -(-n // a.world)
    pipe = pipeline(whole, mb_args=(torch.empty(a.batch // micro, 256, device="meta"),),
                    split_spec={f"blocks.{i * per}": SplitPoint.BEGINNING for i in range(1, a.world)})
    stage = pipe.build_stage(rank, dev)
    model = stage.submod.to_empty(device=dev)
    if a.checkpoint:
        wrap_blocks(model.blocks)
    if a.compile:
        stage.submod = torch.compile(model)   # the stage runs its module compiled
    schedule = (Schedule1F1B if a.schedule == "1F1B" else ScheduleGPipe)(
        stage, n_microbatches=micro, loss_fn=lambda y, target: y.sum())
else:
    with torch.device("meta"):
        model = norm_stack() if a.sp else stack()
    if a.mode in ("hsdp", "fsdp_tp"):
        inner = a.world // a.replicate if a.mode == "hsdp" else a.tp
        names = ("dp_replicate", "dp_shard") if a.mode == "hsdp" else ("dp_shard", "tp")
        mesh = init_device_mesh(dev.type, (a.world // inner, inner), mesh_dim_names=names)
    else:
        mesh = init_device_mesh(dev.type, (a.world,), mesh_dim_names=("tp" if a.mode == "tp" else "dp_shard",))
    if a.mode in ("tp", "fsdp_tp"):
        (sp_plan if a.sp else tp_plan)(model, mesh["tp"])
    if a.checkpoint:
        wrap_blocks(model.blocks)
    if a.mode != "tp":
        from torch.distributed.fsdp import fully_shard
        dp = mesh if a.mode == "hsdp" else mesh["dp_shard"]
        for block in model.blocks:
            fully_shard(block, mesh=dp)
        fully_shard(model, mesh=dp)
    model.to_empty(device=dev)
    if a.compile:
        model = torch.compile(model)
# Adam's default on CUDA is its foreach implementation (torch/optim/optimizer.py
# _default_to_fused_or_foreach: every parameter a Tensor, Parameter or DTensor on a foreach device);
# on the CPU it is the per-tensor loop, whose temporaries differ, so the tracker run asks for foreach
opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True if a.tracker else None)


def pp_forward_backward(x):
    """The schedule's step; the last stage's target and losses die with this call, after the
    merged output the step returns (torchtitan's ``pp_forward_backward_step``: its labels outlive
    the step call)."""
    if rank == 0:
        schedule.step(x)
    elif rank == a.world - 1:
        target, losses = torch.zeros(a.batch, dtype=torch.int64, device=dev), []
        schedule.step(target=target, losses=losses)
    else:
        schedule.step()


def step():
    global x
    x = torch.empty(a.batch, *([a.seq] if a.seq else []), 256, device=dev)
    if a.mode == "pp":
        pp_forward_backward(x)
    else:
        out = model(x)
        loss = out.sum()
        del out
        loss.backward()
        del loss
    opt.step()
    opt.zero_grad(set_to_none=True)


step()
if a.tracker:
    if a.mode in ("ddp", "tp"):
        from torch.distributed._tools.mem_tracker import MemTracker
        tracker = MemTracker()
        tracker.track_external(model, opt)
    else:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
        tracker = FSDPMemTracker(model, opt)
    with tracker:
        step()
        if a.mode in ("ddp", "tp"):
            tracker.reset_mod_stats()   # MemTracker refuses a module's second forward otherwise; peaks stay
        step()
    print("peak", tracker.get_tracker_snapshot("peak")[dev]["Total"])
    if os.environ.get("SHOW"):
        print(tracker.get_tracker_snapshot("peak")[dev])
else:
    torch.cuda.reset_peak_memory_stats()
    step()
    step()
    print("peak", torch.cuda.max_memory_allocated())
    print("reserved", torch.cuda.max_memory_reserved())
    if a.history:
        torch.cuda.memory._dump_snapshot(a.history)
dist.destroy_process_group()
