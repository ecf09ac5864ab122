"""Llama 4 text checkpoints (`llama4_text`, Llama4ForCausalLM) <-> the hf_tiny causal LM: NoPE layers with query
temperature, chunked local attention on the rotary layers, L2 q/k norm, MoE with a shared expert (sigmoid router
weights applied to the expert inputs) interleaved with dense layers.

    ours (layer i)                                   Llama 4
    self_attn.q_proj / k_proj rows, per head         rotary pairs interleaved (x0, x1), (x2, x3) ... -> rotate-half
    mlp.{gate,up,down}_proj (dense layers)           feed_forward.{gate,up,down}_proj
    mlp.gate.weight                                  feed_forward.router.weight
    mlp.shared_experts.*                             feed_forward.shared_expert.*
    mlp.experts.{e}.gate_proj / up_proj.weight       feed_forward.experts.gate_up_proj [E, H, 2I]: halves, transposed
    mlp.experts.{e}.down_proj.weight                 feed_forward.experts.down_proj [E, I, H], transposed

The released checkpoints are multimodal (Llama4ForConditionalGeneration, model_type llama4): their text model is not
read from them here; a `llama4_text` folder (Llama4ForCausalLM) is.
"""

from __future__ import annotations

import torch

from hf_tiny.configuration_causal import field_value

from .causal_variant import CausalVariant, every_nth, no_rope_fields
from .errors import ConversionError
from .keymap import Rule, Transform

FIXED = dict(router_scoring="topk_sigmoid", norm_topk_prob=False, apply_router_weight_on_input=True)
MOE_FIELDS = ("num_local_experts", "num_experts_per_tok", "output_router_logits")
# Official Llama 4 text reads neither of these (no load-balancing loss beside its logits, no router jitter in training):
# hf_tiny's are 0 whatever the source says; nothing goes back (official's defaults: the source's values, unread, are
# not kept), as for DeepSeek-V3's aux loss
UNREAD_MOE_FIELDS = dict(router_aux_loss_coef=0.0, router_jitter_noise=0.0)


def claims(config) -> bool:
    return ("chunked_attention" in config.layer_types or field_value(config, "qk_norm_type") == "l2"
            or field_value(config, "router_scoring") == "topk_sigmoid" or bool(field_value(config, "attn_temperature_tuning")))


