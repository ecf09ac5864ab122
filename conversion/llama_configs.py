"""TinyCausalConfig <-> the official configs of the Llama family (Llama, Mistral, Qwen2, Qwen3, Gemma 3, the MoE
types, DeepSeek-V3), and which official type can hold an hf_tiny causal config."""

from __future__ import annotations

from . import deepseek, gpt_oss, llama4, olmo2, smollm3
from .causal import SHARED_FIELDS, build_causal_config, official_label_fields, plain_dict
from .errors import ConversionError
from .moe import MOE_MODEL_TYPES, OFFICIAL_PREFIXES, moe_fields_from_official, official_moe_config_fields
from .moe import official_moe_family
from .phi3 import needs_phi3

# The 2025 families: tables beside the Llama block (a model type, its classes and config class, claims(config),
# check_holds, the config fields both ways, adapt_layer_rules / sparse_rules); the first that claims a config holds it.
VARIANTS = (llama4, gpt_oss, olmo2, smollm3)
VARIANT_BY_TYPE = {variant.MODEL_TYPE: variant for variant in VARIANTS}

CONFIG_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
                  "gemma3_text": "Gemma3TextConfig", deepseek.MODEL_TYPE: "DeepseekV3Config",
                  **{variant.MODEL_TYPE: variant.CONFIG_CLASS for variant in (gpt_oss, llama4, olmo2, smollm3)},
                  **{family: f"{prefix}Config" for family, prefix in OFFICIAL_PREFIXES.items()}}



def causal_config_from_official(official, *, src):
    """TinyCausalConfig equivalent to an official Llama / Mistral / Qwen2 config; variants without an hf_tiny
    equivalent are errors naming the field."""
    model_type = official.model_type
    values = {name: getattr(official, name) for name in SHARED_FIELDS}
    values["hidden_act"] = getattr(official, "hidden_activation", None) or official.hidden_act  # Gemma's name
    values["head_dim"] = getattr(official, "head_dim", None) or official.hidden_size // official.num_attention_heads
    values["rope_parameters"] = plain_dict(official.rope_parameters or {})
    values["sliding_window"] = getattr(official, "sliding_window", None)
    if getattr(official, "layer_types", None) is not None:  # Qwen2/Qwen3 derive it from max_window_layers
        values["layer_types"] = list(official.layer_types)
    if model_type == "llama":
        values["attention_bias"] = official.attention_bias
        values["mlp_bias"] = official.mlp_bias
    elif model_type == "gemma3_text":
        values.update(_gemma3_fields(official, src=src))
    elif model_type == deepseek.MODEL_TYPE:
        values.update(deepseek.fields_from_official(official, src=src))
    elif model_type in VARIANT_BY_TYPE:
        values.update(VARIANT_BY_TYPE[model_type].fields_from_official(official, src=src))
    elif model_type in MOE_MODEL_TYPES:
        values.update(moe_fields_from_official(official, src=src))
        if model_type == "qwen2_moe":  # biases on q/k/v (qkv_bias), none on o_proj
            values.update(attention_bias=official.qkv_bias, attention_output_bias=False, sliding_window=None)
        elif model_type == "qwen3_moe":
            values.update(attention_bias=official.attention_bias, qk_norm=True, sliding_window=None)
    elif model_type in ("qwen2", "qwen3"):
        if model_type == "qwen2":
            values["attention_bias"] = True  # Qwen2 has biases on q/k/v and none on o_proj
            values["attention_output_bias"] = False
        else:
            values["attention_bias"] = official.attention_bias  # Qwen3: on q/k/v/o alike
            values["qk_norm"] = True
    pad = values.get("pad_token_id")
    if pad is not None and pad != -1 and not 0 <= pad < values["vocab_size"]:
        values["pad_token_id"] = None  # -1 (old LLaMA configs) stays: official reads it as the last row, so do we
    return build_causal_config(values, official, src=src)


def _gemma3_fields(official, *, src) -> dict:
    """The Gemma 3 switches of TinyCausalConfig for an official Gemma3TextConfig."""
    if getattr(official, "use_bidirectional_attention", False):
        raise ConversionError(
            f"{src}: Gemma 3 with use_bidirectional_attention=True (EmbeddingGemma) is not supported; hf_tiny's causal "
            "family attends causally"
        )
    if official.attn_logit_softcapping is not None:
        raise ConversionError(
            f"{src}: attn_logit_softcapping={official.attn_logit_softcapping!r} is not supported (needs the raw "
            "attention scores); only None is"
        )
    return dict(
        attention_bias=official.attention_bias,
        qk_norm=True,
        rms_norm_unit_offset=True,
        scale_embeddings=True,
        sandwich_norms=True,
        query_pre_attn_scalar=official.query_pre_attn_scalar,
        final_logit_softcapping=official.final_logit_softcapping,
    )


def official_config_from_causal(config, official_class: str):
    """The official transformers config for an hf_tiny causal config (the type official_family picks)."""
    import transformers

    family = official_family(config)
    values = {name: getattr(config, name) for name in SHARED_FIELDS}
    values.update(hidden_act=config.hidden_act, rope_parameters=plain_dict(config.rope_parameters),
                  architectures=[official_class], **official_label_fields(config, official_class))
    values.update(_official_fields(config, family))
    if family == "gemma3_text":
        values["hidden_activation"] = values.pop("hidden_act")  # Gemma's name
    return getattr(transformers, CONFIG_CLASSES[family])(**values)


