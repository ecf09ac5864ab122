"""Configuration of the Llama-style causal LM family (model_type "hf_tiny_causal")."""

from __future__ import annotations

import math
from typing import Optional

from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from .moe import ROUTER_SCORINGS
from .rope import rotary_dim, standardize_rope_parameters
from .validation import check_bool, check_choice, check_divisible, check_finite_fields, check_non_negative, check_positive
from .validation import check_non_negative_number, check_positive_number, warn_on_token_ids_outside
from .validation import check_probability, check_token_ids, init_arguments, store_init_fields


LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
# The layer types rope_parameters may be keyed by (chunked layers rotate with the full layers' parameters).
ROPE_LAYER_TYPES = ("full_attention", "sliding_attention")
QK_NORM_TYPES = ("head", "projection", "l2")
MLP_LAYER_TYPES = ("dense", "sparse")
POSITION_EMBEDDING_TYPES = ("rope", "learned", "alibi")


def check_layer_types(owner: str, layer_types, num_hidden_layers: int, sliding_window) -> list[str]:
    """layer_types filled in (every layer sliding when sliding_window is set, else full) and checked."""
    if layer_types is None:
        return ["sliding_attention" if sliding_window is not None else "full_attention"] * num_hidden_layers
    if not isinstance(layer_types, (list, tuple)):
        raise TypeError(f"{owner}: layer_types must be a list of {list(LAYER_TYPES)}, got {layer_types!r}")
    layer_types = list(layer_types)
    if len(layer_types) != num_hidden_layers:
        raise ValueError(
            f"{owner}: layer_types has {len(layer_types)} entries but num_hidden_layers={num_hidden_layers}"
        )
    for index, kind in enumerate(layer_types):
        if kind not in LAYER_TYPES:
            raise ValueError(f"{owner}: layer_types[{index}]={kind!r} is not a layer type hf_tiny knows; choose one of {list(LAYER_TYPES)}")
    if "sliding_attention" in layer_types and sliding_window is None:
        raise ValueError(
            f"{owner}: layer_types has 'sliding_attention' layers (first: {layer_types.index('sliding_attention')}) "
            "but sliding_window is None; set sliding_window"
        )
    return layer_types


def check_moe_fields(owner: str, values: dict, num_hidden_layers: int, first_k_dense_replace) -> Optional[list[str]]:
    """The Mixture-of-Experts fields checked; returns mlp_layer_types filled in (None for a dense model)."""
    experts = values["num_local_experts"]
    check_non_negative(owner, "0: every layer has a dense feed-forward", num_local_experts=experts)
    mlp_layer_types = values["mlp_layer_types"]
    if experts == 0:
        if first_k_dense_replace is not None or (mlp_layer_types is not None and "sparse" in mlp_layer_types):
            raise ValueError(
                f"{owner}: first_k_dense_replace={first_k_dense_replace!r} / mlp_layer_types={mlp_layer_types!r} ask "
                "for sparse (MoE) layers but num_local_experts=0; set num_local_experts"
            )
        return None
    _check_routing(owner, values)
    check_choice(owner, "router_scoring", values["router_scoring"], ROUTER_SCORINGS)
    check_positive(owner, moe_intermediate_size=values["moe_intermediate_size"])
    check_non_negative(owner, "0: no shared experts", shared_expert_intermediate_size=values["shared_expert_intermediate_size"])
    check_bool(owner, norm_topk_prob=values["norm_topk_prob"], shared_expert_gate=values["shared_expert_gate"],
               output_router_logits=values["output_router_logits"])
    if values["shared_expert_gate"] and not values["shared_expert_intermediate_size"]:
        raise ValueError(f"{owner}: shared_expert_gate=True needs shared experts; shared_expert_intermediate_size=0")
    check_positive_number(owner, routed_scaling_factor=values["routed_scaling_factor"])
    check_probability(owner, router_jitter_noise=values["router_jitter_noise"])
    check_non_negative_number(owner, router_aux_loss_coef=values["router_aux_loss_coef"])
    if not values["mlp_gated"] or values["mlp_bias"]:
        raise ValueError(
            f"{owner}: MoE experts are gated (SwiGLU) MLPs without biases; num_local_experts={experts} needs "
            f"mlp_gated=True and mlp_bias=False, got mlp_gated={values['mlp_gated']}, mlp_bias={values['mlp_bias']}"
        )
    return _mlp_layer_types(owner, mlp_layer_types, num_hidden_layers, first_k_dense_replace)


