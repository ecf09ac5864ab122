"""SmolLM3 checkpoints <-> the hf_tiny causal LM: the Llama block (the same tensor names) with NoPE layers, layers
that do not rotate their queries and keys (`nope_layers`; SmolLM3's `no_rope_layers` holds 1 where a layer
rotates)."""

from __future__ import annotations

from hf_tiny.configuration_causal import field_value

from .causal_variant import CausalVariant, llama_named_classes, no_rope_fields
from .errors import ConversionError


def claims(config) -> bool:
    """NoPE layers; or, in a plain Llama block (no q/k norm, no MoE), sliding windows that neither Mistral (on every
    layer, no biases) nor Qwen2 (biases on q/k/v only) holds. SmolLM3 holds any full / sliding mix with one bias
    switch for q/k/v/o; Qwen3 and Gemma 3, the other official homes of per-layer windows, have q/k norms."""
    if field_value(config, "nope_layers"):
        return True
    if "sliding_attention" not in config.layer_types or config.qk_norm or config.moe_spec() is not None:
        return False
    out_bias = config.attention_bias if config.attention_output_bias is None else config.attention_output_bias
    mistral = set(config.layer_types) == {"sliding_attention"} and not (config.attention_bias or out_bias
                                                                         or config.mlp_bias)
    qwen2 = config.attention_bias and not out_bias and not config.mlp_bias
    return not (mistral or qwen2)


def check_holds(config) -> None:
    wanted = {"qk_norm": False, "sandwich_norms": False, "pre_norms": True, "num_local_experts": 0,
              "rms_norm_unit_offset": False, "scale_embeddings": False, "attention_sinks": False}
    differ = {name: field_value(config, name) for name in wanted if field_value(config, name) != wanted[name]}
    if config.attention_output_bias is not None and config.attention_output_bias != config.attention_bias:
        differ["attention_output_bias"] = config.attention_output_bias
    if "chunked_attention" in config.layer_types:
        differ["layer_types"] = sorted(set(config.layer_types))
    if differ:
        raise ConversionError(f"SmolLM3 needs {wanted} and one attention_bias for q/k/v/o; this config has {differ}")


def fields_from_official(official, *, src) -> dict:
    layers = official.num_hidden_layers
    sliding = "sliding_attention" in official.layer_types
    return dict(
        nope_layers=[i for i, rotates in enumerate(official.no_rope_layers[:layers]) if not rotates],
        attention_bias=official.attention_bias, mlp_bias=official.mlp_bias,
        sliding_window=official.sliding_window if sliding else None,
    )


def official_fields(config) -> dict:
    if config.head_dim != config.hidden_size // config.num_attention_heads:
        raise ConversionError(f"SmolLM3 has no head_dim field: head_dim={config.head_dim} must equal hidden_size // "
                              "num_attention_heads")
    sliding = "sliding_attention" in config.layer_types
    return dict(
        **no_rope_fields(field_value(config, "nope_layers"), config.num_hidden_layers),
        use_sliding_window=sliding, sliding_window=config.sliding_window if sliding else None,
        layer_types=list(config.layer_types), attention_bias=config.attention_bias, mlp_bias=config.mlp_bias,
    )


VARIANT = CausalVariant(
    "smollm3", "SmolLM3Config", llama_named_classes("SmolLM3"), fields_from_official=fields_from_official,
    official_fields=official_fields, claims=claims, check_holds=check_holds,
)
