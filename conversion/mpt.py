"""MPT (transformers `model_type: mpt`) <-> hf_tiny causal LM with ALiBi.

    python -m conversion mpt SRC DST              official MPT folder -> hf_tiny folder
    python -m conversion mpt SRC DST --reverse    hf_tiny causal folder (position_embedding_type 'alibi') -> MPT

MPT is the causal family's block with these parts (TinyCausalConfig): ALiBi instead of position embeddings
(slopes from alibi_bias_max), LayerNorm without bias (norm_bias=False), a plain GELU MLP 4 x wide (official
transformers builds 4 x d_model whatever expansion_ratio says, so other ratios are refused),
no biases anywhere, a tied head. Its layout differs only in names and in `attn.Wqkv`, q, k and v fused into one
projection (split / joined by a transform).
"""

from __future__ import annotations

import torch

from hf_tiny.configuration_causal import field_value

from .errors import ConversionError
from .keymap import KeyMap, Rule, Transform
from .causal import (
    OUR_CLASSES, SingleTypeFamily, build_causal_config, embedding_rule, head_rules, label_fields, require_class,
)
from .pipeline import entry_points

# hf_tiny class -> (official class, prefix of the official base model's tensors)
OFFICIAL_CLASSES = {
    "TinyCausalForCausalLM": ("MptForCausalLM", "transformer."),
    "TinyCausalForSequenceClassification": ("MptForSequenceClassification", "transformer."),
    "TinyCausalModel": ("MptModel", ""),
}
LAYER_MODULES = {
    "norm_1": "input_layernorm",
    "attn.out_proj": "self_attn.o_proj",
    "norm_2": "post_attention_layernorm",
    "ffn.up_proj": "mlp.up_proj",
    "ffn.down_proj": "mlp.down_proj",
}
QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
# TinyCausalConfig fields every MPT has
MPT_STRUCTURE = dict(
    position_embedding_type="alibi", norm_type="layernorm", norm_bias=False, mlp_gated=False, hidden_act="gelu",
    attention_bias=False, attention_output_bias=None, mlp_bias=False, qk_norm=False, rms_norm_unit_offset=False,
    scale_embeddings=False, sandwich_norms=False, final_logit_softcapping=None, query_pre_attn_scalar=None,
    alibi_bias_max=8.0, tie_word_embeddings=True, num_local_experts=0, kv_lora_rank=None, num_nextn_predict_layers=0,
)


def fused_qkv(hidden: int) -> Transform:
    """Wqkv.weight [3 * hidden, hidden] <-> q, k, v weights [hidden, hidden] each."""

    def split(weight: torch.Tensor):
        if weight.shape[0] != 3 * hidden:
            raise ConversionError(f"attn.Wqkv.weight has shape {tuple(weight.shape)}: its rows must be 3 x d_model = {3 * hidden}")
        return tuple(part.contiguous() for part in weight.split(hidden, dim=0))

    return Transform(f"split_fused_qkv({hidden})", split, lambda q, k, v: torch.cat((q, k, v), dim=0))


def key_map(config, class_name: str = "TinyCausalForCausalLM") -> KeyMap:
    """MPT's head is always tied (an untied config is refused both ways before a key map is made)."""
    require_class(class_name, OFFICIAL_CLASSES)
    official_prefix = OFFICIAL_CLASSES[class_name][1]
    ours = OUR_CLASSES[class_name][2]
    source, target = f"{official_prefix}blocks.{{i}}.", f"{ours}layers.{{i}}."
    rules: list = [
        embedding_rule(config, class_name, f"{official_prefix}wte.weight"),
        Rule(f"{source}attn.Wqkv.weight", tuple(f"{target}{name}.weight" for name in QKV), fused_qkv(config.hidden_size)),
        (f"{official_prefix}norm_f.weight", f"{ours}norm.weight"),
    ]
    rules += [(f"{source}{official}.weight", f"{target}{mine}.weight") for official, mine in LAYER_MODULES.items()]
    return KeyMap(rules + head_rules(config, class_name))


