"""Hugging Face Llama with grouped-query attention (8 query heads, 2 KV heads): float32 and bf16
autocast training steps with a left-padded mask, then generate()."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=8, num_key_value_heads=2, vocab_size=2000,
                                        max_position_embeddings=256))


if __name__ == "__main__":
    model = build()
    print("params", sum(p.numel() for p in model.parameters()))
    model.cuda()
    print("after_move", torch.cuda.memory_allocated())
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.randint(3, 2000, (2, 64), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :8] = 0
    for amp in (False, True):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"loss {loss.item():.4f}")
    out = model.generate(ids[:, :8], attention_mask=mask[:, :8], max_new_tokens=4, do_sample=False)
    print("generated", tuple(out.shape))
    print("done")