def _check_routing(owner: str, values: dict) -> None:
    experts = values["num_local_experts"]
    top_k, groups, best_groups = values["num_experts_per_tok"], values["n_group"], values["topk_group"]
    check_positive(owner, num_experts_per_tok=top_k, n_group=groups, topk_group=best_groups)
    if top_k > experts:
        raise ValueError(f"{owner}: num_experts_per_tok={top_k} exceeds num_local_experts={experts}")
    check_divisible(owner, "num_local_experts", experts, "n_group", groups)
    if best_groups > groups:
        raise ValueError(f"{owner}: topk_group={best_groups} exceeds n_group={groups}")
    if groups > 1:
        per_group = experts // groups
        if per_group < 2:
            raise ValueError(
                f"{owner}: grouped routing scores a group by its two best experts; n_group={groups} leaves "
                f"{per_group} expert(s) per group of num_local_experts={experts}"
            )
        if top_k > best_groups * per_group:
            raise ValueError(
                f"{owner}: num_experts_per_tok={top_k} exceeds the {best_groups * per_group} experts of the "
                f"topk_group={best_groups} groups a token may use (num_local_experts={experts}, n_group={groups})"
            )


def _mlp_layer_types(owner: str, mlp_layer_types, num_hidden_layers: int, first_k_dense_replace) -> list[str]:
    if mlp_layer_types is None:
        dense = 0 if first_k_dense_replace is None else first_k_dense_replace
        check_non_negative(owner, first_k_dense_replace=dense)
        if dense > num_hidden_layers:
            raise ValueError(f"{owner}: first_k_dense_replace={dense} exceeds num_hidden_layers={num_hidden_layers}")
        return ["dense"] * dense + ["sparse"] * (num_hidden_layers - dense)
    if first_k_dense_replace is not None:
        raise ValueError(f"{owner}: pass mlp_layer_types or first_k_dense_replace, not both")
    if not isinstance(mlp_layer_types, (list, tuple)) or len(mlp_layer_types) != num_hidden_layers:
        raise ValueError(
            f"{owner}: mlp_layer_types must list one of {list(MLP_LAYER_TYPES)} per layer "
            f"(num_hidden_layers={num_hidden_layers}), got {mlp_layer_types!r}"
        )
    for index, kind in enumerate(mlp_layer_types):
        if kind not in MLP_LAYER_TYPES:
            raise ValueError(f"{owner}: mlp_layer_types[{index}]={kind!r}; choose one of {list(MLP_LAYER_TYPES)}")
    return list(mlp_layer_types)


def check_mla_fields(owner: str, values: dict) -> int:
    """Multi-head Latent Attention's fields checked (kv_lora_rank is set); returns the query/key head_dim,
    qk_nope_head_dim + qk_rope_head_dim."""
    check_positive(
        owner, kv_lora_rank=values["kv_lora_rank"], qk_nope_head_dim=values["qk_nope_head_dim"],
        qk_rope_head_dim=values["qk_rope_head_dim"], v_head_dim=values["v_head_dim"],
    )
    if values["q_lora_rank"] is not None:
        check_positive(owner, q_lora_rank=values["q_lora_rank"])
    if values["qk_rope_head_dim"] % 2:
        raise ValueError(f"{owner}: qk_rope_head_dim must be even (rotary pairs), got {values['qk_rope_head_dim']}")
    check_bool(owner, mla_absorb=values["mla_absorb"])
    head_dim = values["qk_nope_head_dim"] + values["qk_rope_head_dim"]
    if values["head_dim"] is not None and values["head_dim"] != head_dim:
        raise ValueError(
            f"{owner}: with MLA (kv_lora_rank={values['kv_lora_rank']}) head_dim is qk_nope_head_dim + "
            f"qk_rope_head_dim = {head_dim}; got head_dim={values['head_dim']} (leave it unset)"
        )
    heads, kv_heads = values["num_attention_heads"], values["num_key_value_heads"]
    if kv_heads is not None and kv_heads != heads:
        raise ValueError(
            f"{owner}: MLA expands per-head keys and values from its latent; num_key_value_heads={kv_heads} must "
            f"equal num_attention_heads={heads} (or be unset)"
        )
    conflicts = {
        name: values[name]
        for name, off in (("position_embedding_type", "rope"), ("qk_norm", False), ("sliding_window", None),
                          ("attention_output_bias", None), ("query_pre_attn_scalar", None))
        if values[name] != off
    }
    if conflicts:
        raise ValueError(
            f"{owner}: MLA (kv_lora_rank={values['kv_lora_rank']}) has rotary keys, no q/k norm, no sliding window, "
            f"one attention_bias and the default scale; got {conflicts}"
        )
    return head_dim


