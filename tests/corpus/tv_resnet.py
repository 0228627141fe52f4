"""A torchvision ResNet-18 trained with AMP (float16 autocast) and GradScaler, SGD with momentum."""
import torch
import torch.nn.functional as F
import torchvision


def build():
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=100)


if __name__ == "__main__":
    model = build()
    print("params", sum(p.numel() for p in model.parameters()))
    model = model.cuda()
    print("after_move", torch.cuda.memory_allocated())
    # (channels_last copies reuse the freed weights' cached blocks, some with up to 1 MiB of
    # unsplit slack, which memory_allocated counts: no longer the storages' sum)
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda")
    for step in range(2):
        x = torch.randn(8, 3, 64, 64, device="cuda").to(memory_format=torch.channels_last)
        y = torch.randint(0, 100, (8,), device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f}")
    print("state", len(opt.state), len(list(model.parameters())))
    print("done")