def check_holds(config) -> None:
    differ = {}
    if config.moe_spec() is not None:
        differ.update({name: field_value(config, name) for name in FIXED if field_value(config, name) != FIXED[name]})
        if config.shared_expert_intermediate_size != config.moe_intermediate_size:
            differ["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    if config.qk_norm and field_value(config, "qk_norm_type") != "l2":
        differ["qk_norm_type"] = field_value(config, "qk_norm_type")
    for name, wanted in (("sandwich_norms", False), ("pre_norms", True), ("mlp_bias", False), ("attention_sinks", False)):
        if field_value(config, name) != wanted:
            differ[name] = field_value(config, name)
    if "sliding_attention" in config.layer_types:
        differ["layer_types"] = sorted(set(config.layer_types))
    if differ:
        raise ConversionError(f"Llama 4 text needs {FIXED} (with MoE), a shared expert as wide as the experts, L2 q/k "
                              f"norm, pre-norms, no MLP biases and no sliding windows; this config has {differ}")


def fields_from_official(official, *, src) -> dict:
    """The Llama 4 fields; the MoE ones where the config has experts (with moe_layers empty, every layer dense: the
    experts' fields still name Llama 4 on the way back). num_local_experts=0 alone does not make official's layers
    dense: it builds its moe_layers as MoE layers of no experts, refused here."""
    layers = official.num_hidden_layers
    nope = [i for i, rotates in enumerate(official.no_rope_layers[:layers]) if not rotates]
    chunked = "chunked_attention" in official.layer_types
    values = dict(
        intermediate_size=official.intermediate_size_mlp, attention_bias=official.attention_bias,
        attention_chunk_size=official.attention_chunk_size if chunked else None, nope_layers=nope,
        qk_norm=official.use_qk_norm, qk_norm_type="l2" if official.use_qk_norm else "head",
        # official rotates q / k as float32 complex numbers (bf16 / fp16 models too; in float32 it changes nothing,
        # so the way back does not require it)
        rope_float32=True,
    )
    if official.moe_layers and not official.num_local_experts:
        raise ConversionError(f"Llama 4 config has moe_layers={official.moe_layers} but num_local_experts=0: MoE "
                              "layers without experts (give moe_layers=[] for a dense model)")
    if official.num_local_experts:
        values.update(
            mlp_layer_types=["sparse" if i in official.moe_layers else "dense" for i in range(layers)],
            moe_intermediate_size=official.intermediate_size, shared_expert_intermediate_size=official.intermediate_size,
            **FIXED, **{name: getattr(official, name) for name in MOE_FIELDS}, **UNREAD_MOE_FIELDS,
        )
    if official.attn_temperature_tuning and nope:  # it acts on NoPE layers only
        values.update(attn_temperature_tuning=True, floor_scale=official.floor_scale, attn_scale=official.attn_scale)
    return values


def official_fields(config) -> dict:
    moe = config.moe_spec() is not None
    values = dict(
        intermediate_size=config.moe_intermediate_size if moe else config.intermediate_size,
        intermediate_size_mlp=config.intermediate_size, head_dim=config.head_dim, attention_bias=config.attention_bias,
        layer_types=list(config.layer_types), attention_chunk_size=field_value(config, "attention_chunk_size"),
        **no_rope_fields(field_value(config, "nope_layers"), config.num_hidden_layers), use_qk_norm=config.qk_norm,
        attn_temperature_tuning=bool(field_value(config, "attn_temperature_tuning")),
        floor_scale=field_value(config, "floor_scale"), attn_scale=field_value(config, "attn_scale"),
        moe_layers=[i for i, kind in enumerate(field_value(config, "mlp_layer_types") or ()) if kind == "sparse"],
        **{name: field_value(config, name) for name in MOE_FIELDS},
    )
    if not moe:
        values["num_local_experts"] = 0
    layers = config.num_hidden_layers
    values["interleave_moe_layer_step"] = every_nth(lambda n: list(range(n - 1, layers, n)), values["moe_layers"],
                                                    layers, default=1)
    return values


def rotary_rows(heads: int) -> Transform:
    """q/k rows (weight or bias) of each head: Llama 4's interleaved rotary pairs <-> rotate-half order."""

    def to_halves(tensor: torch.Tensor) -> torch.Tensor:
        rest = tensor.shape[1:]
        return tensor.reshape(heads, -1, 2, *rest).transpose(1, 2).reshape(tensor.shape).contiguous()

    def to_interleaved(tensor: torch.Tensor) -> torch.Tensor:
        rest = tensor.shape[1:]
        return tensor.reshape(heads, 2, -1, *rest).transpose(1, 2).reshape(tensor.shape).contiguous()

    return Transform(f"llama4_rotary_rows({heads} heads)", to_halves, to_interleaved)


def adapt_layer_rules(config, layer: str, rules: list) -> list:
    """The Llama-named rules of one layer in Llama 4's names: q/k rows permuted, the dense MLP under feed_forward."""
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    adapted = []
    for rule in rules:
        rule = rule if isinstance(rule, Rule) else Rule(*rule)
        if rule.transform is not None or len(rule.source) != 1 or len(rule.target) != 1:
            adapted.append(rule)
            continue
        (source,), (target,) = rule.source, rule.target
        projection = source.removeprefix(f"{layer}self_attn.").split(".")[0]
        if source.startswith(f"{layer}self_attn.") and projection in heads:
            rule = Rule(source, target, rotary_rows(heads[projection]), rule.optional)
        elif source.startswith(f"{layer}mlp.") and rule.transform is None:
            rule = Rule(source.replace(f"{layer}mlp.", f"{layer}feed_forward.", 1), target, None, rule.optional)
        adapted.append(rule)
    return adapted


def sparse_rules(config, layer: str) -> list:
    """Rules of one MoE layer (layer: a concrete layer prefix)."""
    official, ours, experts = f"{layer}feed_forward.", f"{layer}mlp.", config.num_local_experts
    rules = [(f"{official}router.weight", f"{ours}gate.weight")]
    rules += [(f"{official}shared_expert.{p}.weight", f"{ours}shared_experts.{p}.weight")
              for p in ("gate_proj", "up_proj", "down_proj")]
    gate_up = tuple(f"{ours}experts.{e}.{p}.weight" for p in ("gate_proj", "up_proj") for e in range(experts))
    rules.append(Rule(f"{official}experts.gate_up_proj", gate_up, _fused_gate_up(experts)))
    down = tuple(f"{ours}experts.{e}.down_proj.weight" for e in range(experts))
    rules.append(Rule(f"{official}experts.down_proj", down, _fused_down(experts)))
    return rules


def _fused_gate_up(experts: int) -> Transform:
    """gate_up_proj [E, H, 2I] (gate the first half, up the second) <-> every expert's gate, then every up ([I, H])."""

    def split(fused: torch.Tensor):
        gate, up = fused.chunk(2, dim=-1)
        return tuple(w.T.contiguous() for w in (*gate, *up))

    def join(*parts: torch.Tensor) -> torch.Tensor:
        gates, ups = parts[:experts], parts[experts:]
        return torch.stack([torch.cat([g.T, u.T], dim=-1) for g, u in zip(gates, ups)])

    return Transform(f"llama4_gate_up({experts} experts)", split, join)


def _fused_down(experts: int) -> Transform:
    return Transform(f"llama4_down({experts} experts)", lambda fused: tuple(w.T.contiguous() for w in fused),
                     lambda *parts: torch.stack([w.T for w in parts]))


VARIANT = CausalVariant(
    "llama4_text", "Llama4TextConfig", {"TinyCausalForCausalLM": "Llama4ForCausalLM", "TinyCausalModel": "Llama4TextModel"},
    fields_from_official=fields_from_official, official_fields=official_fields, claims=claims, check_holds=check_holds,
    adapt_layer_rules=adapt_layer_rules, sparse_rules=sparse_rules,
)