# The fields of the mechanisms a checkpoint may not use, with their defaults: a config holds them only when it uses
# the mechanism, so that a dense model has no field a tool could read as "this is a Mixture-of-Experts model" (TRL
# enables router losses when a config has output_router_logits).
OPTIONAL_FIELDS = {
    "moe": dict(
        num_local_experts=0, num_experts_per_tok=2, moe_intermediate_size=None, router_scoring="softmax",
        norm_topk_prob=True, n_group=1, topk_group=1, routed_scaling_factor=1.0, shared_expert_intermediate_size=0,
        shared_expert_gate=False, mlp_layer_types=None, router_aux_loss_coef=0.001, router_jitter_noise=0.0,
        output_router_logits=False,
    ),
    "mla": dict(kv_lora_rank=None, q_lora_rank=None, qk_nope_head_dim=None, qk_rope_head_dim=None, v_head_dim=None,
                mla_absorb=False),
    "mtp": dict(num_nextn_predict_layers=0, mtp_loss_weight=0.3),
    "alibi": dict(alibi_bias_max=8.0),
    "nope": dict(nope_layers=()),
    "qk_norm_type": dict(qk_norm_type="head"),
    "pre_norms": dict(pre_norms=True),
    "chunked_attention": dict(attention_chunk_size=None),
    "temperature": dict(attn_temperature_tuning=False, floor_scale=8192, attn_scale=0.1),
    "router_input_weights": dict(apply_router_weight_on_input=False),
    "sinks": dict(attention_sinks=False),
    "moe_biases": dict(router_bias=False, expert_bias=False),
    "clamped_swiglu": dict(swiglu_limit=None, swiglu_alpha=1.702),
    "use_padding_idx": dict(use_padding_idx=True),
}


def _uses(group: str, values: dict) -> bool:
    return {
        "moe": bool(values["num_local_experts"]), "mla": values["kv_lora_rank"] is not None,
        "mtp": bool(values["num_nextn_predict_layers"]), "alibi": values["position_embedding_type"] == "alibi",
        "nope": bool(values["nope_layers"]), "qk_norm_type": values["qk_norm_type"] != "head",
        "pre_norms": values["pre_norms"] is not True, "chunked_attention": values["attention_chunk_size"] is not None,
        "temperature": values["attn_temperature_tuning"] is not False,
        "router_input_weights": values["apply_router_weight_on_input"] is not False,
        "sinks": bool(values["attention_sinks"]), "clamped_swiglu": values["swiglu_limit"] is not None,
        "moe_biases": bool(values["router_bias"] or values["expert_bias"]),
        "use_padding_idx": values["use_padding_idx"] is not True,
    }[group]


def _renamed_aliases(owner: str, attribute_map: dict, kwargs: dict) -> dict:
    """kwargs with each alias (attribute_map: num_experts) under the field's own name (num_local_experts)."""
    for alias, name in attribute_map.items():
        if alias in kwargs:
            if name in kwargs and kwargs[name] != kwargs[alias]:
                raise ValueError(f"{owner}: {alias}={kwargs[alias]} and {name}={kwargs[name]} name the same field; "
                                 f"give one")
            kwargs = {**{k: v for k, v in kwargs.items() if k != alias}, name: kwargs[alias]}
    return kwargs


def field_value(config, name: str):
    """A field of a causal config, or for a mechanism the config does not use the field's "off" default (a dense
    config holds no num_local_experts: 0)."""
    if hasattr(config, name):
        return getattr(config, name)
    for fields in OPTIONAL_FIELDS.values():
        if name in fields:
            return fields[name]
    raise AttributeError(f"{type(config).__name__} has no field {name!r}")


def _check_sizes(owner: str, values: dict) -> int:
    """The sizes checked; returns head_dim (hidden_size // num_attention_heads unless set, MLA's own sum)."""
    heads, kv_heads, hidden = values["num_attention_heads"], values["num_key_value_heads"], values["hidden_size"]
    check_positive(
        owner, vocab_size=values["vocab_size"], hidden_size=hidden, intermediate_size=values["intermediate_size"],
        num_hidden_layers=values["num_hidden_layers"], num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=values["max_position_embeddings"],
    )
    head_dim = values["head_dim"]
    if values["kv_lora_rank"] is not None:
        head_dim = check_mla_fields(owner, values)
    elif head_dim is None:
        check_divisible(owner, "hidden_size", hidden, "num_attention_heads", heads)
        head_dim = hidden // heads
    check_positive(owner, head_dim=head_dim)
    if values["position_embedding_type"] == "rope" and head_dim % 2:
        raise ValueError(f"{owner}: head_dim must be even for rotary embeddings, got {head_dim}")
    check_divisible(owner, "num_attention_heads", heads, "num_key_value_heads", kv_heads)
    return head_dim


def _check_parts(owner: str, values: dict, kwargs: dict) -> None:
    """The block's parts: activation, norms, dropouts, Gemma's switches, the position scheme."""
    check_choice(owner, "position_embedding_type", values["position_embedding_type"], POSITION_EMBEDDING_TYPES)
    check_choice(owner, "norm_type", values["norm_type"], ("rmsnorm", "layernorm"))
    check_choice(owner, "hidden_act", values["hidden_act"], sorted(ACT2FN))
    check_probability(owner, attention_dropout=values["attention_dropout"], hidden_dropout=values["hidden_dropout"],
                      embedding_dropout=values["embedding_dropout"])
    check_positive_number(owner, rms_norm_eps=values["rms_norm_eps"], layer_norm_eps=values["layer_norm_eps"],
                          initializer_range=values["initializer_range"])
    if values["sliding_window"] is not None:
        check_positive(owner, sliding_window=values["sliding_window"])
    check_bool(owner, qk_norm=values["qk_norm"], rms_norm_unit_offset=values["rms_norm_unit_offset"],
               scale_embeddings=values["scale_embeddings"], sandwich_norms=values["sandwich_norms"],
               mlp_gated=values["mlp_gated"], norm_bias=values["norm_bias"])
    if values["rms_norm_unit_offset"] and values["norm_type"] != "rmsnorm":
        raise ValueError(f"{owner}: rms_norm_unit_offset=True needs norm_type='rmsnorm', got {values['norm_type']!r}")
    for name in ("query_pre_attn_scalar", "final_logit_softcapping"):
        if values[name] is not None:
            check_positive_number(owner, **{name: values[name]})
    if kwargs.get("attn_logit_softcapping") is not None:
        raise ValueError(
            f"{owner}: attn_logit_softcapping={kwargs['attn_logit_softcapping']!r} is not supported (it needs the "
            "attention scores, which the sdpa and flash kernels never form); use a model with attn_logit_softcapping=None"
        )
    check_positive_number(owner, alibi_bias_max=values["alibi_bias_max"])


