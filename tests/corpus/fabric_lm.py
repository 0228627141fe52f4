"""Lightning Fabric: a small transformer language model, bf16 mixed precision on one GPU, AdamW,
gradient clipping, and a checkpoint saved and loaded."""
import os
import tempfile

import torch
import torch.nn as nn
from lightning.fabric import Fabric


class LM(nn.Module):
    def __init__(self, vocab=1000, d=256, layers=2, heads=4, ctx=128):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(ctx, d))
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids) + self.pos[: ids.shape[1]]
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        return self.head(self.blocks(x, mask=mask, is_causal=True))


def main():
    fabric = Fabric(accelerator="cuda", devices=1, precision="bf16-mixed")
    fabric.launch()
    fabric.seed_everything(0)
    model = LM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    data = torch.utils.data.TensorDataset(torch.randint(0, 1000, (64, 129)))
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=16))
    model.train()
    for step, (batch,) in enumerate(loader):
        logits = model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        fabric.print("step", step, "loss", round(loss.item(), 4))
    path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
    fabric.save(path, {"model": model, "optimizer": optimizer})
    fabric.load(path, {"model": model, "optimizer": optimizer})
    print("params", sum(p.numel() for p in model.parameters()))
    print("peak_allocated", torch.cuda.max_memory_allocated())
    print("peak_reserved", torch.cuda.max_memory_reserved())
    print("done")


if __name__ == "__main__":
    main()
