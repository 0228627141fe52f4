"""PEFT LoRA on GPT-2 (Conv1D layers: fan_in_fan_out) trained by Hugging Face Trainer with fused
AdamW, bf16 and gradient checkpointing; the data a list of dicts of token ids."""
import sys

import torch
from peft import LoraConfig, TaskType, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


def build():
    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=128,
                                      bos_token_id=1, eos_token_id=2))
    return get_peft_model(base, LoraConfig(task_type=TaskType.CAUSAL_LM, r=8, lora_alpha=16, lora_dropout=0.05,
                                           target_modules=["c_attn", "c_proj"], fan_in_fan_out=True))


if __name__ == "__main__":
    model = build()
    model.print_trainable_parameters()
    print("params", sum(p.numel() for p in model.parameters()))
    rows = torch.randint(0, 1000, (32, 64), generator=torch.Generator().manual_seed(0)).tolist()
    args = TrainingArguments(output_dir=sys.argv[1] if len(sys.argv) > 1 else "peft_out",
                             per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3,
                             logging_steps=1, bf16=True, optim="adamw_torch_fused", gradient_checkpointing=True,
                             gradient_checkpointing_kwargs={"use_reentrant": False}, report_to="none",
                             save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows])
    print("after_move", torch.cuda.memory_allocated())
    trainer.train()
    print("allocated", torch.cuda.memory_allocated())
    print("done")
