"""Tiny official SmolLM3 models of every tested variant and their hf_tiny twins."""

from __future__ import annotations

import torch
import transformers
from causal_helpers import BASE, randomize
from family_parity import (load_ours)


SHAPES = dict(BASE, hidden_size=36, intermediate_size=44, num_hidden_layers=4, num_attention_heads=6,
              num_key_value_heads=3)


VARIANTS = {
    # every 2nd layer without RoPE (SmolLM3-3B: every 4th), untied head
    "nope_every_2nd": dict(no_rope_layer_interval=2, tie_word_embeddings=False),
    # SmolLM3's sliding windows (on the NoPE layers), biases everywhere, tied head, explicit no_rope_layers
    "sliding_nope_biases_tied": dict(no_rope_layers=[1, 0, 0, 1], use_sliding_window=True, sliding_window=5,
                                     attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
}


def tiny_smollm3(variant: str, seed: int = 0):
    torch.manual_seed(seed)
    official = transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(**SHAPES, **VARIANTS[variant]))
    return randomize(official, seed).eval()


def smollm3_fields(official_config) -> dict:
    """SmolLM3Config -> TinyCausalConfig: Llama's fields, plus no_rope_layers (1 = rotates) read as the indices
    of the layers that do not; the window only where use_sliding_window turns it on."""
    c = official_config
    sliding = "sliding_attention" in c.layer_types
    return dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_parameters=dict(c.rope_parameters), attention_bias=c.attention_bias, mlp_bias=c.mlp_bias,
        tie_word_embeddings=c.tie_word_embeddings, layer_types=list(c.layer_types),
        sliding_window=c.sliding_window if sliding else None,
        nope_layers=[i for i, rotates in enumerate(c.no_rope_layers[: c.num_hidden_layers]) if not rotates],
        pad_token_id=c.pad_token_id, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
    )


def smollm3_rename(name: str, tensor: torch.Tensor) -> dict:
    return {name: tensor}  # SmolLM3's tensors carry Llama's names


def ours_for(official, **changes):
    return load_ours(official, {**smollm3_fields(official.config), **changes}, smollm3_rename)
