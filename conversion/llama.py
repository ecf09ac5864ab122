"""Llama-family checkpoints <-> hf_tiny causal LM (`model_type: hf_tiny_causal`).

    python -m conversion llama SRC DST              -> hf_tiny folder
    python -m conversion llama SRC DST --reverse    hf_tiny causal folder -> official Llama / Mistral / Qwen2 /
                                                    Qwen3 / Gemma 3 folder

SRC may be
  (a) a Hugging Face folder of model_type llama, mistral, qwen2, qwen3 or gemma3_text (safetensors, sharded, or .bin
      read with weights_only): the tensor names are Llama's (Gemma 3 renames its sandwich norms, see
      GEMMA3_NORMS), strictly checked;
  (b) a .gguf file of one of GGUF_ARCHITECTURES (or a folder holding exactly one): transformers' own GGUF reader
      dequantizes it (and un-permutes Llama's q/k, removes Gemma's +1 on norms), exactly what
      `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` does; its tokenizer (with the chat template) is
      rebuilt from the GGUF and saved beside the weights;
  (c) Meta's original layout: consolidated.*.pth (one per model-parallel shard) + params.json (+ tokenizer.model).
      Meta's q/k rows interleave the two halves of each rotary pair; transformers' Llama expects them split into
      halves (rotate_half), hence the RoPE permutation below (the `permute` of transformers'
      convert_llama_weights_to_hf.py) and its inverse.
Parity with the official transformers model is measured while converting and written into the model card; an
fp32 row above its tolerance, or any row that is not finite, fails the conversion (DST is then left untouched).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from .errors import ConversionError
from .gguf_files import gguf_special_token_ids, load_gguf
from . import deepseek
from .keymap import KeyMap, Rule, Transform
from .moe import MOE_MODEL_TYPES, OFFICIAL_PREFIXES, moe_fields_from_official, moe_rules, official_moe_config_fields
from .moe import official_moe_family
from .pipeline import Family, Plan, ReversePlan, Source, entry_points
from .readers import load_checkpoint, official_config, require_model_type
from .writer import drop_tied_copies

HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text") + MOE_MODEL_TYPES + (deepseek.MODEL_TYPE,)
# GGUF general.architecture values read (transformers' GGUF loader turns "gemma3" into model_type gemma3_text)
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
# hf_tiny class -> (Auto class, pipeline tag, prefix of the base model's tensors)
OUR_CLASSES = {
    "TinyCausalForCausalLM": ("AutoModelForCausalLM", "text-generation", "model."),
    "TinyCausalForSequenceClassification": ("AutoModelForSequenceClassification", "text-classification", "model."),
    "TinyCausalModel": ("AutoModel", "feature-extraction", ""),
}
# official model type -> {hf_tiny class: official class}
OFFICIAL_CLASSES = {
    model_type: {
        "TinyCausalForCausalLM": f"{prefix}ForCausalLM",
        "TinyCausalForSequenceClassification": f"{prefix}ForSequenceClassification",
        "TinyCausalModel": f"{prefix}Model",
    }
    for model_type, prefix in (
        ("llama", "Llama"), ("mistral", "Mistral"), ("qwen2", "Qwen2"), ("qwen3", "Qwen3"), *OFFICIAL_PREFIXES.items(),
        (deepseek.MODEL_TYPE, "DeepseekV3"),
    )
}
OFFICIAL_CLASSES["gemma3_text"] = {  # Gemma3Model is the multimodal one
    "TinyCausalForCausalLM": "Gemma3ForCausalLM",
    "TinyCausalForSequenceClassification": "Gemma3TextForSequenceClassification",
    "TinyCausalModel": "Gemma3TextModel",
}
# Gemma 3's four block norms: official name -> ours (our post_attention_layernorm is the MLP's pre-norm, as in Llama)
GEMMA3_NORMS = {
    "input_layernorm": "input_layernorm",
    "post_attention_layernorm": "attn_output_layernorm",
    "pre_feedforward_layernorm": "post_attention_layernorm",
    "post_feedforward_layernorm": "mlp_output_layernorm",
}

# Per layer: the Llama names, shared by the official classes and hf_tiny.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")
# Old checkpoints carry the rotary buffers; the model recomputes them.
IGNORED_BUFFERS = (r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"(model\.)?rotary_emb\.inv_freq")

# Meta layout: tensors split across model-parallel shards along this dimension (None = replicated).
META_SHARD_DIMS = {
    "attention.wq.weight": 0,
    "attention.wk.weight": 0,
    "attention.wv.weight": 0,
    "attention.wo.weight": 1,
    "feed_forward.w1.weight": 0,
    "feed_forward.w2.weight": 1,
    "feed_forward.w3.weight": 0,
    "attention_norm.weight": None,
    "ffn_norm.weight": None,
    "norm.weight": None,
    "output.weight": 0,
}
META_IGNORED = (r"rope\.freqs",)
# Meta's params.json has no context length; these are the lengths transformers' converter assigns.
META_CONTEXT_LENGTH = {"llama3.1": 131072, "llama3": 8192, "codellama": 16384, "llama2": 4096}

# ----------------------------------------------------------------------------------------------------------------
# Key maps
# ----------------------------------------------------------------------------------------------------------------


def key_map(config, class_name: str = "TinyCausalForCausalLM", *, rope_interleave: bool = True) -> KeyMap:
    """Official (Llama naming) <-> hf_tiny key map of one class; biases follow the config. rope_interleave: an MLA
    (DeepSeek) checkpoint's rotary rows are interleaved pairs."""
    if class_name not in OUR_CLASSES:
        raise ConversionError(f"unsupported hf_tiny class {class_name!r}; supported: {', '.join(OUR_CLASSES)}")
    p = OUR_CLASSES[class_name][2]
    layer = f"{p}layers.{{i}}."
    rules: list = []
    embed = f"{p}embed_tokens.weight"
    mtp_layers = range(config.mtp_depth()) if class_name == "TinyCausalForCausalLM" else range(0)
    # MTP modules' copies of the embedding and the head (DeepSeek stores one per module; the model shares them)
    embed_copies = tuple(f"model.layers.{config.num_hidden_layers + k}.embed_tokens.weight" for k in mtp_layers)
    head_copies = tuple(f"model.layers.{config.num_hidden_layers + k}.shared_head.head.weight" for k in mtp_layers)
    if class_name == "TinyCausalForCausalLM" and config.tie_word_embeddings:
        rules.append(Rule((embed, *embed_copies, *head_copies), (embed, "lm_head.weight")))
    else:
        rules.append(Rule((embed, *embed_copies), embed))
    if config.moe_spec() is not None:  # dense and sparse layers differ: rules per layer index
        for i, kind in enumerate(config.mlp_layer_types):
            rules += _layer_rules(config, f"{p}layers.{i}.", kind, rope_interleave)
    else:
        rules += _layer_rules(config, layer, "dense", rope_interleave)
    rules.append((f"{p}norm.weight",) * 2)
    if class_name == "TinyCausalForCausalLM" and not config.tie_word_embeddings:
        rules.append(Rule(("lm_head.weight", *head_copies), "lm_head.weight"))
    if class_name == "TinyCausalForSequenceClassification":
        rules.append(("score.weight", "score.weight"))
    for k in mtp_layers:
        rules += _mtp_rules(config, k, rope_interleave)
    return KeyMap(rules, ignore=IGNORED_BUFFERS)


