"""A timm ViT (tiny, patch 16) trained with AMP (bfloat16 autocast), GradScaler and AdamW."""
import timm
import torch


def build():
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", num_classes=10, img_size=64)


if __name__ == "__main__":
    model = build()
    print("params", sum(p.numel() for p in model.parameters()))
    model.to("cuda")
    print("after_move", torch.cuda.memory_allocated())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    scaler = torch.amp.GradScaler("cuda")
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    for step in range(2):
        x = torch.randn(4, 3, 64, 64, device="cuda")
        y = torch.randint(0, 10, (4,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = criterion(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        print(f"step {step} loss {loss.item():.4f}")
    print("state", len(opt.state), len(list(model.parameters())))
    print("done")
