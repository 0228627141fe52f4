"""Hugging Face Trainer fine-tuning a small Llama with grouped-query attention: bf16, gradient
accumulation, gradient checkpointing, a loss log every step, the optimizer named on the command
line (adamw_torch or adamw_torch_fused); token ids from a torch Dataset, no tokenizer."""
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


class TokenIds(torch.utils.data.Dataset):
    def __init__(self, n, seq, vocab):
        self.ids = torch.randint(3, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        x = self.ids[i]
        return {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()}


def build():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=1000))


if __name__ == "__main__":
    model = build()
    print("params", model.num_parameters())
    args = TrainingArguments(output_dir=sys.argv[2] if len(sys.argv) > 2 else "trainer_out",
                             per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3,
                             logging_steps=1, bf16=True, gradient_checkpointing=True, learning_rate=1e-3,
                             optim=sys.argv[1] if len(sys.argv) > 1 else "adamw_torch", report_to="none",
                             save_strategy="no")
    print("device", args.device, args.n_gpu, torch.cuda.is_bf16_supported())
    trainer = Trainer(model=model, args=args, train_dataset=TokenIds(64, 64, 1000))
    print("after_move", torch.cuda.memory_allocated())
    result = trainer.train()
    print("steps", result.global_step)
    print("allocated", torch.cuda.memory_allocated())
    print("done")
