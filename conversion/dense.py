"""The dense official types of the Llama block (Llama, Mistral, Qwen2, Qwen3, Gemma 3) as CausalVariant tables, and
the rule that picks one of them for an hf_tiny causal config on the way back (`dense_family`)."""

from __future__ import annotations

from .causal_variant import CausalVariant, llama_named_classes
from .errors import ConversionError

# Gemma 3's four block norms: official name -> ours (our post_attention_layernorm is the MLP's pre-norm, as in Llama)
GEMMA3_NORMS = {
    "input_layernorm": "input_layernorm",
    "post_attention_layernorm": "attn_output_layernorm",
    "pre_feedforward_layernorm": "post_attention_layernorm",
    "post_feedforward_layernorm": "mlp_output_layernorm",
}
GEMMA3_SWITCHES = ("qk_norm", "rms_norm_unit_offset", "scale_embeddings", "sandwich_norms")
GEMMA3_ONLY = ("rms_norm_unit_offset", "scale_embeddings", "sandwich_norms", "query_pre_attn_scalar", "final_logit_softcapping")


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


def _official_gemma3_fields(config) -> dict:
    return dict(
        head_dim=config.head_dim, attention_bias=config.attention_bias, sliding_window=config.sliding_window,
        layer_types=list(config.layer_types), query_pre_attn_scalar=config.query_pre_attn_scalar or config.head_dim,
        final_logit_softcapping=config.final_logit_softcapping,
    )


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


LLAMA = CausalVariant(
    "llama", "LlamaConfig", llama_named_classes("Llama"),
    fields_from_official=lambda official, *, src: dict(attention_bias=official.attention_bias, mlp_bias=official.mlp_bias),
    official_fields=lambda config: dict(head_dim=config.head_dim, attention_bias=config.attention_bias,
                                        mlp_bias=config.mlp_bias),
)
MISTRAL = CausalVariant(
    "mistral", "MistralConfig", llama_named_classes("Mistral"),
    official_fields=lambda config: dict(head_dim=config.head_dim, sliding_window=config.sliding_window),
)
QWEN2 = CausalVariant(  # biases on q/k/v, none on o_proj
    "qwen2", "Qwen2Config", llama_named_classes("Qwen2"),
    fields_from_official=lambda official, *, src: dict(attention_bias=True, attention_output_bias=False),
    official_fields=lambda config: _qwen_fields(config, "qwen2"),
)
QWEN3 = CausalVariant(  # one attention_bias for q/k/v/o
    "qwen3", "Qwen3Config", llama_named_classes("Qwen3"),
    fields_from_official=lambda official, *, src: dict(attention_bias=official.attention_bias, qk_norm=True),
    official_fields=lambda config: _qwen_fields(config, "qwen3"),
)
GEMMA3 = CausalVariant(
    "gemma3_text", "Gemma3TextConfig",
    {"TinyCausalForCausalLM": "Gemma3ForCausalLM",  # Gemma3Model is the multimodal one
     "TinyCausalForSequenceClassification": "Gemma3TextForSequenceClassification", "TinyCausalModel": "Gemma3TextModel"},
    fields_from_official=_gemma3_fields, official_fields=_official_gemma3_fields,
    renamed_fields={"hidden_act": "hidden_activation"}, layer_norms=GEMMA3_NORMS,
)
VARIANTS = (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA3)


def dense_family(config) -> str:
    """The dense official type that holds an hf_tiny config no CLAIMING variant took, or an error naming why none
    does."""
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
            "(q/k/v biases only), Qwen3 (qk_norm), Gemma 3 and SmolLM3 (one bias switch for q/k/v/o); this config has "
            f"attention_bias={config.attention_bias}, attention_output_bias={config.attention_output_bias}, "
            f"mlp_bias={config.mlp_bias}, qk_norm={config.qk_norm}"
        )
    if "sliding_attention" in config.layer_types:
        if config.attention_bias or out_bias or config.mlp_bias:
            raise ConversionError(
                "no official class has both a sliding_window on every layer and attention/MLP biases other than "
                f"SmolLM3's one switch for q/k/v/o (sliding_window={config.sliding_window}, attention_bias="
                f"{config.attention_bias}, attention_output_bias={config.attention_output_bias}, mlp_bias="
                f"{config.mlp_bias})"
            )
        return "mistral"
    if config.attention_bias == out_bias:
        return "llama"
    raise ConversionError(
        f"no official class has attention_bias={config.attention_bias}, attention_output_bias="
        f"{config.attention_output_bias}, mlp_bias={config.mlp_bias}"
    )