def _official_fields(config, family: str) -> dict:
    """What each official type holds beyond SHARED_FIELDS."""
    if family == deepseek.MODEL_TYPE:
        return deepseek.official_fields(config)
    if family in VARIANT_BY_TYPE:
        return VARIANT_BY_TYPE[family].official_fields(config)
    if family in MOE_MODEL_TYPES:
        values = official_moe_config_fields(config, family)
        if family == "mixtral":  # Mixtral's experts are intermediate_size wide; it has no dense layers
            values["intermediate_size"] = config.moe_intermediate_size
        elif family == "qwen2_moe":
            values["layer_types"] = list(config.layer_types)
        return values
    if family == "llama":
        return dict(head_dim=config.head_dim, attention_bias=config.attention_bias, mlp_bias=config.mlp_bias)
    if family == "mistral":
        return dict(head_dim=config.head_dim, sliding_window=config.sliding_window)
    if family == "gemma3_text":
        return dict(
            head_dim=config.head_dim, attention_bias=config.attention_bias, sliding_window=config.sliding_window,
            layer_types=list(config.layer_types), query_pre_attn_scalar=config.query_pre_attn_scalar or config.head_dim,
            final_logit_softcapping=config.final_logit_softcapping,
        )
    return _qwen_fields(config, family)


def _qwen_fields(config, family: str) -> dict:
    sliding = "sliding_attention" in config.layer_types
    values = dict(use_sliding_window=sliding, sliding_window=config.sliding_window if sliding else None,
                  layer_types=list(config.layer_types))
    if sliding:  # Qwen's own rule for the layer types, consistent with the list we pass
        values["max_window_layers"] = config.layer_types.index("sliding_attention")
    if family == "qwen3":
        return dict(values, head_dim=config.head_dim, attention_bias=config.attention_bias)
    if config.head_dim != config.hidden_size // config.num_attention_heads:
        raise ConversionError(
            f"Qwen2 has no head_dim field: head_dim={config.head_dim} must equal hidden_size // num_attention_heads"
        )
    return values


GEMMA3_SWITCHES = ("qk_norm", "rms_norm_unit_offset", "scale_embeddings", "sandwich_norms")
GEMMA3_ONLY = ("rms_norm_unit_offset", "scale_embeddings", "sandwich_norms", "query_pre_attn_scalar", "final_logit_softcapping")


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
    if config.mla_spec() is not None:
        deepseek.check_holds(config)
        return deepseek.MODEL_TYPE
    variant = variant_of(config)
    if variant is not None:
        variant.check_holds(config)
        return variant.MODEL_TYPE
    if config.moe_spec() is not None:
        return official_moe_family(config)
    return _dense_family(config)


def variant_of(config):
    """The 2025 family table that claims this config, or None."""
    return next((variant for variant in VARIANTS if variant.claims(config)), None)


def _dense_family(config) -> str:
    out_bias = config.attention_bias if config.attention_output_bias is None else config.attention_output_bias
    gemma_fields = {name: getattr(config, name) for name in GEMMA3_ONLY}
    if any(value not in (None, False) for value in gemma_fields.values()):
        switches = {name: getattr(config, name) for name in GEMMA3_SWITCHES}
        if not all(switches.values()) or config.mlp_bias or config.attention_bias != out_bias:
            raise ConversionError(
                "only Gemma 3 has Gemma's norms, embedding scale, query_pre_attn_scalar or logit soft-capping, and it "
                f"needs all of {switches} True, no MLP biases and one attention_bias for q/k/v/o; got mlp_bias="
                f"{config.mlp_bias}, attention_bias={config.attention_bias}, attention_output_bias="
                f"{config.attention_output_bias}"
            )
        return "gemma3_text"
    if config.qk_norm:
        if config.mlp_bias or config.attention_bias != out_bias:
            raise ConversionError(
                "Qwen3 (qk_norm=True) has no MLP biases and one attention_bias for q/k/v/o; got mlp_bias="
                f"{config.mlp_bias}, attention_bias={config.attention_bias}, attention_output_bias="
                f"{config.attention_output_bias}"
            )
        return "qwen3"
    if config.attention_bias and not out_bias and not config.mlp_bias:
        return "qwen2"  # biases on q/k/v only; any layer_types (max_window_layers)
    if len(set(config.layer_types)) > 1:
        raise ConversionError(
            "per-layer sliding windows (layer_types mixing full and sliding attention) exist officially in Qwen2 "
            "(q/k/v biases only), Qwen3 (qk_norm) and Gemma 3; this config has attention_bias="
            f"{config.attention_bias}, attention_output_bias={config.attention_output_bias}, "
            f"mlp_bias={config.mlp_bias}, qk_norm={config.qk_norm}"
        )
    if "sliding_attention" in config.layer_types:
        if config.attention_bias or out_bias or config.mlp_bias:
            raise ConversionError(
                "no official class has both a sliding_window on every layer and attention/MLP biases "
                f"(sliding_window={config.sliding_window}, attention_bias={config.attention_bias}, "
                f"mlp_bias={config.mlp_bias})"
            )
        return "mistral"
    if config.attention_bias == out_bias:
        return "llama"
    raise ConversionError(
        f"no official class has attention_bias={config.attention_bias}, attention_output_bias="
        f"{config.attention_output_bias}, mlp_bias={config.mlp_bias}"
    )