def _check_mtp(owner: str, values: dict) -> None:
    depth = values["num_nextn_predict_layers"]
    check_non_negative(owner, "0: no Multi-Token Prediction modules", num_nextn_predict_layers=depth)
    check_non_negative_number(owner, mtp_loss_weight=values["mtp_loss_weight"])
    if depth and values["position_embedding_type"] != "rope":
        raise ValueError(
            f"{owner}: Multi-Token Prediction modules (num_nextn_predict_layers={depth}) rotate with RoPE; "
            f"position_embedding_type={values['position_embedding_type']!r} is not supported with them"
        )
    if depth and "sliding_attention" in values["layer_types"]:
        raise ValueError(
            f"{owner}: Multi-Token Prediction modules (num_nextn_predict_layers={depth}) attend with full attention; "
            "a model with sliding_attention layers is not supported"
        )


def check_gpt_oss_fields(owner: str, values: dict) -> None:
    """GPT-OSS's mechanisms: attention sinks, router and expert biases, the clamped SwiGLU, softmax over the top-k
    logits (each usable alone)."""
    check_bool(owner, attention_sinks=values["attention_sinks"], router_bias=values["router_bias"],
               expert_bias=values["expert_bias"])
    if values["attention_sinks"] and values["kv_lora_rank"] is not None:
        raise ValueError(f"{owner}: attention_sinks=True is not supported with MLA (kv_lora_rank={values['kv_lora_rank']})")
    biased = [name for name in ("router_bias", "expert_bias") if values[name]]
    if biased and not values["num_local_experts"]:
        raise ValueError(f"{owner}: {'/'.join(biased)}=True ask for Mixture-of-Experts biases but num_local_experts=0")
    if values["swiglu_limit"] is not None:
        check_positive_number(owner, swiglu_limit=values["swiglu_limit"], swiglu_alpha=values["swiglu_alpha"])
        if not values["mlp_gated"]:
            raise ValueError(f"{owner}: swiglu_limit={values['swiglu_limit']} clamps a gated feed-forward; set mlp_gated=True")
    if values["num_local_experts"] and values["router_scoring"] == "topk_softmax":
        if values["n_group"] != 1 or values["norm_topk_prob"] is not True:
            raise ValueError(
                f"{owner}: router_scoring='topk_softmax' (softmax over the k chosen logits, which sum to 1) takes no "
                f"expert groups and no renormalization switch; got n_group={values['n_group']}, "
                f"norm_topk_prob={values['norm_topk_prob']!r} (leave them at 1 and True)"
            )


def check_nope_layers(owner: str, values: dict) -> list[int]:
    """nope_layers checked: distinct layer indices of a rotary model whose layers do not rotate (NoPE); sorted."""
    nope, layers = values["nope_layers"], values["num_hidden_layers"]
    if not isinstance(nope, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in nope):
        raise TypeError(f"{owner}: nope_layers must be a list of layer indices, got {nope!r}")
    outside = [i for i in nope if not 0 <= i < layers]
    if outside or len(set(nope)) != len(nope):
        raise ValueError(
            f"{owner}: nope_layers={list(nope)} must list distinct layer indices 0 .. {layers - 1} (num_hidden_layers="
            f"{layers}); {'outside: ' + str(outside) if outside else 'repeated indices'}"
        )
    if nope and (values["position_embedding_type"] != "rope" or values["kv_lora_rank"] is not None):
        raise ValueError(
            f"{owner}: nope_layers={list(nope)} are the layers of a rotary model that do not rotate; needs "
            f"position_embedding_type='rope' (got {values['position_embedding_type']!r}) and no MLA "
            f"(kv_lora_rank={values['kv_lora_rank']!r})"
        )
    return sorted(nope)


