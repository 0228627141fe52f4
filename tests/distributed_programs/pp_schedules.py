"""Pipeline parallel, one stage per rank (``torch.distributed.pipelining``): the same model
stepped under ``ScheduleGPipe`` and then ``Schedule1F1B``. The stages infer their shapes at the
first step (``PipelineStage`` without ``input_args``: metadata sent between ranks), or with
``--tracer`` are split from the whole model by ``pipeline()`` and ``build_stage``. Prints, per
schedule, this stage's peak allocated bytes over the bytes allocated before the step."""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline

D, H, BATCH, MICRO = 256, 4096, 64, 4
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
torch.cuda.set_device(device)
dist.init_process_group("nccl")
warm = nn.Linear(8, 8, device=device)    # cuBLAS's workspaces, once per stream: outside the figures
warm(torch.randn(2, 8, device=device)).sum().backward()
del warm


def block():
    return nn.Sequential(nn.Linear(D, H, bias=False), nn.ReLU(), nn.Linear(H, D, bias=False))


def step(schedule_cls):
    torch.manual_seed(0)
    if "--tracer" in sys.argv:   # the whole model on every rank, split by the tracer at each block
        whole = nn.Sequential(*(block() for _ in range(world)))
        pipe = pipeline(whole, mb_args=(torch.empty(BATCH // MICRO, D),),
                        split_spec={str(i): SplitPoint.BEGINNING for i in range(1, world)})
        stage = pipe.build_stage(rank, device)
    else:
        stage = PipelineStage(block().to(device), rank, world, device)   # shapes: metadata inference, sent
    schedule = schedule_cls(stage, n_microbatches=MICRO, loss_fn=lambda y, t: ((y - t) ** 2).mean())
    x = torch.randn(BATCH, D, device=device)
    target = torch.randn(BATCH, D, device=device)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    if rank == 0:
        schedule.step(x)
    elif rank == world - 1:
        schedule.step(target=target, losses=[])
    else:
        schedule.step()
    print(schedule_cls.__name__, "peak", torch.cuda.max_memory_allocated() - before, flush=True)


step(ScheduleGPipe)
step(Schedule1F1B)
dist.destroy_process_group()
