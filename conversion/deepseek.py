"""DeepSeek-V3 checkpoints <-> the hf_tiny causal LM with Multi-head Latent Attention (hf_tiny/mla.py) and the
sigmoid-routed MoE (hf_tiny/moe.py). Everything else is the Llama block (conversion/llama.py).

Tensor names are DeepSeek's on both sides (q_a_proj, q_a_layernorm, q_b_proj or q_proj, kv_a_proj_with_mqa,
kv_a_layernorm, kv_b_proj, o_proj; mlp.gate.weight, mlp.gate.e_score_correction_bias, mlp.experts.{e}.*,
mlp.shared_experts.*), with one transform: DeepSeek stores the rotary dimensions of q and of the shared rotary
key in interleaved pairs (rope_interleave=True, x0 x1 | x2 x3 ...), which official transformers de-interleaves at
every forward; we permute those rows once, at conversion, into the split-halves order our RoPE rotates
(`rope_rows_to_halves`), and back when converting back.
"""

from __future__ import annotations

import torch

from .causal_variant import CausalVariant, llama_named_classes
from .errors import ConversionError
from .keymap import Rule, Transform
from .moe import EXPERT_PROJECTIONS

# The MLA fields, named alike in DeepseekV3Config and TinyCausalConfig
MLA_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "attention_bias")


def _interleaved_to_halves(rows: torch.Tensor) -> torch.Tensor:
    """[2p, ...] rows (x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...)."""
    return torch.cat((rows[0::2], rows[1::2]), dim=0)


def _halves_to_interleaved(rows: torch.Tensor) -> torch.Tensor:
    half = rows.shape[0] // 2
    out = torch.empty_like(rows)
    out[0::2], out[1::2] = rows[:half], rows[half:]
    return out


def rope_rows_to_halves(block: int, rope_dim: int, name: str) -> Transform:
    """The last rope_dim rows of every `block` rows of a weight (or bias) go from interleaved pairs to halves."""

    def apply(tensor: torch.Tensor, permute) -> torch.Tensor:
        groups = tensor.reshape(-1, block, *tensor.shape[1:])
        rope = torch.stack([permute(group[block - rope_dim :]) for group in groups])
        return torch.cat((groups[:, : block - rope_dim], rope), dim=1).reshape(tensor.shape)

    return Transform(
        f"rope_rows_to_halves({name})",
        lambda tensor: apply(tensor, _interleaved_to_halves),
        lambda tensor: apply(tensor, _halves_to_interleaved),
    )


def attention_rules(config, layer: str, *, rope_interleave: bool = True) -> list:
    """MLA rules of one layer template (layer: e.g. 'model.layers.{i}.'); rope_interleave: the checkpoint's rotary
    rows are interleaved (DeepSeek's own layout; False: already split in halves, copied as they are)."""
    attn = f"{layer}self_attn."
    head = config.qk_nope_head_dim + config.qk_rope_head_dim
    queries = shared_key = None
    if rope_interleave:
        queries = rope_rows_to_halves(head, config.qk_rope_head_dim, "query heads")
        shared_key = rope_rows_to_halves(
            config.kv_lora_rank + config.qk_rope_head_dim, config.qk_rope_head_dim, "shared rope key"
        )
    rules = []
    if config.q_lora_rank is None:
        rules.append(Rule(f"{attn}q_proj.weight", f"{attn}q_proj.weight", queries))
    else:
        rules += [(f"{attn}q_a_proj.weight",) * 2, (f"{attn}q_a_layernorm.weight",) * 2,
                  Rule(f"{attn}q_b_proj.weight", f"{attn}q_b_proj.weight", queries)]
        if config.attention_bias:
            rules.append((f"{attn}q_a_proj.bias",) * 2)
    rules += [
        Rule(f"{attn}kv_a_proj_with_mqa.weight", f"{attn}kv_a_proj_with_mqa.weight", shared_key),
        (f"{attn}kv_a_layernorm.weight",) * 2,
        (f"{attn}kv_b_proj.weight",) * 2,
        (f"{attn}o_proj.weight",) * 2,
    ]
    if config.attention_bias:
        rules += [Rule(f"{attn}kv_a_proj_with_mqa.bias", f"{attn}kv_a_proj_with_mqa.bias", shared_key),
                  (f"{attn}o_proj.bias",) * 2]
    return rules


def sparse_rules(config, layer: str) -> list:
    """Rules of one sparse layer's MoE (layer: a concrete layer prefix, e.g. 'model.layers.3.')."""
    mlp = f"{layer}mlp."
    rules = [(f"{mlp}gate.weight",) * 2, (f"{mlp}gate.e_score_correction_bias",) * 2]
    rules += [(f"{mlp}experts.{{e}}.{name}.weight",) * 2 for name in EXPERT_PROJECTIONS]
    if config.shared_expert_intermediate_size:
        rules += [(f"{mlp}shared_experts.{name}.weight",) * 2 for name in EXPERT_PROJECTIONS]
    return rules