def _check_layer_variants(owner: str, values: dict) -> None:
    """The switches of the 2025 decoders: q/k norm placement, post-sublayer norms, chunked attention, Llama 4's
    query temperature on NoPE layers and its router weights on expert inputs."""
    check_choice(owner, "qk_norm_type", values["qk_norm_type"], QK_NORM_TYPES)
    check_bool(owner, pre_norms=values["pre_norms"], use_padding_idx=values["use_padding_idx"],
               attn_temperature_tuning=values["attn_temperature_tuning"],
               apply_router_weight_on_input=values["apply_router_weight_on_input"])
    needs = {
        "qk_norm_type": (values["qk_norm_type"] != "head", "qk_norm=True", values["qk_norm"]),
        "pre_norms": (not values["pre_norms"], "sandwich_norms=True (norms on the sublayer outputs)",
                      values["sandwich_norms"]),
        "attn_temperature_tuning": (values["attn_temperature_tuning"], "NoPE layers (nope_layers)",
                                    bool(values["nope_layers"])),
        "apply_router_weight_on_input": (values["apply_router_weight_on_input"], "MoE layers (num_local_experts)",
                                         bool(values["num_local_experts"])),
    }
    for name, (asked, requirement, met) in needs.items():
        if asked and not met:
            raise ValueError(f"{owner}: {name}={values[name]!r} needs {requirement}")
    if values["attn_temperature_tuning"]:
        check_positive_number(owner, floor_scale=values["floor_scale"])
        check_non_negative_number(owner, attn_scale=values["attn_scale"])
    _check_chunked_attention(owner, values)


def _check_chunked_attention(owner: str, values: dict) -> None:
    chunk, layer_types = values["attention_chunk_size"], values["layer_types"]
    if chunk is not None:
        check_positive(owner, attention_chunk_size=chunk)
    chunked = "chunked_attention" in layer_types
    if chunked != (chunk is not None):
        raise ValueError(
            f"{owner}: 'chunked_attention' layers and attention_chunk_size go together; got attention_chunk_size="
            f"{chunk!r} and {layer_types.count('chunked_attention')} chunked_attention layer(s) in layer_types"
        )
    if chunked and "sliding_attention" in layer_types:
        raise ValueError(
            f"{owner}: layer_types mixes 'sliding_attention' and 'chunked_attention'; transformers' caches before "
            "5.2x keep one window for every local layer, so a model has one kind of local attention"
        )


def _rope_parameters(owner: str, values: dict, legacy_scaling, legacy_theta) -> dict:
    """rope_parameters standardized (one dict, or one per layer type); the legacy spellings of Llama 2 era
    config.json files (rope_scaling + rope_theta beside it) accepted."""
    rope_parameters, max_positions = values["rope_parameters"], values["max_position_embeddings"]
    if rope_parameters is None and legacy_scaling is not None:
        rope_parameters = legacy_scaling
    if isinstance(rope_parameters, dict) and set(rope_parameters) & set(LAYER_TYPES):
        unknown = sorted(set(rope_parameters) - set(ROPE_LAYER_TYPES))
        if unknown:
            raise ValueError(f"{owner}: rope_parameters keyed by layer type may hold only {list(ROPE_LAYER_TYPES)}; got keys {unknown}")
        rope_parameters = {
            kind: standardize_rope_parameters(rope_parameters.get(kind), max_position_embeddings=max_positions,
                                              rope_theta=legacy_theta, owner=f"{owner} rope_parameters[{kind!r}]")
            for kind in ROPE_LAYER_TYPES
        }
    else:
        rope_parameters = standardize_rope_parameters(rope_parameters, max_position_embeddings=max_positions,
                                                      rope_theta=legacy_theta, owner=owner)
    kind = values["position_embedding_type"]
    if kind == "alibi" and rope_parameters != standardize_rope_parameters(None, max_position_embeddings=max_positions, owner=owner):
        raise ValueError(
            f"{owner}: position_embedding_type='alibi' takes no rotary embeddings (ALiBi replaces them); got "
            f"rope_parameters={rope_parameters}"
        )
    if kind == "rope":
        mla = values["kv_lora_rank"] is not None
        rotated = values["qk_rope_head_dim"] if mla else values["head_dim"]
        for params in (rope_parameters.values() if set(rope_parameters) == set(ROPE_LAYER_TYPES) else (rope_parameters,)):
            if mla and rotary_dim(params, rotated, owner=owner) != rotated:
                raise ValueError(f"{owner}: MLA rotates all qk_rope_head_dim={rotated} dimensions; drop partial_rotary_factor")
            rotary_dim(params, rotated, owner=owner)
    return rope_parameters


