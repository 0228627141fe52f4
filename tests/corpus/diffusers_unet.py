"""A diffusers UNet2DModel denoising step (attention blocks, time embedding), AdamW."""
import torch
import torch.nn.functional as F
from diffusers import UNet2DModel


def build():
    torch.manual_seed(0)
    return UNet2DModel(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(32, 64),
                       layers_per_block=1, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "UpBlock2D"))


if __name__ == "__main__":
    unet = build()
    print("params", sum(p.numel() for p in unet.parameters()))
    unet.to("cuda")
    print("after_move", torch.cuda.memory_allocated())
    opt = torch.optim.AdamW(unet.parameters(), lr=1e-4)
    x = torch.randn(2, 3, 32, 32, device="cuda")
    noise = torch.randn_like(x)
    t = torch.randint(0, 1000, (2,), device="cuda")
    loss = F.mse_loss(unet(x + noise, t).sample, noise)
    loss.backward()
    opt.step()
    print(f"loss {loss.item():.4f}")
    print("done")
