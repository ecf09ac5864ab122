"""Tiny official OLMo 2 models of every tested variant and their hf_tiny twins."""

from __future__ import annotations

import torch
import transformers
from causal_helpers import BASE, randomize
from family_parity import (load_ours)


SHAPES = dict(BASE, hidden_size=36, intermediate_size=44, num_hidden_layers=3, num_attention_heads=6,
              num_key_value_heads=2)


VARIANTS = {
    "gqa": dict(),
    "mha_biases_tied_theta": dict(num_key_value_heads=6, attention_bias=True, tie_word_embeddings=True,
                                  rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
}


# official OLMo 2 name part -> ours (the rest is Llama's)
RENAMES = {".post_attention_layernorm.": ".attn_output_layernorm.",
           ".post_feedforward_layernorm.": ".mlp_output_layernorm."}


OLMO2_LAYOUT = dict(pre_norms=False, sandwich_norms=True, qk_norm=True, qk_norm_type="projection",
                    norm_product_float32=True, rope_float32=True)  # OLMo 2's bf16 / fp16 rounding


def tiny_olmo2(variant: str, seed: int = 0):
    torch.manual_seed(seed)
    official = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**{**SHAPES, **VARIANTS[variant]}))
    return randomize(official, seed).eval()


def olmo2_fields(official_config) -> dict:
    """Olmo2Config -> TinyCausalConfig: Llama's fields (attention_bias biases q, k, v and o), OLMo 2's layout."""
    c = official_config
    return dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_parameters=dict(c.rope_parameters), attention_bias=c.attention_bias,
        tie_word_embeddings=c.tie_word_embeddings, pad_token_id=c.pad_token_id, bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id, **OLMO2_LAYOUT,
    )


def olmo2_rename(name: str, tensor: torch.Tensor) -> dict:
    for official, ours in RENAMES.items():
        name = name.replace(official, ours)
    return {name: tensor}


def ours_for(official, **changes):
    return load_ours(official, {**olmo2_fields(official.config), **changes}, olmo2_rename)
