"""A tiny official GPT-2 model."""

from __future__ import annotations

import torch
import transformers
from causal_helpers import randomize


BASE = dict(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)


def tiny_gpt2(model_class=transformers.GPT2LMHeadModel, seed=0, **overrides):
    torch.manual_seed(seed)
    return randomize(model_class(transformers.GPT2Config(**{**BASE, **overrides})), seed).eval()
