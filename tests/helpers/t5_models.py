"""A tiny official T5ForConditionalGeneration saved to a folder, with norms away from 1 so that they count."""

from __future__ import annotations

import torch
from transformers import T5Config, T5ForConditionalGeneration


def make_official_t5(path, *, seed=0, **overrides):
    torch.manual_seed(seed)
    fields = dict(
        vocab_size=64, d_model=16, d_kv=6, d_ff=32, num_heads=4, relative_attention_num_buckets=8,
        relative_attention_max_distance=12, dropout_rate=0.0, decoder_start_token_id=0, initializer_factor=1.5,
    )
    fields.update(overrides)
    model = T5ForConditionalGeneration(T5Config(**fields)).eval()
    if not fields.get("tie_word_embeddings", True):
        model.lm_head.weight = torch.nn.Parameter(torch.randn(model.config.vocab_size, model.config.d_model))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layer_norm" in name:
                param.normal_(1.0, 0.3)
    model.save_pretrained(path)
    return path
