"""Phi-3 / Phi-4-mini (transformers `model_type: phi3`) <-> hf_tiny causal LM.

    python -m conversion [phi3] SRC DST              official Phi-3 folder or phi3 GGUF -> hf_tiny folder
    python -m conversion [phi3] SRC DST --reverse    hf_tiny causal folder -> Phi-3 folder

A Phi-3 block is the Llama block; what differs is named here:
  * `self_attn.qkv_proj` holds q, k and v stacked on the output dimension (sizes heads x head_dim, then
    kv_heads x head_dim twice), `mlp.gate_up_proj` the gate and up projections (gate first): split / joined by
    transforms, bit for bit;
  * RoPE may rotate only part of each head (`partial_rotary_factor`, Phi-4-mini) and may be "longrope" (Phi-3
    128k: per-frequency short / long factors); both are rope options of the causal family;
  * `resid_pdrop` is the residual dropout (hidden_dropout); official Phi-3 never applies `embd_pdrop`, so it is
    not carried.
A folder converted back with --reverse and no family named goes to Phi-3 only when it needs Phi-3 (partial rotary, or
longrope that drops its cache as generation passes original_max_position_embeddings: a Llama-family source's
longrope keeps it, `longrope_cache_kept`); `python -m conversion phi3 SRC DST --reverse` writes Phi-3 for any config
Phi-3 can hold.
"""

from __future__ import annotations

import torch

from .errors import ConversionError
from .keymap import KeyMap, Rule, Transform
from .causal import (
    IGNORED_BUFFERS, OUR_CLASSES, SHARED_FIELDS, SingleTypeFamily, build_causal_config, embedding_rule, head_rules,
    label_fields, require_class,
)
from .pipeline import Source, entry_points

OFFICIAL_CLASSES = {
    "TinyCausalForCausalLM": "Phi3ForCausalLM",
    "TinyCausalForSequenceClassification": "Phi3ForSequenceClassification",
    "TinyCausalModel": "Phi3Model",
}
PER_LAYER = {  # official module -> ours (weights only: Phi-3 has no biases)
    "self_attn.o_proj": "self_attn.o_proj",
    "mlp.down_proj": "mlp.down_proj",
    "input_layernorm": "input_layernorm",
    "post_attention_layernorm": "post_attention_layernorm",
}
# TinyCausalConfig fields Phi-3 fixes (the reverse direction requires them)
PHI3_STRUCTURE = dict(
    position_embedding_type="rope", norm_type="rmsnorm", mlp_gated=True, attention_bias=False,
    attention_output_bias=None, mlp_bias=False, qk_norm=False, rms_norm_unit_offset=False, scale_embeddings=False,
    sandwich_norms=False, query_pre_attn_scalar=None, final_logit_softcapping=None, embedding_dropout=0.0,
)


def split_rows(name: str, sizes: tuple[int, ...]) -> Transform:
    """One weight whose output rows stack several projections <-> the projections, split in order."""

    def split(weight: torch.Tensor):
        if weight.shape[0] != sum(sizes):
            raise ConversionError(
                f"{name} has shape {tuple(weight.shape)}: its {weight.shape[0]} rows must be {' + '.join(map(str, sizes))}"
                f" = {sum(sizes)}"
            )
        return tuple(part.contiguous() for part in weight.split(sizes, dim=0))

    return Transform(f"split_rows({name}: {', '.join(map(str, sizes))})", split, lambda *parts: torch.cat(parts, dim=0))