def _layer_rules(config, layer: str, mlp_kind: str, rope_interleave: bool) -> list:
    """The rules of one decoder layer (layer: its prefix, a template with {i} or a concrete one), the same names on
    both sides."""
    qkv_bias = config.attention_bias
    out_bias = config.attention_bias if config.attention_output_bias is None else config.attention_output_bias
    rules: list = []
    if config.mla_spec() is not None:
        rules += deepseek.attention_rules(config, layer, rope_interleave=rope_interleave)
    else:
        for name in ATTENTION_PROJECTIONS:
            rules.append((f"{layer}self_attn.{name}.weight",) * 2)
            if qkv_bias:
                rules.append((f"{layer}self_attn.{name}.bias",) * 2)
        rules.append((f"{layer}self_attn.o_proj.weight",) * 2)
        if out_bias:
            rules.append((f"{layer}self_attn.o_proj.bias",) * 2)
    if mlp_kind == "sparse":
        family = official_family(config)
        if family == deepseek.MODEL_TYPE:
            rules += deepseek.sparse_rules(config, layer)
        else:
            rules += moe_rules(config, family, layer)
    else:
        for name in MLP_PROJECTIONS:
            rules.append((f"{layer}mlp.{name}.weight",) * 2)
            if config.mlp_bias:
                rules.append((f"{layer}mlp.{name}.bias",) * 2)
    norms = GEMMA3_NORMS if config.sandwich_norms else {name: name for name in LAYER_NORMS}
    for official_name, our_name in norms.items():
        rules.append((f"{layer}{official_name}.weight", f"{layer}{our_name}.weight"))
    if config.qk_norm:
        rules += [(f"{layer}self_attn.q_norm.weight",) * 2, (f"{layer}self_attn.k_norm.weight",) * 2]
    return rules


