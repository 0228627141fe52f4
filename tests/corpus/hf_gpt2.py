"""Hugging Face GPT-2: AdamW training with an all-ones and a padded attention mask, gradient
checkpointing, bf16 autocast, loss.item() logging, then greedy generate()."""
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def build():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=2000, n_positions=128,
                                      bos_token_id=1, eos_token_id=2))


if __name__ == "__main__":
    model = build()
    print("params", sum(p.numel() for p in model.parameters()))
    model.to("cuda")
    print("after_move", torch.cuda.memory_allocated())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(3, 2000, (2, 64), device="cuda")
    padded = torch.ones_like(ids)
    padded[1, 48:] = 0
    for mask in (torch.ones_like(ids), padded):
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"loss {loss.item():.4f}")
    model.gradient_checkpointing_enable()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    model.eval()
    out = model.generate(ids[:1, :8], max_new_tokens=6, do_sample=False, pad_token_id=0)
    print("generated", tuple(out.shape))
    print("peak", torch.cuda.max_memory_allocated())
    print("done")
