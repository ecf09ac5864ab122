"""Mixture-of-Experts checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE) <-> the hf_tiny causal LM with its sparse
feed-forward (hf_tiny/moe.py). The rest of each model is the Llama block (conversion/llama.py); this module is the
table of what the MoE part is called and configured like in each official model type.

Official checkpoints store one tensor per expert and projection (transformers v5 fuses them into 3-D tensors
when it loads, and splits them again when it saves); so do we, under Llama's projection names:

    ours (layer i, expert e)                    Mixtral (on disk)                        Qwen2/3-MoE
    mlp.gate.weight                             block_sparse_moe.gate.weight             mlp.gate.weight
    mlp.experts.{e}.gate_proj|up_proj|down_proj block_sparse_moe.experts.{e}.w1|w3|w2    mlp.experts.{e}.<same>
    mlp.shared_experts.<proj>                   -                                        mlp.shared_expert.<proj> (Qwen2)
    mlp.shared_expert_gate.weight               -                                        mlp.shared_expert_gate.weight (Qwen2)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

from .causal_variant import CausalVariant, llama_named_classes
from .errors import ConversionError

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class MoeLayout:
    block: str  # the sparse feed-forward's module name in a layer
    expert_projections: dict = field(default_factory=lambda: {name: name for name in EXPERT_PROJECTIONS})
    shared_expert: str | None = None  # official name of the shared expert MLP (ours: shared_experts)


MOE_LAYOUTS = {
    "mixtral": MoeLayout("block_sparse_moe", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}),
    "qwen2_moe": MoeLayout("mlp", shared_expert="shared_expert"),
    "qwen3_moe": MoeLayout("mlp"),
}
MOE_MODEL_TYPES = tuple(MOE_LAYOUTS)
OFFICIAL_PREFIXES = {"mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe"}


def moe_rules(config, layer: str, family: str) -> list:
    """Key rules of the sparse layers (layer: the layer prefix template with {i} already filled in for one
    layer index), and the dense feed-forward rules of the dense layers, for one layer."""
    layout = MOE_LAYOUTS[family]
    official = f"{layer}{layout.block}."
    rules = [(f"{official}gate.weight", f"{layer}mlp.gate.weight")]
    for ours, theirs in layout.expert_projections.items():
        rules.append((f"{official}experts.{{e}}.{theirs}.weight", f"{layer}mlp.experts.{{e}}.{ours}.weight"))
    if config.shared_expert_intermediate_size:
        for name in EXPERT_PROJECTIONS:
            rules.append((f"{official}{layout.shared_expert}.{name}.weight", f"{layer}mlp.shared_experts.{name}.weight"))
        if config.shared_expert_gate:
            rules.append((f"{official}shared_expert_gate.weight", f"{layer}mlp.shared_expert_gate.weight"))
    return rules


def moe_fields_from_official(official, *, src) -> dict:
    """TinyCausalConfig's MoE fields (and the attention fields that differ by type) for an official Mixtral /
    Qwen2-MoE / Qwen3-MoE config."""
    model_type = official.model_type
    num_layers = official.num_hidden_layers
    values = dict(
        num_local_experts=official.num_local_experts if model_type == "mixtral" else official.num_experts,
        num_experts_per_tok=official.num_experts_per_tok,
        router_scoring="softmax",
        router_aux_loss_coef=official.router_aux_loss_coef,
        output_router_logits=official.output_router_logits,
    )
    if model_type == "mixtral":
        values.update(norm_topk_prob=True, router_jitter_noise=official.router_jitter_noise,
                      mlp_layer_types=["sparse"] * num_layers)
        return values
    if getattr(official, "use_sliding_window", False):
        raise ConversionError(
            f"{src}: {model_type} with use_sliding_window=True is not supported (no released checkpoint uses it); "
            "only use_sliding_window=False is"
        )
    sparse = [
        i not in (official.mlp_only_layers or []) and official.num_experts > 0 and (i + 1) % official.decoder_sparse_step == 0
        for i in range(num_layers)
    ]
    values.update(
        moe_intermediate_size=official.moe_intermediate_size,
        norm_topk_prob=official.norm_topk_prob,
        mlp_layer_types=["sparse" if s else "dense" for s in sparse],
    )
    if model_type == "qwen2_moe":  # biases on q/k/v (qkv_bias), none on o_proj
        values.update(shared_expert_intermediate_size=official.shared_expert_intermediate_size, shared_expert_gate=True,
                      attention_bias=official.qkv_bias, attention_output_bias=False, sliding_window=None)
    else:
        values.update(attention_bias=official.attention_bias, qk_norm=True, sliding_window=None)
    return values


def official_moe_family(config) -> str:
    """The official MoE model type that holds this hf_tiny config (num_local_experts > 0), or an error naming
    what no official MoE class has."""
    out_bias = config.attention_bias if config.attention_output_bias is None else config.attention_output_bias
    problems = []
    if config.router_scoring != "softmax" or config.n_group != 1 or config.routed_scaling_factor != 1.0:
        problems.append(
            f"router_scoring={config.router_scoring!r}, n_group={config.n_group}, routed_scaling_factor="
            f"{config.routed_scaling_factor} (sigmoid / grouped routing is DeepSeek-V3's, which also needs MLA)"
        )
    gemma = {name: getattr(config, name) for name in ("sandwich_norms", "rms_norm_unit_offset", "scale_embeddings")}
    if any(gemma.values()) or config.query_pre_attn_scalar is not None or config.final_logit_softcapping is not None:
        problems.append(f"no official MoE class has Gemma's norms, scales or soft-capping ({gemma})")
    if config.qk_norm:
        if config.shared_expert_intermediate_size or config.attention_bias != out_bias:
            problems.append(
                "Qwen3-MoE (qk_norm) has no shared experts and one attention_bias for q/k/v/o; got "
                f"shared_expert_intermediate_size={config.shared_expert_intermediate_size}, attention_bias="
                f"{config.attention_bias}, attention_output_bias={config.attention_output_bias}"
            )
        family = "qwen3_moe"
    elif config.shared_expert_intermediate_size:
        if not config.shared_expert_gate or out_bias:
            problems.append(
                "shared experts exist officially in Qwen2-MoE, with shared_expert_gate=True and no o_proj bias; got "
                f"shared_expert_gate={config.shared_expert_gate}, attention_output_bias={out_bias}"
            )
        family = "qwen2_moe"
    else:
        uniform = config.mlp_layer_types == ["sparse"] * config.num_hidden_layers
        if not uniform or config.attention_bias or out_bias or not config.norm_topk_prob:
            problems.append(
                "Mixtral has every layer sparse, no attention biases and renormalized top-k weights; Qwen2-MoE (the "
                "official class for dense layers, biases or norm_topk_prob=False without qk_norm) needs shared "
                f"experts; got mlp_layer_types={config.mlp_layer_types}, attention_bias={config.attention_bias}, "
                f"norm_topk_prob={config.norm_topk_prob}"
            )
        family = "mixtral"
    if family != "mixtral" and (config.router_jitter_noise or "sliding_attention" in config.layer_types):
        problems.append(
            f"{family} has no router_jitter_noise ({config.router_jitter_noise}) and no sliding windows here "
            f"(layer_types {sorted(set(config.layer_types))})"
        )
    if problems:
        raise ConversionError("no official MoE class holds this config: " + "; ".join(problems))
    return family


def official_moe_config_fields(config, family: str) -> dict:
    """The official config's MoE fields (and the attention fields that differ by type) for an hf_tiny config."""
    values = dict(
        num_experts_per_tok=config.num_experts_per_tok,
        router_aux_loss_coef=config.router_aux_loss_coef,
        output_router_logits=config.output_router_logits,
    )
    if family == "mixtral":  # Mixtral's experts are intermediate_size wide; it has no dense layers
        values.update(num_local_experts=config.num_local_experts, router_jitter_noise=config.router_jitter_noise,
                      sliding_window=config.sliding_window, head_dim=config.head_dim,
                      intermediate_size=config.moe_intermediate_size)
        return values
    values.update(
        num_experts=config.num_local_experts,
        moe_intermediate_size=config.moe_intermediate_size,
        norm_topk_prob=config.norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i, kind in enumerate(config.mlp_layer_types) if kind == "dense"],
        use_sliding_window=False,
        head_dim=config.head_dim,
    )
    if family == "qwen2_moe":
        values.update(shared_expert_intermediate_size=config.shared_expert_intermediate_size,
                      qkv_bias=config.attention_bias, layer_types=list(config.layer_types))
    else:
        values.update(attention_bias=config.attention_bias)
    return values


def _variant(model_type: str, prefix: str) -> CausalVariant:
    return CausalVariant(model_type, f"{prefix}Config", llama_named_classes(prefix),
                         fields_from_official=moe_fields_from_official,
                         official_fields=partial(official_moe_config_fields, family=model_type),
                         sparse_rules=partial(moe_rules, family=model_type))


VARIANTS = tuple(_variant(model_type, prefix) for model_type, prefix in OFFICIAL_PREFIXES.items())