def causal_config_from_mpt(official, *, src):
    attn = official.attn_config
    unsupported = {
        name: value for name, value, supported in (
            ("attn_config.alibi", attn.alibi, True),
            ("attn_config.clip_qkv", attn.clip_qkv, None),
            ("attn_config.qk_ln", attn.qk_ln, False),
            ("attn_config.softmax_scale", attn.softmax_scale, None),
            ("attn_config.prefix_lm", attn.prefix_lm, False),
            ("attn_config.alibi_bias_max", attn.alibi_bias_max, 8),
            ("logit_scale", official.logit_scale, None),
            ("embedding_fraction", official.embedding_fraction, 1.0),
            ("no_bias", official.no_bias, True),
            # official MptMLP is 4 x d_model wide whatever expansion_ratio says
            ("expansion_ratio", official.expansion_ratio, 4),
        ) if value != supported
    }
    if unsupported:
        raise ConversionError(
            f"{src}: MPT options official transformers does not implement (or hf_tiny does not) are set: {unsupported}; "
            "supported: ALiBi with alibi_bias_max 8, no clip_qkv / qk_ln / softmax_scale / prefix_lm / logit_scale, "
            "embedding_fraction 1, no_bias, expansion_ratio 4"
        )
    if official.d_model % official.n_heads:
        raise ConversionError(f"{src}: d_model={official.d_model} is not divisible by n_heads={official.n_heads}")
    values = dict(
        MPT_STRUCTURE,
        vocab_size=official.vocab_size,
        hidden_size=official.d_model,
        intermediate_size=4 * official.d_model,
        num_hidden_layers=official.n_layers,
        num_attention_heads=official.n_heads,
        max_position_embeddings=official.max_seq_len,
        initializer_range=official.initializer_range,
        layer_norm_eps=official.layer_norm_epsilon,
        # MPT drops out attention weights, and the attention and MLP outputs, all with attn_pdrop
        attention_dropout=attn.attn_pdrop,
        hidden_dropout=attn.attn_pdrop,
        pad_token_id=official.pad_token_id,
        use_padding_idx=False,  # official GPT-2 / MPT embeddings have no padding row
        bos_token_id=official.bos_token_id,
        eos_token_id=official.eos_token_id,
    )
    if not official.tie_word_embeddings:
        raise ConversionError(f"{src}: MptForCausalLM ties its head to wte; tie_word_embeddings=False is not supported")
    return build_causal_config(values, official, src=src)


def mpt_config_from_causal(config, official_class: str):
    import transformers

    differing = {k: field_value(config, k) for k, v in MPT_STRUCTURE.items() if field_value(config, k) != v}
    if config.num_key_value_heads != config.num_attention_heads or config.head_dim * config.num_attention_heads != config.hidden_size:
        differing["num_key_value_heads / head_dim"] = (config.num_key_value_heads, config.head_dim)
    if config.intermediate_size != 4 * config.hidden_size:
        differing["intermediate_size"] = f"{config.intermediate_size} (official MPT's MLP is 4 x hidden_size)"
    if "sliding_attention" in config.layer_types or config.embedding_dropout or config.hidden_dropout != config.attention_dropout:
        differing["layer_types / dropouts"] = (sorted(set(config.layer_types)), config.embedding_dropout,
                                               config.hidden_dropout, config.attention_dropout)
    if differing:
        raise ConversionError(f"MPT cannot hold this hf_tiny config: it differs from MPT's structure in {differing}")
    values = dict(
        vocab_size=config.vocab_size, d_model=config.hidden_size, n_layers=config.num_hidden_layers,
        n_heads=config.num_attention_heads, expansion_ratio=4,
        max_seq_len=config.max_position_embeddings, initializer_range=config.initializer_range,
        layer_norm_epsilon=config.layer_norm_eps, attn_config={"alibi": True, "attn_pdrop": config.attention_dropout},
        no_bias=True, tie_word_embeddings=True, pad_token_id=config.pad_token_id, bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id, architectures=[official_class],
        **label_fields(config),
    )
    return transformers.MptConfig(**values)


class MptFamily(SingleTypeFamily):
    official_classes = {ours: official for ours, (official, _prefix) in OFFICIAL_CLASSES.items()}
    word_embeddings = "transformer.wte.weight"
    config_from_official = staticmethod(causal_config_from_mpt)
    official_config_of = staticmethod(mpt_config_from_causal)
    key_map = staticmethod(key_map)


FAMILY = MptFamily("mpt", "an MPT", "hf_tiny_causal (decoder block with MPT's parts: ALiBi, bias-free LayerNorm, GELU MLP)",
                   gguf=False, tags=("alibi",), markers=("transformer.blocks.0.attn.Wqkv.weight",))
convert, convert_back = entry_points(FAMILY)
