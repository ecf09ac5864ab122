"""OLMo 2 (`olmo2`, Olmo2ForCausalLM) as hf_tiny's causal LM with norms after each sublayer instead of before
(`pre_norms=False` + `sandwich_norms`: h = x + norm(attn(x)), out = h + norm(mlp(h))) and the q/k RMSNorm over the
whole projection (`qk_norm_type="projection"`): logits per backend, greedy tokens and gradients against the
official class, loaded through the key table below."""

from __future__ import annotations

import pytest
import torch

from family_parity import (BACKENDS, TOLERANCE, assert_runtime_bit_identical, assert_same_greedy_tokens,
                           gradient_errors, load_ours, logits_error)
from causal_helpers import left_padded_batch, real_logits
from family_parity import LENGTHS
from hf_tiny import TinyCausalConfig
from olmo2_models import OLMO2_LAYOUT, RENAMES, SHAPES, VARIANTS, olmo2_fields, olmo2_rename, ours_for, tiny_olmo2

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_official_per_backend(variant, backend):
    official = tiny_olmo2(variant)
    assert logits_error(official, ours_for(official), backend) <= TOLERANCE


def test_negative_control_norm_placement_matters():
    """Per-head q/k norms (Qwen3's) with the projection-wide weights read per head, or pre-norms kept (Gemma 3's
    sandwich with the input norms at 1): both caught."""
    official = tiny_olmo2("gqa")
    ours = ours_for(official)
    per_head = TinyCausalConfig(**{**olmo2_fields(official.config), "qk_norm_type": "head"})
    wrong = type(ours)(per_head).eval()
    with torch.no_grad():
        state = {name: tensor[: per_head.head_dim] if name.endswith(("q_norm.weight", "k_norm.weight")) else tensor
                 for name, tensor in ours.state_dict().items()}
    wrong.load_state_dict(state)
    assert logits_error(official, wrong, "sdpa") > 100 * TOLERANCE
    pre_norms = type(ours)(TinyCausalConfig(**{**olmo2_fields(official.config), "pre_norms": True})).eval()
    pre_norms.load_state_dict(ours.state_dict(), strict=False)
    assert logits_error(official, pre_norms, "sdpa") > 100 * TOLERANCE


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_tokens_with_cache_identical(variant):
    official = tiny_olmo2(variant)
    assert_same_greedy_tokens(official, ours_for(official))


def test_training_loss_and_gradients_match_official():
    official = tiny_olmo2("mha_biases_tied_theta")
    loss_error, gradient_error = gradient_errors(official, ours_for(official), olmo2_rename)
    assert loss_error <= 1e-6
    assert gradient_error <= 1e-4
    # negative control: the two output norms swapped in the key table
    def swapped(name, tensor):
        for official_part, ours_part in zip(RENAMES, reversed(RENAMES.values())):
            name = name.replace(official_part, ours_part)
        return {name: tensor}

    wrong = load_ours(official, olmo2_fields(official.config), swapped)
    assert gradient_errors(official, wrong, olmo2_rename)[1] > 1e-2


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(qk_norm_type="projection"), r"qk_norm_type='projection' needs qk_norm=True"),
        (dict(qk_norm=True, qk_norm_type="rows"), "qk_norm_type"),
        (dict(pre_norms=False), r"pre_norms=False needs sandwich_norms=True"),
    ],
)
def test_bad_norm_layouts_are_clear_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        TinyCausalConfig(**{**SHAPES, **changes})


def test_layout_fields_exist_in_config_json_only_when_used():
    plain = TinyCausalConfig(**SHAPES).to_dict()
    assert not {"pre_norms", "qk_norm_type"} & set(plain)
    olmo2 = TinyCausalConfig(**SHAPES, **OLMO2_LAYOUT).to_dict()
    assert (olmo2["pre_norms"], olmo2["qk_norm_type"]) == (False, "projection")


def test_runtime_on_and_off_bit_identical(monkeypatch):
    assert_runtime_bit_identical(ours_for(tiny_olmo2("mha_biases_tied_theta")), monkeypatch)


def _bf16_logits(model, backend="sdpa"):
    model = model.to(torch.bfloat16)
    model.set_attn_implementation(backend)
    batch = left_padded_batch(model.config.vocab_size, LENGTHS)
    return real_logits(model, batch).float()


def test_bf16_logits_equal_official_bit_for_bit_with_its_rounding():
    """OLMo 2 multiplies its norm weights into float32 states and rotates q/k in float32 (norm_product_float32,
    rope_float32). With Llama's rounding instead (both off: the negative control) bf16 logits were 0.156 off
    official's (official's own distance from float32 0.136)."""
    official = tiny_olmo2("gqa")
    ours = ours_for(official)
    llama_rounding = ours_for(official, norm_product_float32=False, rope_float32=False)
    expected = _bf16_logits(official)
    assert torch.equal(_bf16_logits(ours), expected)
    assert not torch.equal(_bf16_logits(llama_rounding), expected)
