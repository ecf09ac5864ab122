"""A tiny official MPT model (ALiBi)."""

from __future__ import annotations

import torch
import transformers
from causal_helpers import randomize


def tiny_mpt(heads=4, seed=0, **overrides):
    fields = dict(vocab_size=97, d_model=48, n_heads=heads, n_layers=2, max_seq_len=64, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    official = transformers.MptForCausalLM(transformers.MptConfig(**{**fields, **overrides}))
    return randomize(official, seed, std=0.5).eval()
