"""torchvision detection: Faster R-CNN (MobileNetV3 FPN) and RetinaNet (ResNet-50 FPN) training
steps on synthetic images and boxes, then inference (nms, roi_align, anchors on the GPU)."""
import torch
from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_fpn, retinanet_resnet50_fpn

torch.manual_seed(0)
device = torch.device("cuda")


def batch(n, size):
    images = [torch.rand(3, size, size, device=device) for _ in range(n)]
    targets = []
    for i in range(n):
        xy = torch.tensor([[10.0 + 5 * i, 20.0], [60.0, 40.0 + 3 * i]], device=device)
        targets.append({"boxes": torch.cat([xy, xy + 50], 1), "labels": torch.tensor([1, 2], device=device)})
    return images, targets


counts = []
for name, build in (("fasterrcnn", fasterrcnn_mobilenet_v3_large_fpn), ("retinanet", retinanet_resnet50_fpn)):
    model = build(weights=None, weights_backbone=None, num_classes=3, min_size=256, max_size=256).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model.train()
    for step in range(2):
        images, targets = batch(2, 256)
        losses = model(images, targets)
        loss = sum(losses.values())
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(name, "step", step, "losses", sorted(losses))
    model.eval()
    with torch.no_grad():
        out = model(batch(2, 256)[0])
    print(name, "detections", [sorted(o) for o in out])
    counts.append(sum(p.numel() for p in model.parameters()))
    del model, opt, out, losses, loss
print("params", max(counts))  # the larger model's
print("peak_allocated", torch.cuda.max_memory_allocated())
print("peak_reserved", torch.cuda.max_memory_reserved())
print("done")
