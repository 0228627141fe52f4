"""A plain training loop on accelerate: Accelerator(mixed_precision="bf16", gradient accumulation),
prepare, accumulate, backward, clip_grad_norm_, a cosine schedule, fused AdamW, a small Llama."""
import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM, get_cosine_schedule_with_warmup


def build():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=1000))


if __name__ == "__main__":
    acc = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2)
    print("device", acc.device, acc.distributed_type, acc.num_processes, torch.cuda.is_available())
    model = build()
    model.gradient_checkpointing_enable()
    print("params", sum(p.numel() for p in model.parameters()))
    ids = torch.randint(0, 1000, (16, 64), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4, shuffle=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    sched = get_cosine_schedule_with_warmup(opt, 1, 4)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    print("after_move", torch.cuda.memory_allocated())
    model.train()
    for step, (x,) in enumerate(loader):
        with acc.accumulate(model):
            out = model(input_ids=x, labels=x)
            acc.backward(out.loss)
            if acc.sync_gradients:
                norm = acc.clip_grad_norm_(model.parameters(), 1.0)
                acc.print(f"step {step} loss {out.loss.item():.4f} grad_norm {norm.item():.3f}")
            opt.step()
            sched.step()
            opt.zero_grad()
    del out, x, norm
    print("allocated", torch.cuda.memory_allocated())
    print("done")
