"""torch.compile of the optimizer step (the documented pattern: a compiled function calling
opt.step()) on an eager MLP, 3 steps, Adam with a tensor learning rate."""
import torch

torch.manual_seed(0)
m = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
opt = torch.optim.Adam(m.parameters(), lr=torch.tensor(1e-3))


@torch.compile(fullgraph=False)
def step():
    opt.step()


x = torch.randn(64, 1024, device="cuda")
for i in range(3):
    m(x).pow(2).mean().backward()
    step()
    opt.zero_grad(set_to_none=True)
    print("step", i, torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved(), flush=True)
