"""torch.cuda.MemPool: allocations routed to two pools and the default pool, blocks freed and reused
within a pool, a pool deleted, the cache emptied in between."""
import torch

a = torch.empty(3 << 20, device="cuda")
p1, p2 = torch.cuda.MemPool(), torch.cuda.MemPool()
with torch.cuda.use_mem_pool(p1):
    x = torch.empty(5 << 20, device="cuda")
    s = torch.empty(1000, device="cuda")
    y = torch.empty(1 << 20, device="cuda")
del x
b = torch.empty(4 << 20, device="cuda")
with torch.cuda.use_mem_pool(p2):
    z = torch.empty(2 << 20, device="cuda")
    t = torch.empty(100, device="cuda")
with torch.cuda.use_mem_pool(p1):
    w = torch.empty(4 << 20, device="cuda")
    u = torch.empty(300, device="cuda")
del y, s
torch.cuda.empty_cache()
c = torch.empty(6 << 20, device="cuda")
del z, t
del p2
torch.cuda.empty_cache()
d = torch.empty(2 << 20, device="cuda")
with torch.cuda.use_mem_pool(p1):
    v = [torch.empty(k << 18, device="cuda") for k in range(1, 9)]
del v
e = torch.empty(1 << 20, device="cuda")
print("end", torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
