"""Helpers shared by the causal-family tests: tiny official models with weights large enough that a wrong RoPE,
a swapped norm or a dropped bias shows in the logits, and left-padded batches."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import transformers


BASE = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.3,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
OFFICIAL = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
}


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0, std: float = 0.3) -> torch.nn.Module:
    """Every parameter random: matrices N(0, std), biases N(0, std), norm weights 1 + N(0, std). With the usual
    init (biases 0, norms 1) a dropped bias or two swapped norms would be invisible."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator) * std
        if name.endswith("norm.weight") or "layernorm" in name:
            param.copy_(1.0 + noise)
        else:
            param.copy_(noise)
    return model


def tiny_official(kind: str = "llama", seed: int = 0, **overrides):
    config_class, model_class = OFFICIAL[kind]
    fields = {**BASE, **overrides}
    torch.manual_seed(seed)
    model = model_class(config_class(**fields))
    return randomize(model, seed).eval()


def left_padded_batch(vocab_size: int, lengths=(24, 17, 5), pad_token_id: int = 0, seed: int = 0) -> dict:
    """Left-padded ids of the given real lengths, with generate()-style position ids (real tokens count from 0)."""
    generator = torch.Generator().manual_seed(seed)
    seq_len = max(lengths)
    ids = torch.randint(3, vocab_size, (len(lengths), seq_len), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, seq_len - length :] = 1
    ids = ids.masked_fill(mask == 0, pad_token_id)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions}


def training_loss_and_grads(model, batch: dict, **extra) -> tuple[torch.Tensor, dict]:
    """The training loss of a batch (its padding labelled -100) and the gradients of the parameters that got one; the
    model is left in the mode it was in."""
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    was_training = model.training
    model.train().zero_grad()
    loss = model(**batch, labels=labels, **extra).loss
    loss.backward()
    model.train(was_training)
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def official_and_converted(official, folder) -> Path:
    """Saves an official causal model to folder/"official" and its conversion (conversion.llama) to folder/"ours";
    returns folder."""
    from conversion import llama

    folder = Path(folder)
    official.save_pretrained(folder / "official")
    llama.convert(folder / "official", folder / "ours")
    return folder


def real_logits(model, batch: dict) -> torch.Tensor:
    """Logits at the real (non-padding) tokens."""
    with torch.no_grad():
        logits = model(**batch).logits
    return logits[batch["attention_mask"].bool()]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def weight_first_model(seed: int = 0):
    """A random hf_tiny causal LM (eval mode) wide enough that, decoding on 2 threads, q, gate / up / down and the
    head take hf_tiny's weight-first product (k / v stay F.linear): hf_tiny/runtime.py's thresholds."""
    from hf_tiny import TinyCausalConfig, TinyCausalForCausalLM

    config = TinyCausalConfig(
        vocab_size=512, hidden_size=384, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return TinyCausalForCausalLM(config).eval()


def small_paged_cache():
    """Continuous batching's paged cache sized for tests: by default transformers sizes it from the free memory
    (several GB on a CPU machine, allocated and zeroed at every generate_batch call)."""
    from transformers import ContinuousBatchingConfig

    return ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=256)


def transformers_warnings(action) -> tuple[object, list[str]]:
    """action()'s result and the warnings transformers logged meanwhile (its logger does not propagate to caplog)."""
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        result = action()
    finally:
        logger.removeHandler(handler)
    return result, [r.getMessage() for r in records]
