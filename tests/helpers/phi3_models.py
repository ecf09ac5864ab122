"""A tiny official Phi-3 model."""

from __future__ import annotations

import torch
import transformers
from causal_helpers import randomize


BASE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_phi3(model_class=transformers.Phi3ForCausalLM, seed=0, **overrides):
    torch.manual_seed(seed)
    return randomize(model_class(transformers.Phi3Config(**{**BASE, **overrides})), seed).eval()
