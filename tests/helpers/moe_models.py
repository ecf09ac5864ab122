"""The official Mixture-of-Experts families the converter reads, as tiny configs."""

from __future__ import annotations



# name -> (official model type, config overrides); every variant routes 24-token rows over several experts
VARIANTS = {
    "mixtral_top2_of_4": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "mixtral_top1_of_3_sliding_mha": (
        "mixtral", dict(num_local_experts=3, num_experts_per_tok=1, sliding_window=5, num_key_value_heads=4),
    ),
    "qwen3_moe_dense_layer": (
        "qwen3_moe",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=16, mlp_only_layers=[1]),
    ),
    "qwen3_moe_norm_topk_sparse_step": (
        "qwen3_moe",
        dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=8, norm_topk_prob=True, num_hidden_layers=3,
             decoder_sparse_step=2, attention_bias=True),
    ),
    "qwen2_moe_shared_expert": (
        "qwen2_moe",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
             mlp_only_layers=[0], tie_word_embeddings=True),
    ),
}
