"""Hugging Face Trainer with FSDP (full shard, auto-wrapped blocks) on 2 ranks: a small GPT-2 from a
local config (random weights, tied embeddings), bf16, three steps, an evaluation."""
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seq=128, vocab=2048):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=2048, n_positions=256, n_embd=256, n_layer=4, n_head=8))


def main():
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, max_steps=3,
                             bf16=True, logging_steps=1, report_to=[], save_strategy="no",
                             fsdp="full_shard auto_wrap",
                             fsdp_config={"transformer_layer_cls_to_wrap": ["GPT2Block"]},
                             per_device_eval_batch_size=4, dataloader_num_workers=0)
    model = build()
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(32), eval_dataset=Tokens(8))
    trainer.train()
    print("eval", sorted(trainer.evaluate()))
    print("params", sum(p.numel() for p in build().parameters()))
    print("peak_allocated", torch.cuda.max_memory_allocated())
    print("peak_reserved", torch.cuda.max_memory_reserved())
    print("done")


if __name__ == "__main__":
    main()
