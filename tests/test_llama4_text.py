"""Llama 4 text (`llama4_text`, Llama4ForCausalLM) as hf_tiny's causal LM: NoPE layers interleaved with RoPE ones,
chunked local attention on the RoPE layers (`chunked_attention` layers, `attention_chunk_size`), the weightless L2
q/k norm after RoPE on them (`qk_norm_type="l2"`), the query temperature on the NoPE layers
(`attn_temperature_tuning`), and MoE layers (sigmoid top-k routing on the expert inputs, a shared expert)
interleaved with dense ones. Logits per backend, greedy tokens and gradients against the official class, loaded
through the key table below (fused experts split, q/k rows from RoPE's interleaved pairs to rotate-half order)."""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers
import transformers.masking_utils
from transformers import GenerationConfig

from causal_helpers import BASE, randomize, small_paged_cache
from family_parity import (BACKENDS, TOLERANCE, assert_runtime_bit_identical, assert_same_greedy_tokens,
                           gradient_errors, greedy_tokens, load_ours, logits_error)
from hf_tiny import TinyCausalConfig

pytestmark = pytest.mark.usefixtures("single_torch_thread")

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


def tiny_llama4(variant: str, seed: int = 0):
    torch.manual_seed(seed)
    official = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**{**SHAPES, **VARIANTS[variant]}))
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
        router_aux_loss_coef=c.router_aux_loss_coef, router_jitter_noise=c.router_jitter_noise,
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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_official_per_backend(variant, backend):
    official = tiny_llama4(variant)
    assert logits_error(official, ours_for(official), backend) <= TOLERANCE


@pytest.mark.parametrize(
    "changes",
    [
        dict(layer_types=["full_attention"] * 4, attention_chunk_size=None),  # no chunks
        dict(attention_chunk_size=6),  # chunks of another size
        dict(attn_temperature_tuning=False),
        dict(qk_norm=False, qk_norm_type="head"),
        dict(apply_router_weight_on_input=False),  # weights on the expert outputs (SiLU is not linear)
        dict(nope_layers=[], attn_temperature_tuning=False),
    ],
)
def test_negative_control_each_switch_matters(changes):
    official = tiny_llama4("scout_like")
    assert logits_error(official, ours_for(official, **changes), "sdpa") > 100 * TOLERANCE


def test_negative_control_rotary_row_order_matters():
    official = tiny_llama4("scout_like")
    def unpermuted(name, tensor):
        return {name: tensor} if ".q_proj." in name or ".k_proj." in name else llama4_rename(name, tensor)

    wrong = load_ours(official, llama4_fields(official.config), unpermuted)
    assert logits_error(official, wrong, "sdpa") > 100 * TOLERANCE


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_tokens_with_cache_identical(variant):
    """12 new tokens: the 17- and 24-token rows decode across chunk boundaries (the chunked layers' cache keeps
    chunk_size - 1 keys)."""
    official = tiny_llama4(variant)
    assert_same_greedy_tokens(official, ours_for(official), new_tokens=12)


@pytest.mark.skipif(
    "block_sequence_ids" not in inspect.signature(transformers.masking_utils.create_chunked_causal_mask).parameters,
    reason="this transformers' generate() builds static-cache masks with create_masks_for_generate, which passes "
    "create_chunked_causal_mask a block_sequence_ids it does not take (TypeError for any chunked model)",
)
def test_greedy_tokens_with_a_static_cache_identical():
    """A static cache (the chunked layers' StaticSlidingWindowLayer holds chunk_size keys in fixed slots) gives
    official's tokens (those of its dynamic cache; its static cache gives the same)."""
    official = tiny_llama4("scout_like")
    official.set_attn_implementation("sdpa")
    expected = greedy_tokens(official, 12)
    ours = ours_for(official)
    ours.set_attn_implementation("sdpa")
    assert torch.equal(greedy_tokens(ours, 12, cache_implementation="static"), expected)


def test_training_loss_and_gradients_match_official():
    official = tiny_llama4("maverick_like_biases_top2")
    loss_error, gradient_error = gradient_errors(official, ours_for(official), llama4_rename)
    assert loss_error <= 1e-6
    assert gradient_error <= 1e-4
    # negative control: chunks of another size
    assert gradient_errors(official, ours_for(official, attention_chunk_size=6), llama4_rename)[1] > 1e-2


def test_runtime_on_and_off_bit_identical(monkeypatch):
    assert_runtime_bit_identical(ours_for(tiny_llama4("scout_like")), monkeypatch)


@pytest.mark.skipif(
    not hasattr(transformers.masking_utils, "remap_positions_for_packed_sequence"),
    reason="this transformers counts a packed row's chunks from the row's start, across its sequences (later "
    "versions count them per sequence: masking_utils.remap_positions_for_packed_sequence), as hf_tiny does",
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_rows_match_official(backend):
    """Padding-free packing (position ids restarting at 0, no attention mask): chunks count within each sequence,
    in every backend, as official's packed-sequence masks do; the query temperature counts the row's tokens, as
    official's does (it reads the cache length, not the positions)."""
    official = tiny_llama4("scout_like")
    ours = ours_for(official)
    ids = torch.randint(3, 97, (1, 23), generator=torch.Generator().manual_seed(3))
    position_ids = torch.cat([torch.arange(12), torch.arange(11)])[None]
    official.set_attn_implementation("sdpa")
    ours.set_attn_implementation(backend)
    with torch.no_grad():
        # official reads packing from the position ids only without a cache (training)
        expected = official(input_ids=ids, position_ids=position_ids, use_cache=False).logits
        produced = ours(input_ids=ids, position_ids=position_ids, use_cache=False).logits
        unpacked = ours(input_ids=ids, use_cache=False).logits  # negative control: one 23-token sequence
    scale = max(1.0, float(expected.abs().max()))
    assert float((produced - expected).abs().max()) <= TOLERANCE * scale
    assert float((unpacked - expected).abs().max()) > 100 * TOLERANCE * scale


def test_continuous_batching_refuses_chunked_layers():
    """transformers' paged cache has no allocator for chunked layers and says so (5.16.1 and 5.24 alike), before
    any forward; generate() is the way to decode them."""
    ours = ours_for(tiny_llama4("scout_like"))
    ids = [torch.randint(3, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9)]
    with pytest.raises(ValueError, match="chunked_attention"):
        ours.generate_batch(inputs=ids, generation_config=GenerationConfig(max_new_tokens=2, do_sample=False),
                            continuous_batching_config=small_paged_cache())
