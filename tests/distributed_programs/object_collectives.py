"""Collectives whose values the program reads, on every launched rank: each prints what it got,
``name: value``, for the object collectives on four groups (the default ``cpu:gloo,cuda:nccl``
group, whose Gloo half serves objects; an NCCL group, which moves them in CUDA tensors; a Gloo
group; an NCCL group of ranks 1 and 2) and for tensor collectives on the default group."""
import torch
import torch.distributed as dist

dist.init_process_group("cpu:gloo,cuda:nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(rank)
groups = {"default": None, "nccl": dist.new_group(backend="nccl"), "gloo": dist.new_group(backend="gloo"),
          "pair": dist.new_group([1, 2], backend="nccl")}
for name, group in groups.items():
    members = [1, 2] if name == "pair" else list(range(world))
    if rank not in members:
        continue
    root, last = members[0], members[-1]
    objs = [{"lr": 0.1, "from": rank}, "x" * (rank + 1)] if rank == root else [None, None]
    dist.broadcast_object_list(objs, src=root, group=group)
    print(f"{name} broadcast_object_list: {objs}")
    out = [None] * len(members)
    dist.all_gather_object(out, {"rank": rank, "name": "r" * (rank + 2)}, group=group)
    print(f"{name} all_gather_object: {out}")
    gathered = [None] * len(members) if rank == last else None
    dist.gather_object(("obj", rank, list(range(rank + 1))), gathered, dst=last, group=group)
    print(f"{name} gather_object: {gathered}")
    got = [None]
    dist.scatter_object_list(got, [f"for {r}" * (r + 1) for r in members] if rank == root else None,
                             src=root, group=group)
    print(f"{name} scatter_object_list: {got}")
    if rank in members[:2]:
        msg = [{"step": 7, "who": rank}] if rank == root else [None]
        (dist.send_object_list if rank == root else dist.recv_object_list)(msg, members[1 - members.index(rank)],
                                                                          group=group)
        print(f"{name} send_object_list: {msg}")

t = torch.tensor([rank + 1, 10 * (rank + 1)], device="cuda")
dist.all_reduce(t)
m = torch.tensor([float(rank)], device="cuda")
dist.all_reduce(m, op=dist.ReduceOp.MAX)
print(f"all_reduce: {t.tolist()} {m.item()}")
counts = torch.arange(world, device="cuda") + rank * world    # an all-to-all of per-rank counts (MoE)
recv = torch.empty_like(counts)
dist.all_to_all_single(recv, counts)
print(f"all_to_all_single: {recv.tolist()}")
flat = torch.empty(world * 2, dtype=torch.long, device="cuda")
dist.all_gather_into_tensor(flat, torch.tensor([rank, -rank], device="cuda"))
print(f"all_gather_into_tensor: {flat.tolist()}")
shard = torch.empty(1, device="cuda")
dist.reduce_scatter_tensor(shard, torch.arange(float(world), device="cuda") * (rank + 1))
print(f"reduce_scatter_tensor: {shard.tolist()}")
dist.barrier()
dist.destroy_process_group()
