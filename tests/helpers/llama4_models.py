"""Tiny official Llama 4 text models of every tested variant and their hf_tiny twins."""

from __future__ import annotations

import torch
import transformers
import transformers.masking_utils
from causal_helpers import BASE, randomize
from family_parity import (load_ours)


SHAPES = dict(BASE, hidden_size=36, intermediate_size=20, intermediate_size_mlp=44, num_hidden_layers=4,
              num_attention_heads=6, num_key_value_heads=2, head_dim=6, num_local_experts=3,
              interleave_moe_layer_step=2, attention_chunk_size=5, no_rope_layer_interval=2, floor_scale=4,
              attn_scale=0.5)


VARIANTS = {
    # the 16E layout: every layer MoE, NoPE every 2nd layer with temperature, L2 q/k norm
    "scout_like": dict(interleave_moe_layer_step=1),
    # the 128E layout: dense / MoE interleaved, no q/k norm, biases, top-2 routing
    "maverick_like_biases_top2": dict(use_qk_norm=False, attention_bias=True, num_experts_per_tok=2),
}


# official name part -> ours (Llama's names; the fused experts and the q/k rows are handled in llama4_rename)
RENAMES = {".feed_forward.router.": ".mlp.gate.", ".feed_forward.shared_expert.": ".mlp.shared_experts.",
           ".feed_forward.": ".mlp."}


def tiny_llama4(variant: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    fields = {**SHAPES, **VARIANTS[variant], **overrides}
    official = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**fields))
    return randomize(official, seed).eval()


def llama4_fields(official_config) -> dict:
    """Llama4TextConfig -> TinyCausalConfig. intermediate_size (experts and shared expert) and
    intermediate_size_mlp (dense layers) swap roles; no_rope_layers (1 = rotates) become the NoPE indices;
    moe_layers become mlp_layer_types."""
    c = official_config
    chunked = "chunked_attention" in c.layer_types
    nope = [i for i, rotates in enumerate(c.no_rope_layers[: c.num_hidden_layers]) if not rotates]
    temperature = c.attn_temperature_tuning and bool(nope)  # it acts on NoPE layers only
    return dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size_mlp,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_parameters=dict(c.rope_parameters), attention_bias=c.attention_bias,
        tie_word_embeddings=c.tie_word_embeddings, pad_token_id=c.pad_token_id, bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id, layer_types=list(c.layer_types),
        attention_chunk_size=c.attention_chunk_size if chunked else None,
        nope_layers=nope, qk_norm=c.use_qk_norm, qk_norm_type="l2" if c.use_qk_norm else "head",
        attn_temperature_tuning=temperature, floor_scale=c.floor_scale, attn_scale=c.attn_scale,
        num_local_experts=c.num_local_experts, num_experts_per_tok=c.num_experts_per_tok,
        moe_intermediate_size=c.intermediate_size, shared_expert_intermediate_size=c.intermediate_size,
        router_scoring="topk_sigmoid", norm_topk_prob=False, apply_router_weight_on_input=True,
        mlp_layer_types=["sparse" if i in c.moe_layers else "dense" for i in range(c.num_hidden_layers)],
        # official Llama 4 reads neither the aux-loss coefficient nor the jitter (conversion/llama4.py)
        router_aux_loss_coef=0.0, router_jitter_noise=0.0, output_router_logits=c.output_router_logits,
        rope_float32=True,  # official's q / k rotation in float32 (its bf16 / fp16 rounding)
    )


def rotate_half_rows(tensor: torch.Tensor, head_dim: int) -> torch.Tensor:
    """q/k projection rows (weight or bias) of each head from RoPE's interleaved pairs (x0, x1), (x2, x3), ..
    (Llama 4's complex rotation) to rotate-half order x0, x2, .., x1, x3, .. (hf_tiny's, Llama's)."""
    heads = tensor.shape[0] // head_dim
    return tensor.reshape(heads, head_dim // 2, 2, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)


def llama4_rename(name: str, tensor: torch.Tensor, head_dim: int = SHAPES["head_dim"]) -> dict:
    if name.endswith((".q_proj.weight", ".k_proj.weight", ".q_proj.bias", ".k_proj.bias")):
        return {name: rotate_half_rows(tensor, head_dim)}
    for official, ours in RENAMES.items():
        name = name.replace(official, ours)
    if name.endswith(".mlp.experts.gate_up_proj"):  # [E, hidden, 2 * I]: gate then up, transposed
        gate, up = tensor.chunk(2, dim=-1)
        prefix = name.removesuffix("gate_up_proj")
        return {**{f"{prefix}{e}.gate_proj.weight": w.T for e, w in enumerate(gate)},
                **{f"{prefix}{e}.up_proj.weight": w.T for e, w in enumerate(up)}}
    if name.endswith(".mlp.experts.down_proj"):  # [E, I, hidden], transposed
        prefix = name.removesuffix("down_proj")
        return {f"{prefix}{e}.down_proj.weight": w.T for e, w in enumerate(tensor)}
    return {name: tensor}


def ours_for(official, **changes):
    return load_ours(official, {**llama4_fields(official.config), **changes}, llama4_rename)
