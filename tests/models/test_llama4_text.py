"""Llama 4 text (`llama4_text`, Llama4ForCausalLM) as hf_tiny's causal LM: NoPE layers interleaved with RoPE ones,
chunked local attention on the RoPE layers (`chunked_attention` layers, `attention_chunk_size`), the weightless L2
q/k norm after RoPE on them (`qk_norm_type="l2"`), the query temperature on the NoPE layers
(`attn_temperature_tuning`), and MoE layers (sigmoid top-k routing on the expert inputs, a shared expert)
interleaved with dense ones. Logits per backend, greedy tokens and gradients against the official class, loaded
through the key table below (fused experts split, q/k rows from RoPE's interleaved pairs to rotate-half order)."""

from __future__ import annotations

import pytest
import torch
import transformers
import transformers.masking_utils
from transformers import GenerationConfig

from causal_helpers import left_padded_batch, real_logits, small_paged_cache
from family_parity import (BACKENDS, TOLERANCE, assert_runtime_bit_identical, assert_same_greedy_tokens,
                           gradient_errors, greedy_tokens, load_ours, logits_error)
from llama4_models import VARIANTS, llama4_fields, llama4_rename, ours_for, tiny_llama4

pytestmark = pytest.mark.usefixtures("single_torch_thread")


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


def _half_logits(model, dtype):
    model = model.to(dtype)
    model.set_attn_implementation("sdpa")
    return real_logits(model, left_padded_batch(model.config.vocab_size, (9, 6))).float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_half_precision_logits_equal_official_bit_for_bit_with_its_float32_rotation(variant, dtype):
    """Official rotates q / k as float32 complex numbers in a bf16 / fp16 model (rope_float32, which the converter
    sets). Negative control: rotated in the model's dtype (Llama's rounding), bf16 logits were 0.22 off official's."""
    official = tiny_llama4(variant)
    expected = _half_logits(official, dtype)
    assert torch.equal(_half_logits(ours_for(official), dtype), expected)
    assert not torch.equal(_half_logits(ours_for(official, rope_float32=False), dtype), expected)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_tokens_with_cache_identical(variant):
    """12 new tokens: the 17- and 24-token rows decode across chunk boundaries (the chunked layers' cache keeps
    chunk_size - 1 keys)."""
    official = tiny_llama4(variant)
    assert_same_greedy_tokens(official, ours_for(official), new_tokens=12)


def test_greedy_tokens_with_a_static_cache_identical():
    """A static cache (the chunked layers' StaticSlidingWindowLayer holds chunk_size keys in fixed slots) gives
    official's tokens (those of its dynamic cache; its static cache gives the same from transformers 5.20 on: before,
    its mask builder passes create_chunked_causal_mask a block_sequence_ids it does not take, a TypeError; hf_tiny
    builds these masks in its forward)."""
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
