"""Expandable segments (run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): a request larger
than the card fails (caught), then the program goes on allocating. Which reserved range the later
requests grow depends on where the driver put the ranges the failed request reserved."""
import torch

keep = [torch.empty(k << 20, device="cuda") for k in range(1, 6)]
keep += [torch.empty(1000 * k, device="cuda") for k in range(1, 6)]
del keep[3]
total = torch.cuda.get_device_properties(0).total_memory
try:
    torch.empty(2 * total, dtype=torch.uint8, device="cuda")
except torch.cuda.OutOfMemoryError:
    print("oom caught")
more = [torch.empty(7 << 20, device="cuda") for _ in range(3)]
del keep[1]
more.append(torch.empty(3 << 20, device="cuda"))
print("end", torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