def _mtp_rules(config, k: int, rope_interleave: bool) -> list:
    """Multi-Token Prediction module k: stored by DeepSeek as decoder layer num_hidden_layers + k (its block's
    tensors, plus enorm, hnorm, eh_proj, shared_head.norm, and copies of the embedding and head mapped above);
    ours is mtp.{k} (mtp.{k}.block the decoder block)."""
    official = f"model.layers.{config.num_hidden_layers + k}."
    ours = f"mtp.{k}."
    kind = "sparse" if config.moe_spec() is not None else "dense"
    rules = []
    for rule in _layer_rules(config, official, kind, rope_interleave):
        rule = rule if isinstance(rule, Rule) else Rule(*rule)
        target = tuple(key.replace(official, f"{ours}block.", 1) for key in rule.target)
        rules.append(Rule(rule.source, target, rule.transform, rule.optional))
    rules += [(f"{official}{name}.weight", f"{ours}{name}.weight") for name in ("enorm", "hnorm", "eh_proj")]
    rules.append((f"{official}shared_head.norm.weight", f"{ours}norm.weight"))
    return rules


def layer_counts(config) -> int | dict[str, int]:
    """The key map's placeholder counts: layers ({i}), and experts ({e}) in a MoE model."""
    if config.moe_spec() is not None:
        return {"i": config.num_hidden_layers, "e": config.num_local_experts}
    return config.num_hidden_layers


