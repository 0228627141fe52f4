"""accelerate with its FSDP plugin (FSDP2, full shard, one unit per decoder layer) on 2 ranks: a
small Llama built from a local config (random weights), bf16 mixed precision, AdamW, gradient
clipping, three steps. Run with ``vram run --nproc-per-node 2``."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
    return LlamaForCausalLM(config)


def main():
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True,
                                            auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    accelerator = Accelerator(mixed_precision="bf16", fsdp_plugin=plugin)
    model = build()
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    for step in range(3):
        ids = torch.randint(0, 2048, (4, 128), device=accelerator.device)
        out = model(input_ids=ids, labels=ids)
        accelerator.backward(out.loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.print("step", step, "loss", out.loss.item())
    print("params", n_params)
    print("peak_allocated", torch.cuda.max_memory_allocated())
    print("peak_reserved", torch.cuda.max_memory_reserved())
    accelerator.end_training()
    print("done")


if __name__ == "__main__":
    main()