def fields_from_official(official, *, src) -> dict:
    """TinyCausalConfig fields of an official DeepseekV3Config (the MLA and MoE ones, and those that differ)."""
    experts = official.n_routed_experts or 0
    layers = official.num_hidden_layers
    dense = min(official.first_k_dense_replace or 0, layers) if experts else layers
    shared = (official.n_shared_experts or 0) * official.moe_intermediate_size
    values = {name: getattr(official, name) for name in MLA_FIELDS}
    values.update(
        head_dim=None,  # official stores qk_rope_head_dim there; ours is the query/key head width
        num_key_value_heads=official.num_attention_heads,  # unused by official MLA (its default is 128)
        num_nextn_predict_layers=getattr(official, "num_nextn_predict_layers", 0) or 0,
        sliding_window=None,
    )
    if experts:
        values.update(
            num_local_experts=experts,
            num_experts_per_tok=official.num_experts_per_tok,
            moe_intermediate_size=official.moe_intermediate_size,
            router_scoring="sigmoid",
            norm_topk_prob=bool(official.norm_topk_prob),
            n_group=official.n_group or 1,
            topk_group=official.topk_group or 1,
            routed_scaling_factor=float(official.routed_scaling_factor),
            shared_expert_intermediate_size=shared,
            mlp_layer_types=["dense"] * dense + ["sparse"] * (layers - dense),
            router_aux_loss_coef=0.0,  # DeepSeek-V3 balances with the correction bias; official adds no aux loss
            output_router_logits=bool(getattr(official, "output_router_logits", False)),  # a field from transformers 5.2x
        )
    return values


def claims(config) -> bool:
    """Multi-head Latent Attention: only DeepSeek-V3 among the official classes has it."""
    return config.mla_spec() is not None


def check_holds(config) -> None:
    """Errors naming what official DeepseekV3 cannot hold (config.kv_lora_rank is set)."""
    problems = []
    if config.moe_spec() is not None:
        types = config.mlp_layer_types
        dense = types.count("dense")
        if types != ["dense"] * dense + ["sparse"] * (len(types) - dense):
            problems.append(f"its dense layers come first (first_k_dense_replace); got mlp_layer_types={types}")
        if config.router_scoring != "sigmoid" or config.shared_expert_gate:
            problems.append(
                f"it routes with sigmoid scores and ungated shared experts; got router_scoring={config.router_scoring!r}, "
                f"shared_expert_gate={config.shared_expert_gate}"
            )
        if config.shared_expert_intermediate_size % config.moe_intermediate_size:
            problems.append(
                f"its shared experts are n_shared_experts x moe_intermediate_size ({config.moe_intermediate_size}) wide; "
                f"got shared_expert_intermediate_size={config.shared_expert_intermediate_size}"
            )
    if config.qk_norm or config.sandwich_norms or config.rms_norm_unit_offset or config.scale_embeddings:
        problems.append("it has no q/k norm and no Gemma norms or embedding scale")
    if problems:
        raise ConversionError("official DeepseekV3 cannot hold this MLA config: " + "; ".join(problems))


def official_fields(config) -> dict:
    """The DeepseekV3Config fields of an hf_tiny MLA config (checked by check_holds)."""
    check_holds(config)
    experts = getattr(config, "num_local_experts", 0)
    values = {name: getattr(config, name) for name in MLA_FIELDS}
    values.update(
        rope_interleave=True,  # DeepSeek's layout: attention_rules interleave the rotary rows back
        num_nextn_predict_layers=config.mtp_depth(),
    )
    if experts:
        values.update(
            n_routed_experts=experts,
            num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.moe_intermediate_size,
            norm_topk_prob=config.norm_topk_prob,
            n_group=config.n_group,
            topk_group=config.topk_group,
            routed_scaling_factor=config.routed_scaling_factor,
            n_shared_experts=config.shared_expert_intermediate_size // config.moe_intermediate_size,
            first_k_dense_replace=config.mlp_layer_types.count("dense"),
            output_router_logits=config.output_router_logits,
        )
    else:
        values.update(first_k_dense_replace=config.num_hidden_layers)
    return values


VARIANT = CausalVariant(
    "deepseek_v3", "DeepseekV3Config", llama_named_classes("DeepseekV3"), fields_from_official=fields_from_official,
    official_fields=official_fields, claims=claims, check_holds=check_holds, sparse_rules=sparse_rules,
)


def mtp_layers_held(config, state: dict, class_name: str, *, src):
    """(config, card note) for a checkpoint whose config announces num_nextn_predict_layers = D: D modules when the
    checkpoint holds all D (decoder layers num_hidden_layers .. + D - 1), none when it holds none (official
    transformers drops them when it saves, and keeps the field), an error when it holds some."""
    depth = config.mtp_depth()
    first = config.num_hidden_layers
    held = [k for k in range(depth) if f"model.layers.{first + k}.eh_proj.weight" in state]
    if held == list(range(depth)) and class_name == "TinyCausalForCausalLM":
        return config, (
            f"The checkpoint's {depth} Multi-Token Prediction module(s) (layers {first}..{first + depth - 1}) are kept "
            "as `mtp.*`; official transformers ignores them, so the parity rows cover the main model. Training with "
            f"labels adds their loss with weight mtp_loss_weight={config.mtp.mtp_loss_weight} (DeepSeek-V3's lambda), "
            "which official's loss does not have: set it to 0 for official's loss."
        )
    if held and class_name == "TinyCausalForCausalLM":
        missing = sorted(set(range(depth)) - set(held))
        raise ConversionError(
            f"{src}: config.json says num_nextn_predict_layers={depth} but the checkpoint holds MTP module(s) "
            f"{held} only (missing depth(s) {missing}: no model.layers.{first + missing[0]}.eh_proj.weight)"
        )
    del config.num_nextn_predict_layers, config.mtp_loss_weight  # a config without MTP holds no MTP field
    reason = "the checkpoint holds none" if not held else f"{class_name} has no MTP head"
    return config, f"config.json announces num_nextn_predict_layers={depth}, but {reason}: converted without MTP modules."