def key_map(config, class_name: str = "TinyCausalForCausalLM") -> KeyMap:
    require_class(class_name, OFFICIAL_CLASSES)
    p = OUR_CLASSES[class_name][2]
    layer = f"{p}layers.{{i}}."
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    rules: list = [
        embedding_rule(config, class_name, f"{p}embed_tokens.weight"),
        Rule(f"{layer}self_attn.qkv_proj.weight",
             tuple(f"{layer}self_attn.{name}.weight" for name in ("q_proj", "k_proj", "v_proj")),
             split_rows("qkv_proj.weight", (q_rows, kv_rows, kv_rows))),
        Rule(f"{layer}mlp.gate_up_proj.weight", (f"{layer}mlp.gate_proj.weight", f"{layer}mlp.up_proj.weight"),
             split_rows("gate_up_proj.weight", (config.intermediate_size, config.intermediate_size))),
        (f"{p}norm.weight",) * 2,
    ]
    rules += [(f"{layer}{official}.weight", f"{layer}{ours}.weight") for official, ours in PER_LAYER.items()]
    return KeyMap(rules + head_rules(config, class_name), ignore=IGNORED_BUFFERS)


def causal_config_from_phi3(official, *, src):
    rope = dict(official.rope_parameters or {})
    if rope.get("rope_type") == "longrope":
        rope.setdefault("original_max_position_embeddings", official.original_max_position_embeddings)
    values = dict(
        PHI3_STRUCTURE,
        **{name: getattr(official, name) for name in SHARED_FIELDS},
        head_dim=official.hidden_size // official.num_attention_heads,
        hidden_act=official.hidden_act,
        rope_parameters=rope,
        sliding_window=official.sliding_window,  # every layer, as Mistral
        hidden_dropout=official.resid_pdrop,
    )
    if values["pad_token_id"] is not None and not 0 <= values["pad_token_id"] < values["vocab_size"]:
        values["pad_token_id"] = None
    return build_causal_config(values, official, src=src)


def phi3_config_from_causal(config, official_class: str):
    import transformers

    differing = {k: getattr(config, k) for k, v in PHI3_STRUCTURE.items() if getattr(config, k) != v}
    if config.head_dim * config.num_attention_heads != config.hidden_size:
        differing["head_dim"] = config.head_dim
    if set(config.rope_parameters) != set(config.rope_parameters_for("full_attention")):
        differing["rope_parameters"] = "keyed by layer type"
    if config.longrope_cache.longrope_cache_kept:  # Phi-3 drops its cache there
        differing["longrope_cache_kept"] = True
    expected_types = ["sliding_attention" if config.sliding_window else "full_attention"] * config.num_hidden_layers
    if config.layer_types != expected_types:
        differing["layer_types"] = config.layer_types
    if differing:
        raise ConversionError(f"Phi-3 cannot hold this hf_tiny config: it differs from Phi-3's structure in {differing}")
    rope = dict(config.rope_parameters)
    values = {name: getattr(config, name) for name in SHARED_FIELDS}
    values.update(hidden_act=config.hidden_act, rope_parameters=rope, sliding_window=config.sliding_window,
                  resid_pdrop=config.hidden_dropout, architectures=[official_class],
                  **label_fields(config))
    if "original_max_position_embeddings" in rope:
        values["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    return transformers.Phi3Config(**values)


def needs_phi3(config) -> bool:
    """Only Phi-3 among the official causal classes holds a partial rotary factor, or longrope that drops its cache
    as generation passes original_max_position_embeddings (Llama, Qwen2, Gemma 3 keep it: longrope_cache_kept)."""
    rope = config.rope_parameters_for("full_attention")
    phi3_longrope = rope["rope_type"] == "longrope" and not config.longrope_cache.longrope_cache_kept
    return phi3_longrope or rope.get("partial_rotary_factor", 1.0) != 1.0


class Phi3Family(SingleTypeFamily):
    official_classes = OFFICIAL_CLASSES
    word_embeddings = "model.embed_tokens.weight"
    config_from_official = staticmethod(causal_config_from_phi3)
    official_config_of = staticmethod(phi3_config_from_causal)
    key_map = staticmethod(key_map)

    def plan_notes(self, source: Source, official) -> list[str]:
        if not official.embd_pdrop:
            return []
        return [f"embd_pdrop={official.embd_pdrop} is not carried: official Phi-3 never applies it."]


FAMILY = Phi3Family("phi3", "a Phi-3", "hf_tiny_causal (Llama-style decoder; Phi-3's fused projections split)", gguf=True)
convert, convert_back = entry_points(FAMILY)
