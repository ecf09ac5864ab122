"""TinyCausalConfig <-> the official configs of the llama family (Llama, Mistral, Qwen2, Qwen3, Gemma 3, the MoE
types, DeepSeek-V3, Llama 4 text, GPT-OSS, OLMo 2, SmolLM3): every official type is a CausalVariant table
(conversion/causal_variant.py); the way back picks the type that holds an hf_tiny causal config."""

from __future__ import annotations

from hf_tiny.rope import rope_parameter_sets, uses_longrope

from . import deepseek, dense, gpt_oss, llama4, moe, olmo2, smollm3
from .causal import SHARED_FIELDS, build_causal_config, label_fields, plain_dict
from .causal_variant import CausalVariant
from .errors import ConversionError
from .moe import official_moe_family
from .phi3 import needs_phi3

# official model type -> its table, in the order the family lists them
OFFICIAL_TYPES: dict[str, CausalVariant] = {
    variant.model_type: variant
    for variant in (*dense.VARIANTS, *moe.VARIANTS, deepseek.VARIANT, llama4.VARIANT, gpt_oss.VARIANT, olmo2.VARIANT,
                    smollm3.VARIANT)
}
# The types an hf_tiny config goes back to by what it claims, asked in this order before the MoE and dense rules
# (the first that claims a config holds it, or says why not).
CLAIMING = (deepseek.VARIANT, llama4.VARIANT, gpt_oss.VARIANT, olmo2.VARIANT, smollm3.VARIANT)


def causal_config_from_official(official, *, src):
    """TinyCausalConfig equivalent to an official config of one of OFFICIAL_TYPES; what has no hf_tiny equivalent is
    an error naming the field."""
    variant = OFFICIAL_TYPES[official.model_type]
    values = {name: getattr(official, name) for name in SHARED_FIELDS}
    values["hidden_act"] = getattr(official, variant.renamed_fields.get("hidden_act", "hidden_act"))
    values["head_dim"] = getattr(official, "head_dim", None) or official.hidden_size // official.num_attention_heads
    values["rope_parameters"] = rope_as_official_reads_it(plain_dict(official.rope_parameters or {}))
    if uses_longrope(values["rope_parameters"]):  # official's rotary module switches factors, its cache stays
        values["longrope_cache_kept"] = True
    values["sliding_window"] = getattr(official, "sliding_window", None)
    if getattr(official, "layer_types", None) is not None:  # Qwen2/Qwen3 derive it from max_window_layers
        values["layer_types"] = list(official.layer_types)
    values.update(variant.fields_from_official(official, src=src))
    pad = values.get("pad_token_id")
    if pad is not None and pad != -1 and not 0 <= pad < values["vocab_size"]:
        values["pad_token_id"] = None  # -1 (old LLaMA configs) stays: official reads it as the last row, so do we
    return build_causal_config(values, official, src=src)


def rope_as_official_reads_it(rope: dict) -> dict:
    """rope_parameters (one dict, or one per layer type) without a partial_rotary_factor the default rope of these
    classes ignores (they rotate whole heads; Phi-3 alone reads it): carried, it would rotate part of each head."""
    for params in rope_parameter_sets(rope):
        if params.get("rope_type", "default") == "default":
            params.pop("partial_rotary_factor", None)
    return rope


def official_config_from_causal(config, official_class: str, model_type: str | None = None):
    """The official transformers config for an hf_tiny causal config: of model_type, by default the type
    official_family picks."""
    import transformers

    variant = OFFICIAL_TYPES[model_type or official_family(config)]
    values = {name: getattr(config, name) for name in SHARED_FIELDS}
    values.update(hidden_act=config.hidden_act, rope_parameters=plain_dict(config.rope_parameters),
                  architectures=[official_class], **label_fields(config))
    values.update(variant.official_fields(config))
    for ours, theirs in variant.renamed_fields.items():
        values[theirs] = values.pop(ours)
    return getattr(transformers, variant.config_class)(**values)


def official_family(config) -> str:
    """Which official model type can hold an hf_tiny causal config."""
    if needs_phi3(config) or config.position_embedding_type != "rope" or config.norm_type != "rmsnorm" or not config.mlp_gated:
        raise ConversionError(
            "the Llama family's official classes rotate whole heads with RMSNorm and a gated MLP; this config has "
            f"rope_parameters={config.rope_parameters}, position_embedding_type={config.position_embedding_type!r}, "
            f"norm_type={config.norm_type!r}, mlp_gated={config.mlp_gated}: convert it with the phi3 or gpt2 family"
        )
    if config.hidden_dropout or config.embedding_dropout:
        raise ConversionError(
            f"Llama-family official classes have no residual or embedding dropout; got hidden_dropout="
            f"{config.hidden_dropout}, embedding_dropout={config.embedding_dropout} (Phi-3 has a residual one)"
        )
    variant = next((variant for variant in CLAIMING if variant.claims(config)), None)
    if variant is not None:
        variant.check_holds(config)
        return variant.model_type
    if config.moe_spec() is not None:
        return official_moe_family(config)
    return dense.dense_family(config)
