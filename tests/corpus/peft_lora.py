"""A PEFT LoRA step on a small Llama: only the adapters train, so AdamW keeps state for them only."""
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM


def build():
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, vocab_size=2000))
    return get_peft_model(base, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))


if __name__ == "__main__":
    model = build()
    print("params", sum(p.numel() for p in model.parameters()))
    model.cuda()
    print("after_move", torch.cuda.memory_allocated())
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    ids = torch.randint(3, 2000, (2, 32), device="cuda")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    print("state", len(opt.state), len(trainable))
    print(f"loss {loss.item():.4f}")
    print("done")
