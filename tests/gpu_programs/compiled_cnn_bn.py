"""A compiled CNN with BatchNorm (no torchvision needed): torch.compile default mode, fp16 autocast
+ GradScaler, SGD with momentum, 3 training steps, then 2 compiled eval steps."""
import torch
import torch.nn as nn


def block(cin, cout, stride):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


torch.manual_seed(0)
m = nn.Sequential(block(3, 64, 2), nn.MaxPool2d(2), block(64, 128, 2), block(128, 256, 2),
                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 1000)).cuda()
opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
sc = torch.amp.GradScaler("cuda")
cm = torch.compile(m)
x = torch.randn(32, 3, 224, 224, device="cuda")
y = torch.randint(0, 1000, (32,), device="cuda")
for i in range(3):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = nn.functional.cross_entropy(cm(x), y)
    sc.scale(loss).backward()
    sc.step(opt)
    sc.update()
    opt.zero_grad(set_to_none=True)
    print("step", i, torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved(), flush=True)
cm.eval()
with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
    for _ in range(2):
        cm(x)
print("end", torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
