"""OLMo 2 checkpoints <-> the hf_tiny causal LM: the Llama block with its norms after each sublayer instead of before
(`pre_norms=False` with `sandwich_norms`) and q/k norms over the whole projection (`qk_norm_type="projection"`).

    ours (layer i)                      OLMo 2
    attn_output_layernorm               post_attention_layernorm
    mlp_output_layernorm                post_feedforward_layernorm
    self_attn.q_norm / k_norm           self_attn.q_norm / k_norm (widths heads * head_dim, kv_heads * head_dim)
"""

from __future__ import annotations

from hf_tiny.configuration_causal import field_value

from .causal_variant import CausalVariant, llama_named_classes
from .errors import ConversionError

NORMS = {"post_attention_layernorm": "attn_output_layernorm", "post_feedforward_layernorm": "mlp_output_layernorm"}
LAYOUT = dict(pre_norms=False, sandwich_norms=True, qk_norm=True, qk_norm_type="projection")


def claims(config) -> bool:
    return field_value(config, "pre_norms") is False


def check_holds(config) -> None:
    wanted = {**LAYOUT, "mlp_bias": False, "nope_layers": (), "num_local_experts": 0, "rms_norm_unit_offset": False,
              "scale_embeddings": False, "attention_sinks": False}
    differ = {name: field_value(config, name) for name in wanted if field_value(config, name) != wanted[name]}
    out_bias = config.attention_output_bias
    if out_bias is not None and out_bias != config.attention_bias:
        differ["attention_output_bias"] = out_bias
    if set(config.layer_types) != {"full_attention"}:
        differ["layer_types"] = sorted(set(config.layer_types))
    if differ:
        raise ConversionError(f"OLMo 2 needs {wanted}, one attention_bias for q/k/v/o and full attention; this "
                              f"config has {differ}")


# OLMo 2 rounds a bf16 / fp16 model as Olmo2RMSNorm and its float32 RoPE do (in float32 they change nothing, so the
# way back does not require them of a config)
ROUNDING = dict(norm_product_float32=True, rope_float32=True)


def fields_from_official(official, *, src) -> dict:
    return dict(LAYOUT, **ROUNDING, attention_bias=official.attention_bias, mlp_bias=False)


def official_fields(config) -> dict:
    if config.head_dim != config.hidden_size // config.num_attention_heads:
        raise ConversionError(f"OLMo 2 has no head_dim field: head_dim={config.head_dim} must equal hidden_size // "
                              "num_attention_heads")
    return dict(attention_bias=config.attention_bias)


VARIANT = CausalVariant(
    "olmo2", "Olmo2Config", llama_named_classes("Olmo2"), fields_from_official=fields_from_official,
    official_fields=official_fields, claims=claims, check_holds=check_holds, layer_norms=NORMS,
)
