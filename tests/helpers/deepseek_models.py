"""Tiny official DeepSeek-V3 models of every tested variant."""

from __future__ import annotations

import torch
import transformers
from causal_helpers import BASE, randomize


MLA = dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10)


MOE = dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
           moe_intermediate_size=8, n_shared_experts=1, routed_scaling_factor=2.5)


VARIANTS = {
    "mla_moe": dict(**MLA, **MOE, num_hidden_layers=3),
    "no_q_lora_bias_not_interleaved": dict(**{**MLA, "q_lora_rank": None}, **MOE, attention_bias=True, rope_interleave=False),
    "yarn_mscale_dense_norm_off": dict(
        **MLA, **{**MOE, "first_k_dense_replace": 0, "norm_topk_prob": False, "n_group": 1, "topk_group": 1},
        rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
    ),
}


def tiny_deepseek(variant: str, seed: int = 0, **extra):
    fields = {**BASE, "num_key_value_heads": BASE["num_attention_heads"], **VARIANTS[variant], **extra}
    torch.manual_seed(seed)
    official = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**fields))
    randomize(official, seed)
    with torch.no_grad():  # a buffer randomize leaves at 0: make the correction bias change the routing
        for layer in official.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3)
    return official.eval()
