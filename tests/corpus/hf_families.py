"""Hugging Face model families with their own code paths, as a new user trains them: a tiny
random-initialised config per family (no downloads), AdamW steps in float32 and under bf16
autocast (gradient checkpointing on some), a padded attention mask where the model takes one,
then generate() for the generative ones. Usage: ``python hf_families.py FAMILY``.

Families: sliding-window attention (Mistral), GQA with biases (Qwen2) and q/k norms (Qwen3),
RMSNorm + 1 and soft-capping (Gemma, Gemma2), fused qkv (Phi-3), mixtures of experts (Mixtral,
Qwen2-MoE, Qwen3-MoE: routing depends on the logits), encoders (BERT masked LM, RoBERTa sequence
classification), encoder-decoders (T5, Whisper), vision (ViT, CLIP) and Mamba (its slow path: no
mamba-ssm kernels installed)."""
import sys

import torch
import transformers as tf

D = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
     "vocab_size": 2000, "max_position_embeddings": 256}
LLM = {**D, "num_attention_heads": 8, "num_key_value_heads": 2}
MOE = {**LLM, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "decoder_sparse_step": 1}
# family -> (model class, config class, config, task, gradient checkpointing)
FAMILIES = {
    "mistral": ("MistralForCausalLM", "MistralConfig", {**LLM, "sliding_window": 32}, "lm", True),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", LLM, "lm", False),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {**LLM, "head_dim": 32}, "lm", True),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", {**LLM, "head_dim": 32}, "lm", False),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", {**LLM, "head_dim": 32, "sliding_window": 32}, "lm", True),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", {**LLM, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
             "lm", False),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                {**LLM, "num_local_experts": 4, "num_experts_per_tok": 2}, "lm", False),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", {**MOE, "shared_expert_intermediate_size": 128},
                  "lm", False),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", MOE, "lm", True),
    "mamba": ("MambaForCausalLM", "MambaConfig",
              {"hidden_size": 128, "state_size": 16, "num_hidden_layers": 2, "vocab_size": 2000}, "lm", False),
    "bert": ("BertForMaskedLM", "BertConfig", D, "mlm", True),
    "roberta": ("RobertaForSequenceClassification", "RobertaConfig",
                {**D, "num_labels": 3, "pad_token_id": 1}, "cls", False),
    "t5": ("T5ForConditionalGeneration", "T5Config",
           {"d_model": 128, "d_ff": 256, "d_kv": 32, "num_layers": 2, "num_heads": 4, "vocab_size": 2000,
            "decoder_start_token_id": 0}, "seq2seq", True),
    "whisper": ("WhisperForConditionalGeneration", "WhisperConfig",
                {"d_model": 128, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
                 "decoder_attention_heads": 4, "encoder_ffn_dim": 256, "decoder_ffn_dim": 256, "vocab_size": 2000,
                 "num_mel_bins": 80, "max_source_positions": 100, "max_target_positions": 64,
                 "decoder_start_token_id": 1998, "pad_token_id": 1999, "eos_token_id": 1999,
                 "bos_token_id": 1999,
                 "suppress_tokens": [], "begin_suppress_tokens": []}, "audio", False),
    "vit": ("ViTForImageClassification", "ViTConfig",
            {**D, "image_size": 64, "patch_size": 16, "num_labels": 10}, "image", True),
    "clip": ("CLIPModel", "CLIPConfig",
             {"text_config": {**D, "max_position_embeddings": 64, "bos_token_id": 1, "eos_token_id": 2},
              "vision_config": {**D, "image_size": 64, "patch_size": 16}, "projection_dim": 64}, "clip", False),
}


def build(family):
    model_cls, config_cls, config, _, _ = FAMILIES[family]
    torch.manual_seed(0)
    return getattr(tf, model_cls)(getattr(tf, config_cls)(**config))


def batches(task, config):
    """The keyword arguments of a training step, on the GPU."""
    ids = torch.randint(3, 2000, (2, 64), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :8] = 0  # left padding, as a decoder batches prompts
    if task == "lm":
        return {"input_ids": ids, "attention_mask": mask, "labels": ids}
    if task == "mlm":
        labels = torch.full_like(ids, -100)
        labels[:, ::7] = ids[:, ::7]
        mask = torch.ones_like(ids)
        mask[1, 40:] = 0  # right padding, as a tokenizer pads an encoder's batch
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if task == "cls":
        mask = torch.ones_like(ids)
        mask[1, 40:] = 0
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 2], device="cuda")}
    labels = torch.randint(3, 1990, (2, 16), device="cuda")  # a short target sequence
    if task == "seq2seq":
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if task == "audio":
        features = torch.randn(2, config.num_mel_bins, 2 * config.max_source_positions, device="cuda")
        return {"input_features": features, "labels": labels}
    pixels = torch.randn(2, 3, 64, 64, device="cuda")
    if task == "image":
        return {"pixel_values": pixels, "labels": torch.tensor([1, 7], device="cuda")}
    return {"input_ids": ids[:, :16], "pixel_values": pixels, "return_loss": True}


def main(family):
    _, _, _, task, checkpointing = FAMILIES[family]
    model = build(family)
    print("params", sum(p.numel() for p in model.parameters()))
    model.to("cuda")
    print("after_move", torch.cuda.memory_allocated())
    if checkpointing:
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = batches(task, model.config)
    for amp in (False, True):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"loss {loss.item():.4f}")
    print("peak", torch.cuda.max_memory_allocated())
    model.eval()
    if task in ("lm", "seq2seq"):
        out = model.generate(batch["input_ids"][:, :16], attention_mask=batch["attention_mask"][:, :16],
                             max_new_tokens=4, do_sample=False)
        print("generated", tuple(out.shape))
    elif task == "audio":
        out = model.generate(batch["input_features"], max_new_tokens=4, do_sample=False)
        print("generated", tuple(out.shape))
    print("done")


if __name__ == "__main__":
    main(sys.argv[1])