def rope_permutation(num_heads: int) -> Transform:
    """Meta's q/k row order (rotary pairs interleaved) <-> Llama's (pairs split into halves), per head."""

    def to_halves(weight: torch.Tensor) -> torch.Tensor:
        rows, cols = weight.shape
        return weight.view(num_heads, rows // num_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)

    def to_interleaved(weight: torch.Tensor) -> torch.Tensor:
        rows, cols = weight.shape
        return weight.view(num_heads, 2, rows // num_heads // 2, cols).transpose(1, 2).reshape(rows, cols)

    return Transform(f"rope_permutation({num_heads} heads)", to_halves, to_interleaved)


def meta_key_map(config) -> KeyMap:
    """Meta consolidated.*.pth naming <-> hf_tiny TinyCausalForCausalLM."""
    rules = [
        ("tok_embeddings.weight", "model.embed_tokens.weight"),
        ("norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        Rule(
            "layers.{i}.attention.wq.weight",
            "model.layers.{i}.self_attn.q_proj.weight",
            rope_permutation(config.num_attention_heads),
        ),
        Rule(
            "layers.{i}.attention.wk.weight",
            "model.layers.{i}.self_attn.k_proj.weight",
            rope_permutation(config.num_key_value_heads),
        ),
        ("layers.{i}.attention.wv.weight", "model.layers.{i}.self_attn.v_proj.weight"),
        ("layers.{i}.attention.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
        ("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
        ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
        ("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
        ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
        ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ]
    return KeyMap(rules, ignore=META_IGNORED)


# ----------------------------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------------------------


def causal_config_from_official(official, *, src):
    """TinyCausalConfig equivalent to an official Llama / Mistral / Qwen2 config; variants without an hf_tiny
    equivalent are errors naming the field."""
    model_type = official.model_type
    values = {
        name: getattr(official, name)
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
            "initializer_range",
            "rms_norm_eps",
            "attention_dropout",
            "tie_word_embeddings",
            "pad_token_id",
            "bos_token_id",
            "eos_token_id",
        )
    }
    values["hidden_act"] = getattr(official, "hidden_activation", None) or official.hidden_act  # Gemma's name
    values["head_dim"] = getattr(official, "head_dim", None) or official.hidden_size // official.num_attention_heads
    values["rope_parameters"] = _plain(official.rope_parameters or {})
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
    if values.get("pad_token_id") is not None and not 0 <= values["pad_token_id"] < values["vocab_size"]:
        values["pad_token_id"] = None  # some checkpoints store pad_token_id=-1 for "none"
    return build_causal_config(values, official, src=src)


LABEL_FIELDS = ("id2label", "label2id", "problem_type")


def build_causal_config(values: dict, official, *, src):
    """TinyCausalConfig(**values) with the official config's label fields; invalid values are a ConversionError
    naming the source and its model type."""
    from hf_tiny import TinyCausalConfig

    values = dict(values)
    for label_field in LABEL_FIELDS:
        if getattr(official, label_field, None) is not None:
            values[label_field] = getattr(official, label_field)
    try:
        return TinyCausalConfig(**values)
    except (TypeError, ValueError) as error:
        raise ConversionError(f"{src}: this {official.model_type} config has no hf_tiny equivalent: {error}") from error


def _plain(value):
    """rope_parameters as plain nested dicts (copied)."""
    return {k: _plain(v) for k, v in value.items()} if isinstance(value, dict) else value


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
    values = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.initializer_range,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters=_plain(config.rope_parameters),
        attention_dropout=config.attention_dropout,
        tie_word_embeddings=config.tie_word_embeddings,
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        architectures=[official_class],
    )
    if config.id2label is not None and official_class.endswith("ForSequenceClassification"):
        values.update(id2label=config.id2label, label2id=config.label2id, problem_type=config.problem_type)
    if family == deepseek.MODEL_TYPE:
        return transformers.DeepseekV3Config(**values, **deepseek.official_fields(config))
    if family in MOE_MODEL_TYPES:
        values.update(official_moe_config_fields(config, family))
        if family == "mixtral":  # Mixtral's experts are intermediate_size wide; it has no dense layers
            values["intermediate_size"] = config.moe_intermediate_size
        elif family == "qwen2_moe":
            values["layer_types"] = list(config.layer_types)
        return getattr(transformers, f"{OFFICIAL_PREFIXES[family]}Config")(**values)
    if family == "llama":
        values.update(head_dim=config.head_dim, attention_bias=config.attention_bias, mlp_bias=config.mlp_bias)
        return transformers.LlamaConfig(**values)
    if family == "mistral":
        values.update(head_dim=config.head_dim, sliding_window=config.sliding_window)
        return transformers.MistralConfig(**values)
    if family == "gemma3_text":
        values.pop("hidden_act")
        values.update(
            head_dim=config.head_dim, hidden_activation=config.hidden_act, attention_bias=config.attention_bias,
            sliding_window=config.sliding_window, layer_types=list(config.layer_types),
            query_pre_attn_scalar=config.query_pre_attn_scalar or config.head_dim,
            final_logit_softcapping=config.final_logit_softcapping,
        )
        return transformers.Gemma3TextConfig(**values)
    sliding = "sliding_attention" in config.layer_types
    values.update(
        use_sliding_window=sliding, sliding_window=config.sliding_window if sliding else None,
        layer_types=list(config.layer_types),
    )
    if sliding:  # Qwen's own rule for the layer types, consistent with the list we pass
        values["max_window_layers"] = config.layer_types.index("sliding_attention")
    if family == "qwen3":
        values.update(head_dim=config.head_dim, attention_bias=config.attention_bias)
        return transformers.Qwen3Config(**values)
    if config.head_dim != config.hidden_size // config.num_attention_heads:
        raise ConversionError(
            f"Qwen2 has no head_dim field: head_dim={config.head_dim} must equal hidden_size // num_attention_heads"
        )
    return transformers.Qwen2Config(**values)


GEMMA3_SWITCHES = ("qk_norm", "rms_norm_unit_offset", "scale_embeddings", "sandwich_norms")
GEMMA3_ONLY = ("rms_norm_unit_offset", "scale_embeddings", "sandwich_norms", "query_pre_attn_scalar", "final_logit_softcapping")


def official_family(config) -> str:
    """Which official model type can hold an hf_tiny causal config."""
    from .phi3 import needs_phi3

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
    if config.moe_spec() is not None:
        return official_moe_family(config)
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


def meta_config(params: dict, state: dict, *, src):
    """TinyCausalConfig of a Meta checkpoint: params.json for the architecture, the tensors for the sizes."""
    from hf_tiny import TinyCausalConfig

    params = params.get("model", params)
    for field in ("dim", "n_layers", "n_heads", "norm_eps"):
        if field not in params:
            raise ConversionError(f"{src}/params.json lacks the field {field!r}; it has {sorted(params)}")
    for key in ("tok_embeddings.weight", "layers.0.feed_forward.w1.weight"):
        if key not in state:
            raise ConversionError(f"{src}: consolidated checkpoint lacks the tensor {key!r}")
    vocab_size = state["tok_embeddings.weight"].shape[0]
    theta = float(params.get("rope_theta", 10000.0))
    if params.get("use_scaled_rope"):
        # Llama 3.1's apply_scaling(): low/high frequency factors 1 and 4 around an 8192-token original context.
        rope = {
            "rope_type": "llama3",
            "rope_theta": theta,
            "factor": float(params.get("rope_scaling_factor", 8.0)),
            "low_freq_factor": 1.0,
            "high_freq_factor": float(params.get("high_freq_factor", 4.0)),
            "original_max_position_embeddings": 8192,
        }
        version = "llama3.1"
    else:
        rope = {"rope_type": "default", "rope_theta": theta}
        version = "llama3" if vocab_size >= 128000 else ("codellama" if theta > 10000.0 else "llama2")
    max_positions = params.get("max_seq_len") or META_CONTEXT_LENGTH[version]
    bos, eos = (128000, 128001) if vocab_size >= 128000 else (1, 2)
    try:
        return TinyCausalConfig(
            vocab_size=vocab_size,
            hidden_size=params["dim"],
            intermediate_size=state["layers.0.feed_forward.w1.weight"].shape[0],
            num_hidden_layers=params["n_layers"],
            num_attention_heads=params["n_heads"],
            num_key_value_heads=params.get("n_kv_heads") or params["n_heads"],
            max_position_embeddings=max_positions,
            rms_norm_eps=params["norm_eps"],
            rope_parameters=rope,
            tie_word_embeddings=False,
            bos_token_id=bos if bos < vocab_size else None,
            eos_token_id=eos if eos < vocab_size else None,
        )
    except (TypeError, ValueError) as error:
        raise ConversionError(f"{src}/params.json describes no valid model: {error}") from error


# ----------------------------------------------------------------------------------------------------------------
# Reading the three source kinds
# ----------------------------------------------------------------------------------------------------------------


def detect_source(src: Path) -> tuple[str, Path]:
    """("gguf", file) | ("meta", folder) | ("hf", folder)."""
    if not src.exists():
        raise ConversionError(f"source {src} does not exist")
    if src.is_file():
        if src.suffix == ".gguf":
            return "gguf", src
        raise ConversionError(f"source {src} is a file but not a .gguf; pass a checkpoint folder or a .gguf file")
    if (src / "params.json").is_file() and sorted(src.glob("consolidated.*.pth")):
        return "meta", src
    if (src / "config.json").is_file():
        return "hf", src
    ggufs = sorted(src.glob("*.gguf"))
    if len(ggufs) == 1:
        return "gguf", ggufs[0]
    if len(ggufs) > 1:
        raise ConversionError(
            f"{src} holds {len(ggufs)} GGUF files ({', '.join(p.name for p in ggufs)}); pass the one to convert"
        )
    raise ConversionError(
        f"{src} is not a Llama checkpoint: expected config.json (Hugging Face), params.json + consolidated.*.pth "
        "(Meta), or a .gguf file"
    )


def merge_meta_shards(shards: list[dict], params: dict, *, src) -> dict:
    """One state dict from Meta's model-parallel shards (each holds a slice of every split tensor)."""
    if len(shards) == 1:
        return dict(shards[0])
    keys = set(shards[0])
    for number, shard in enumerate(shards[1:], start=1):
        if set(shard) != keys:
            raise ConversionError(
                f"{src}: consolidated.{number:02d}.pth holds different tensor names than consolidated.00.pth"
            )
    dim = params.get("model", params).get("dim")
    merged = {}
    for key in sorted(keys):
        pieces = [shard[key] for shard in shards]
        suffix = re.sub(r"^layers\.\d+\.", "", key)
        if key == "tok_embeddings.weight":
            _check_shard_ranks(pieces, key, 2, src)
            # Llama 1/2 split the embedding width across shards, Llama 3 the vocabulary.
            merged[key] = _concatenate_shards(pieces, 0 if pieces[0].shape[1] == dim else 1, key, src)
        elif suffix in META_SHARD_DIMS and META_SHARD_DIMS[suffix] is not None:
            _check_shard_ranks(pieces, key, META_SHARD_DIMS[suffix] + 1, src)
            merged[key] = _concatenate_shards(pieces, META_SHARD_DIMS[suffix], key, src)
        else:
            for number, piece in enumerate(pieces[1:], start=1):
                if piece.shape != pieces[0].shape or not torch.equal(piece, pieces[0]):
                    raise ConversionError(f"{src}: replicated tensor {key!r} differs between shard 00 and shard {number:02d}")
            merged[key] = pieces[0]
    return merged


def _shapes(pieces) -> str:
    return ", ".join(f"shard {number:02d}: {tuple(piece.shape)}" for number, piece in enumerate(pieces))


def _check_shard_ranks(pieces: list, key: str, min_dims: int, src) -> None:
    for number, piece in enumerate(pieces):
        if piece.dim() < min_dims:
            raise ConversionError(
                f"{src}: tensor {key!r} in consolidated.{number:02d}.pth is {piece.dim()}-D with shape "
                f"{tuple(piece.shape)}; a model-parallel shard of it needs at least {min_dims} dimensions"
            )


def _concatenate_shards(pieces: list, dim: int, key: str, src) -> torch.Tensor:
    """Joins the slices of a split tensor along dim; every other dimension must agree."""
    others = {tuple(size for axis, size in enumerate(piece.shape) if axis != dim) for piece in pieces}
    if len({piece.dim() for piece in pieces}) != 1 or len(others) != 1:
        raise ConversionError(
            f"{src}: the shards of tensor {key!r} do not concatenate along dimension {dim} ({_shapes(pieces)})"
        )
    return torch.cat(pieces, dim=dim)


def _read_params(src: Path) -> dict:
    params_path = src / "params.json"
    try:
        params = json.loads(params_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConversionError(f"cannot read {params_path}: {error}") from error
    if not isinstance(params, dict):
        raise ConversionError(f"{params_path} holds a JSON {type(params).__name__}, expected an object")
    return params


def _class_for_official(architectures, state: dict, *, src) -> str:
    named = (architectures or [None])[0]
    if named:
        for classes in OFFICIAL_CLASSES.values():
            for ours, official in classes.items():
                if named == official:
                    return ours
        raise ConversionError(
            f"{src}: architecture {named!r} is not supported; supported: "
            + ", ".join(official for classes in OFFICIAL_CLASSES.values() for official in classes.values())
        )
    if "score.weight" in state:
        return "TinyCausalForSequenceClassification"
    if "embed_tokens.weight" in state:
        return "TinyCausalModel"
    return "TinyCausalForCausalLM"


def _official_class_name(config, class_name: str) -> str:
    return OFFICIAL_CLASSES[official_family(config)][class_name]


UNTIED_HINT = "; set tie_word_embeddings=false in config.json if the head is really untied"
OFFICIAL_NOTES = {
    "gguf": "`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` on the same file",
    "hf": "`from_pretrained` on the source folder",
    "meta": "`LlamaForCausalLM` holding the same weights in the Hugging Face layout (transformers has no loader for "
    "Meta's layout; the RoPE permutation itself is checked by the test suite)",
}


def class_for_architecture(architectures, official_classes: dict[str, str], default: str, *, src) -> str:
    """The hf_tiny class of config.json's `architectures[0]` (default when it names none)."""
    named = (architectures or [default])[0]
    for ours, official in official_classes.items():
        if named == official:
            return ours
    raise ConversionError(
        f"{src}: architecture {named!r} is not supported; supported: {', '.join(official_classes.values())}"
    )


class CausalFamily(Family):
    """What every family converting to the hf_tiny causal LM shares: its classes, and GGUF sources (read with
    transformers' dequantization, the official side loaded with `gguf_file=`, the tokenizer rebuilt from it)."""

    config_class = "TinyCausalConfig"
    classes = {name: (auto, tag) for name, (auto, tag, _prefix) in OUR_CLASSES.items()}
    default_class = "TinyCausalForCausalLM"
    modality = "causal"

    def read_gguf(self, path: Path) -> Source:
        raw, state = load_gguf(path, expected_architecture=self.gguf_architectures)
        require_model_type(raw, self.model_types, src=path)
        return Source(path, path.parent, "gguf", raw, state, f"the GGUF file `{path.name}` (dequantized to float32)")

    def official_model(self, source: Source, plan: Plan):
        if source.kind == "gguf":
            import transformers

            return transformers.AutoModelForCausalLM.from_pretrained(
                str(source.folder), gguf_file=source.path.name, dtype=torch.float32
            )
        return super().official_model(source, plan)

    def write_side_files(self, source: Source, plan: Plan, tmp: Path) -> str:
        if source.kind != "gguf":
            return super().write_side_files(source, plan, tmp)
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(source.folder), gguf_file=source.path.name)
        except Exception as error:  # the weights are still usable; say so on the card
            return f"the GGUF tokenizer could not be rebuilt ({type(error).__name__}: {error})"
        padding = gguf_special_token_ids(source.path).get("padding")
        if tokenizer.pad_token is None and padding is not None:
            # transformers before 5.2x leaves it unset when rebuilding from GGUF (the metadata names it)
            tokenizer.pad_token = tokenizer.convert_ids_to_tokens(padding)
        tokenizer.save_pretrained(str(tmp))
        return "rebuilt from the GGUF metadata"


class LlamaFamily(CausalFamily):
    name = "llama"
    model_types = HF_MODEL_TYPES
    gguf_architectures = GGUF_ARCHITECTURES
    card_family = ("hf_tiny_causal (Llama-style decoder: Llama, Mistral, Qwen2, Qwen3, Gemma 3, Mixtral, Qwen2-MoE, "
                   "Qwen3-MoE, DeepSeek-V3)")
    tags = ("llama", "causal-lm", "text-generation")

    def read(self, src: Path) -> Source:
        kind, path = detect_source(src)
        if kind == "hf":
            source = super().read(path)
            source.description = f"the Hugging Face {source.raw_config['model_type']} folder `{path.resolve().name}`"
            return source
        if kind == "gguf":
            return self.read_gguf(path)
        params = _read_params(path)
        files = sorted(path.glob("consolidated.*.pth"))
        state = merge_meta_shards([load_checkpoint(f) for f in files], params, src=path)
        return Source(path, path, kind, params, state, f"the Meta consolidated checkpoint ({len(files)} shard(s))")

    def plan(self, source: Source) -> Plan:
        if source.kind == "meta":
            config = meta_config(source.raw_config, source.state, src=source.path)
            class_name, mapping, state = "TinyCausalForCausalLM", meta_key_map(config), source.state
        else:
            config = causal_config_from_official(official_config(source.raw_config, src=source.path), src=source.path)
            class_name = "TinyCausalForCausalLM" if source.kind == "gguf" else _class_for_official(
                source.raw_config.get("architectures"), source.state, src=source.path)
            state = source.state
            if class_name == "TinyCausalForCausalLM" and config.tie_word_embeddings:
                state = drop_tied_copies(state, "model.embed_tokens.weight", ["lm_head.weight"], src=source.path,
                                         hint=UNTIED_HINT)
            notes = []
            if config.mtp_depth():
                config, mtp_note = deepseek.mtp_layers_held(config, state, class_name, src=source.path)
                notes.append(mtp_note)
            mapping = key_map(config, class_name, rope_interleave=source.raw_config.get("rope_interleave", True))
        official_class = _official_class_name(config, class_name)
        note = f"The official side is {OFFICIAL_NOTES[source.kind]}."
        return Plan(config, class_name, official_class, mapping, layer_counts(config), state,
                    notes=[note, *([] if source.kind == "meta" else notes)], tags=(official_family(config),))

    def official_model(self, source: Source, plan: Plan):
        import transformers

        if source.kind != "meta":
            return super().official_model(source, plan)
        official_config_ = official_config_from_causal(plan.config, plan.official_class)
        with torch.device("meta"):
            model = getattr(transformers, plan.official_class)(official_config_)
        state = plan.key_map.to_target(plan.state, num_layers=plan.num_layers)
        model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True, assign=True)
        # the rotary buffers are not in the state dict: build them for real (they are all that is left on meta)
        model.model.rotary_emb = type(model.model.rotary_emb)(config=official_config_)
        model.tie_weights()
        return model

    def reverse(self, config, our_class: str, src: Path) -> ReversePlan:
        official_class = _official_class_name(config, our_class)
        mtp = range(config.num_hidden_layers, config.num_hidden_layers + config.mtp_depth())
        return ReversePlan(official_class, official_config_from_causal(config, official_class),
                           key_map(config, our_class), layer_counts(config),
                           stored_as_loaded=config.moe_spec() is None,
                           dropped_by_official=tuple(rf"model\.layers\.{index}\..*" for index in mtp))


FAMILY = LlamaFamily()
convert, convert_back = entry_points(FAMILY)
