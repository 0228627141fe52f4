"""Hugging Face Trainer on a ``datasets.Dataset`` (from_dict, map): GPT-2, bf16, evaluation during
training and after it, ``auto_find_batch_size`` (accelerate's find_executable_batch_size)."""
import sys

import torch
from datasets import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


def build():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=64,
                                      bos_token_id=1, eos_token_id=2))


if __name__ == "__main__":
    ids = torch.randint(0, 1000, (40, 48), generator=torch.Generator().manual_seed(0)).tolist()
    data = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * 48] * 40})
    data = data.map(lambda batch: {"labels": batch["input_ids"]}, batched=True)
    model = build()
    print("params", model.num_parameters())
    args = TrainingArguments(sys.argv[1] if len(sys.argv) > 1 else "datasets_out", per_device_train_batch_size=4,
                             per_device_eval_batch_size=4, max_steps=3, logging_steps=1, bf16=True,
                             report_to="none", save_strategy="no", eval_strategy="steps", eval_steps=3,
                             auto_find_batch_size=True)
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data.select(range(8)))
    print("after_move", torch.cuda.memory_allocated())
    trainer.train()
    print("eval_keys", " ".join(sorted(trainer.evaluate())))
    print("allocated", torch.cuda.memory_allocated())
    print("done")