class TinyCausalConfig(PretrainedConfig):
    """A pre-norm decoder-only transformer: token embeddings, N blocks of (RMSNorm, rotary self-attention with
    GQA/MQA, RMSNorm, SwiGLU feed-forward), final RMSNorm, LM head. Field names are the transformers standard ones
    (those of LlamaConfig), so Llama / Mistral / Qwen2 checkpoints map onto it field by field:

    - num_key_value_heads < num_attention_heads: grouped-query attention (1: multi-query).
    - head_dim: defaults to hidden_size // num_attention_heads; may be set explicitly (then hidden_size need not
      divide).
    - rope_parameters: {"rope_type": "default" | "linear" | "dynamic" | "yarn" | "llama3", "rope_theta": ..., and
      the type's own fields}, the semantics of transformers' `rope_parameters`. The legacy `rope_scaling` +
      `rope_theta` keywords are accepted too.
    - attention_bias: bias of q/k/v (and of o_proj unless attention_output_bias says otherwise; Qwen2 has biases
      on q/k/v only: attention_bias=True, attention_output_bias=False). mlp_bias: biases of the feed-forward.
    - sliding_window: None (full causal attention) or the number of most recent keys (itself included) a query
      of a "sliding_attention" layer sees.
    - layer_types: one entry per layer, "full_attention" or "sliding_attention"; by default every layer is
      "sliding_attention" when sliding_window is set (Mistral) and "full_attention" otherwise. Mixed lists are
      Qwen2's `max_window_layers` and Gemma 3's 5 local : 1 global pattern.
    - rope_parameters may also be keyed by layer type ({"full_attention": {...}, "sliding_attention": {...}}):
      each kind of layer then rotates with its own parameters (Gemma 3: theta 1e6 global, 1e4 local).
    - qk_norm: an RMSNorm over each head's query and key (weights of head_dim, eps rms_norm_eps) before RoPE
      (Qwen3, Gemma 3).

    Gemma 3 is this block with five switches (all off for Llama):
    - rms_norm_unit_offset: every RMSNorm stores w and scales by (1 + w), multiplying in float32 before the cast
      back (Gemma's `Gemma3RMSNorm`; weights are zero-initialized).
    - scale_embeddings: token embeddings (from input_ids) times sqrt(hidden_size), rounded to the weights' dtype.
    - sandwich_norms: besides the pre-norms, a norm on the output of attention and of the MLP before each
      residual add (`attn_output_layernorm`, `mlp_output_layernorm`).
    - query_pre_attn_scalar: attention scale query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5.
    - final_logit_softcapping: logits = c * tanh(logits / c) (None: off).

    GPT-2 is this block with other choices of its parts:
    - position_embedding_type "alibi" (BLOOM, MPT; step.alibi_slopes): no position embeddings; each head adds -m_h * (i - j) to
      its scores, slopes m_h from alibi_bias_max (8). norm_bias=False: LayerNorms without bias (MPT).
    - position_embedding_type: "rope" (default) or "learned" (absolute positions added to the token embeddings,
      `embed_positions`, max_position_embeddings of them; no rotation).
    - norm_type: "rmsnorm" (eps rms_norm_eps) or "layernorm" (with bias, eps layer_norm_eps), for every norm.
    - mlp_gated: True (down(act(gate(x)) * up(x))) or False (down(act(up(x))), GPT-2's c_fc / c_proj).
    - hidden_dropout: dropout on each sublayer's output before the residual add (GPT-2 / Phi-3 resid_pdrop);
      embedding_dropout: on the embeddings (embd_pdrop).

    Mixture-of-Experts (Mixtral, Qwen-MoE, DeepSeek-V3; moe.py), all off when num_local_experts=0:
    - num_local_experts E routed experts (SwiGLU, moe_intermediate_size wide; default intermediate_size), of which
      the router picks num_experts_per_tok per token.
    - router_scoring: "softmax" (Mixtral, Qwen) or "sigmoid" (DeepSeek-V3, with e_score_correction_bias);
      norm_topk_prob renormalizes the k weights; routed_scaling_factor multiplies them; n_group / topk_group restrict
      the choice to the best groups of experts (DeepSeek-V3).
    - shared_expert_intermediate_size > 0: shared experts every token goes through (DeepSeek: n_shared_experts *
      moe_intermediate_size), scaled by sigmoid(shared_expert_gate(x)) when shared_expert_gate (Qwen2-MoE).
    - mlp_layer_types: "dense" or "sparse" per layer (default: all sparse); first_k_dense_replace=N is accepted
      instead and makes the first N layers dense (DeepSeek). Dense layers use intermediate_size.
    - output_router_logits: return each sparse layer's router logits; with labels the loss then adds
      router_aux_loss_coef times the load-balancing loss. router_jitter_noise: Mixtral's multiplicative input noise
      while training.

    Multi-head Latent Attention (DeepSeek-V2/V3; mla.py), on when kv_lora_rank is set: q_lora_rank (None: no query
    compression), qk_nope_head_dim + qk_rope_head_dim per query/key head (head_dim is their sum), v_head_dim; the
    cache holds the kv_lora_rank-wide latent and the shared rotary key. mla_absorb: attend over the latent with
    the up-projections folded into queries and outputs (same result, no expanded keys).

    Multi-Token Prediction (DeepSeek-V3; mtp.py): num_nextn_predict_layers modules predicting tokens 2 .. D + 1
    ahead, trained with weight mtp_loss_weight (lambda) and used by generate(use_mtp=True) to draft tokens.

    GPT-OSS is a MoE model with alternating sliding / full layer_types, attention_bias and YaRN (truncate=False), and
    four more switches (off elsewhere):
    - attention_sinks: a learned logit per head (`self_attn.sinks`) in every query's softmax denominator, attached to
      no value (attention.py's backends).
    - router_scoring "topk_softmax": the k largest router logits, softmax over them (in their dtype).
    - router_bias / expert_bias: a bias on the router (`mlp.gate.bias`) / on each expert's projections.
    - swiglu_limit (None: off) and swiglu_alpha: every gated feed-forward is GPT-OSS's clamped SwiGLU,
      down((clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)), g = clamp(gate, max=limit) (layers.py).
    The 2025 decoders (SmolLM3, OLMo 2, Llama 4 text), each switch held only when used:
    - nope_layers: indices of layers without rotary positions (NoPE: SmolLM3 every 4th layer, Llama 4 too).
    - qk_norm_type: where qk_norm acts: "head" (each head before RoPE, weights of head_dim: Qwen3, Gemma 3),
      "projection" (the whole q / k projection before the heads split, weights of heads * head_dim: OLMo 2),
      "l2" (each head after RoPE, no weight, on rotary layers only: Llama 4's use_qk_norm).
    - use_padding_idx=False: the token embedding has no padding row (pad_token_id's row trains like any other), as
      official GPT-2 and MPT; True (Llama and most others; the seq2seq config's field of the same name):
      nn.Embedding(padding_idx=pad_token_id).
    - pre_norms=False: no norm before each sublayer; with sandwich_norms the layer is OLMo 2's
      h = x + norm(attn(x)), out = h + norm(mlp(h)).
    - layer_types "chunked_attention" with attention_chunk_size C (Llama 4's local layers): a query sees the keys
      of its own chunk of C tokens (counted from the row's first real token), causally.
    - attn_temperature_tuning (Llama 4): on NoPE layers the query of cache index t is scaled by
      1 + attn_scale * log(1 + floor((t + 1) / floor_scale)).
    - router_scoring "topk_sigmoid" (Llama 4: the k largest logits choose, weighed by their sigmoid) and
      apply_router_weight_on_input: each expert gets its tokens already multiplied by their router weight.
    """

    model_type = "hf_tiny_causal"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]
    # official MoE configs' (Mixtral, Qwen3-MoE) alias, which tools read (TRL's load-balancing loss); a dense config
    # holds no num_local_experts, so it has no num_experts either
    attribute_map = {"num_experts": "num_local_experts"}
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    def __init__(
        self, vocab_size: int = 32000, hidden_size: int = 4096, intermediate_size: int = 11008,
        num_hidden_layers: int = 32, num_attention_heads: int = 32, num_key_value_heads: int | None = None,
        head_dim: int | None = None, hidden_act: str = "silu", max_position_embeddings: int = 2048,
        initializer_range: float = 0.02, rms_norm_eps: float = 1e-6, rope_parameters: dict | None = None,
        attention_bias: bool = False, attention_output_bias: bool | None = None, attention_dropout: float = 0.0,
        mlp_bias: bool = False, sliding_window: int | None = None, layer_types: list[str] | None = None,
        qk_norm: bool = False, rms_norm_unit_offset: bool = False, scale_embeddings: bool = False,
        sandwich_norms: bool = False, query_pre_attn_scalar: float | None = None,
        final_logit_softcapping: float | None = None, position_embedding_type: str = "rope", norm_type: str = "rmsnorm",
        layer_norm_eps: float = 1e-5, norm_bias: bool = True, mlp_gated: bool = True, hidden_dropout: float = 0.0,
        embedding_dropout: float = 0.0, tie_word_embeddings: bool = False, pad_token_id: int | None = None,
        bos_token_id: int | None = 1, eos_token_id: int | list[int] | None = 2, use_cache: bool = True, **kwargs,
    ):
        """Every field this docstring's class describes; the optional mechanisms' fields (OPTIONAL_FIELDS: MoE,
        MLA, MTP, ALiBi) arrive through kwargs and are held only when their mechanism is on."""
        owner = type(self).__name__
        kwargs = _renamed_aliases(owner, type(self).attribute_map, kwargs)
        optional = {name: kwargs.pop(name, default) for group in OPTIONAL_FIELDS.values() for name, default in group.items()}
        values = {**init_arguments({k: v for k, v in locals().items() if k not in ("optional", "owner")}), **optional}
        check_finite_fields(owner, values)
        values["num_key_value_heads"] = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        values["head_dim"] = _check_sizes(owner, values)
        _check_parts(owner, values, kwargs)
        values["layer_types"] = check_layer_types(owner, layer_types, num_hidden_layers, sliding_window)
        values["nope_layers"] = check_nope_layers(owner, values)
        _check_layer_variants(owner, values)
        if values["moe_intermediate_size"] is None:
            values["moe_intermediate_size"] = intermediate_size
        values["mlp_layer_types"] = check_moe_fields(owner, values, num_hidden_layers, kwargs.pop("first_k_dense_replace", None))
        check_gpt_oss_fields(owner, values)
        _check_mtp(owner, values)
        if pad_token_id == -1:  # old LLaMA configs: official warns and loads (nn.Embedding reads -1 as the last row)
            warn_on_token_ids_outside(vocab_size, pad_token_id=pad_token_id)
        else:
            check_token_ids(owner, vocab_size, pad_token_id=pad_token_id)
        warn_on_token_ids_outside(vocab_size, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
        standardized = _rope_parameters(owner, values, kwargs.pop("rope_scaling", None), kwargs.pop("rope_theta", None))
        store_init_fields(self, TinyCausalConfig.__init__, values, skip=("rope_parameters",))
        for group, fields in OPTIONAL_FIELDS.items():
            if _uses(group, values):
                for name in fields:
                    setattr(self, name, values[name])
        # PretrainedConfig.__init__ standardizes rope_parameters itself, differently per transformers version (5.17
        # adds rope_theta into a dict keyed by layer type, then fails validating it); ours is standardized already.
        super().__init__(**kwargs)
        self.rope_parameters = standardized

    def rope_parameters_for(self, layer_type: str) -> dict:
        """The rope parameters a layer of this type rotates with (chunked layers: the full layers')."""
        if set(self.rope_parameters) == set(ROPE_LAYER_TYPES):
            return self.rope_parameters["sliding_attention" if layer_type == "sliding_attention" else "full_attention"]
        return self.rope_parameters

    def uses_rope(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` rotates its queries and keys: every layer of a RoPE model but its NoPE layers
        (the MTP modules' blocks, past num_hidden_layers, rotate)."""
        return self.position_embedding_type == "rope" and layer_idx not in field_value(self, "nope_layers")

    def sliding_window_for(self, layer_type: str) -> int | None:
        return self.sliding_window if layer_type == "sliding_attention" else None

    def norm_type_eps(self) -> float:
        """The epsilon of this model's norms: rms_norm_eps or layer_norm_eps by norm_type."""
        return self.rms_norm_eps if self.norm_type == "rmsnorm" else self.layer_norm_eps

    def moe_spec(self) -> Optional["MoeSpec"]:
        """The sparse feed-forward's description, or None for a dense model (which holds no MoE field)."""
        from .moe import MoeSpec

        if not getattr(self, "num_local_experts", 0):
            return None
        return MoeSpec(
            num_experts=self.num_local_experts, top_k=self.num_experts_per_tok,
            intermediate_size=self.moe_intermediate_size, scoring=self.router_scoring,
            norm_topk_prob=self.norm_topk_prob, n_group=self.n_group, topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
            shared_intermediate_size=self.shared_expert_intermediate_size, shared_expert_gate=self.shared_expert_gate,
            jitter_noise=self.router_jitter_noise, router_bias=field_value(self, "router_bias"),
            weights_on_input=field_value(self, "apply_router_weight_on_input"),
        )

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Layers past num_hidden_layers are the MTP modules' blocks: sparse in a MoE model (DeepSeek-V3)."""
        if not getattr(self, "num_local_experts", 0):
            return False
        return layer_idx >= self.num_hidden_layers or self.mlp_layer_types[layer_idx] == "sparse"

    def mla_spec(self) -> Optional["MlaSpec"]:
        """Multi-head Latent Attention's description, or None (then the config holds no MLA field)."""
        from .mla import MlaSpec

        if getattr(self, "kv_lora_rank", None) is None:
            return None
        return MlaSpec(
            kv_lora_rank=self.kv_lora_rank, q_lora_rank=self.q_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim, bias=self.attention_bias,
        )

    def mtp_depth(self) -> int:
        """The number of Multi-Token Prediction modules (0: none, and no MTP field)."""
        return getattr(self, "num_nextn_predict_layers", 0)

    def rotary_head_dim(self) -> int:
        """The dimensions RoPE rotates per head: MLA's qk_rope_head_dim, else head_dim."""
        return self.head_dim if self.mla_spec() is None else self.qk_rope_head_dim

    def cache_layout(self) -> tuple[int, int]:
        """(heads, key dimension) of what the KV cache stores per layer and token: MLA stores one latent."""
        if self.mla_spec() is not None:
            return 1, self.kv_lora_rank
        return self.num_key_value_heads, self.head_dim

    def attention_scale(self) -> float:
        """head_dim ** -0.5; Gemma's query_pre_attn_scalar ** -0.5; DeepSeek's YaRN scales scores by
        mscale(factor, mscale_all_dim) ** 2 too (official yarn_apply_mscale)."""
        if self.mla_spec() is not None:
            params = self.rope_parameters_for("full_attention")
            mscale_all_dim = params.get("mscale_all_dim")
            if params["rope_type"] == "default" or not mscale_all_dim or params.get("factor", 1.0) <= 1:
                return self.head_dim**-0.5
            mscale = 0.1 * mscale_all_dim * math.log(params["factor"]) + 1.0
            return self.head_dim**-0.5 * mscale * mscale
        if self.query_pre_attn_scalar is not None:
            return self.query_pre_attn_scalar**-0.5
        return self.head_dim**-0.5


__all__ = ["TinyCausalConfig"]
