"""The Llama-layout official families the llama converter reads, as tiny configs."""

from __future__ import annotations



# name -> (official family, config overrides)
VARIANTS = {
    "mha": ("llama", dict(num_key_value_heads=4)),
    "gqa": ("llama", dict(num_key_value_heads=2)),
    "mqa": ("llama", dict(num_key_value_heads=1)),
    "explicit_head_dim": ("llama", dict(head_dim=16)),
    "tied": ("llama", dict(tie_word_embeddings=True)),
    "biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "rope_linear": ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0})),
    # max_position_embeddings 16 with factor 2: the 24-token batch runs into the NTK rescaling
    "rope_dynamic": (
        "llama",
        dict(max_position_embeddings=16, rope_parameters={"rope_type": "dynamic", "rope_theta": 100.0, "factor": 2.0}),
    ),
    "rope_yarn": (
        "llama",
        dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "original_max_position_embeddings": 16}),
    ),
    "rope_llama3": (
        "llama",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        ),
    ),
    "mistral_sliding_window": ("mistral", dict(sliding_window=6, head_dim=8)),
    "qwen2_qkv_bias": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3_qk_norm": ("qwen3", dict(head_dim=16)),
    "qwen3_biases_mha": ("qwen3", dict(head_dim=8, num_key_value_heads=4, attention_bias=True, tie_word_embeddings=True)),
    # per-layer sliding windows: Qwen's max_window_layers (layers >= it slide), Gemma 3's layer_types
    "qwen2_max_window_layers": ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    "qwen3_max_window_layers": (
        "qwen3", dict(head_dim=16, num_hidden_layers=3, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    ),
    "gemma3": (
        "gemma3_text",
        dict(
            head_dim=16, num_hidden_layers=4, sliding_window=4, query_pre_attn_scalar=12,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0},
            },
        ),
    ),
    # transformers' defaults for the pattern (5 sliding : 1 global) and the bases; logit soft-capping on
    "gemma3_softcap_tied_mha": (
        "gemma3_text",
        dict(head_dim=8, num_hidden_layers=6, num_key_value_heads=4, sliding_window=3, final_logit_softcapping=5.0),
    ),
}
