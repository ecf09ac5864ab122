"""Small models of every family and causal variant, with norms away from their init, for the runtime's tests."""

from __future__ import annotations

import torch
import hf_tiny


SIZES = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=128)


CAUSAL_VARIANTS = {
    "llama": dict(num_key_value_heads=2),
    "gemma3": dict(hidden_act="gelu_pytorch_tanh", rms_norm_unit_offset=True, sandwich_norms=True, qk_norm=True,
                   scale_embeddings=True, head_dim=8, query_pre_attn_scalar=8, sliding_window=16,
                   layer_types=["sliding_attention", "full_attention"]),
    "gpt2": dict(norm_type="layernorm", mlp_gated=False, hidden_act="gelu_new", mlp_bias=True, attention_bias=True,
                 position_embedding_type="learned", hidden_dropout=0.1),
    "olmo2": dict(pre_norms=False, sandwich_norms=True, qk_norm=True, qk_norm_type="projection"),
    "mpt": dict(position_embedding_type="alibi", norm_type="layernorm", norm_bias=False, mlp_gated=False, hidden_act="gelu"),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, output_router_logits=True,
                    shared_expert_intermediate_size=16),
    "deepseek": dict(kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                     num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, router_scoring="sigmoid",
                     first_k_dense_replace=1, num_nextn_predict_layers=1),
}


def causal_model(variant: str = "llama", seed: int = 0, **overrides):
    """A small random causal LM of one variant (overrides: more config fields, e.g. attention_bias=True)."""
    torch.manual_seed(seed)
    config = hf_tiny.TinyCausalConfig(**SIZES, initializer_range=0.3, pad_token_id=0,
                                      **{**CAUSAL_VARIANTS[variant], **overrides})
    model = hf_tiny.TinyCausalForCausalLM(config)
    with torch.no_grad():  # norms away from 1 / 0 so that a wrong norm gradient shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
    return model.eval()


def encoder_model(seed: int = 0):
    torch.manual_seed(seed)
    return hf_tiny.TinyEncoderForMaskedLM(hf_tiny.TinyEncoderConfig(**SIZES, hidden_dropout=0.1)).eval()


def modernbert_model(seed: int = 0):
    """The encoder with ModernBERT's parts: pre-norm layers (layers.PreNormResidual), rotary positions, local windows."""
    torch.manual_seed(seed)
    config = hf_tiny.TinyEncoderConfig(
        **SIZES, type_vocab_size=0, position_embedding_type="rope", norm_placement="pre", norm_bias=False,
        mlp_gated=True, mlp_bias=False, attention_bias=False, head_transform=True, hidden_dropout=0.1,
        layer_types=["full_attention", "sliding_attention"], sliding_window=3,
    )
    return hf_tiny.TinyEncoderForMaskedLM(config).eval()


def seq2seq_model(style: str = "bart", seed: int = 0):
    torch.manual_seed(seed)
    config = hf_tiny.TinySeq2SeqConfig.from_style(style, **SIZES, hidden_dropout=0.1,
                                                  **({"pad_token_id": 0, "decoder_start_token_id": 0} if style == "t5" else {}))
    return hf_tiny.TinySeq2SeqForConditionalGeneration(config).eval()


FAMILIES = {
    **{f"causal-{name}": (lambda name=name: causal_model(name)) for name in CAUSAL_VARIANTS},
    "encoder": encoder_model,
    "encoder-modernbert": modernbert_model,
    "seq2seq-bart": seq2seq_model,
    "seq2seq-t5": lambda: seq2seq_model("t5"),
}
