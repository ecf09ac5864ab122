"""SmolLM3 (`smollm3`, SmolLM3ForCausalLM) as hf_tiny's causal LM with NoPE layers (`nope_layers`: layers that do
not rotate their queries and keys) and GQA: logits per backend, greedy tokens and gradients against the official
class, loaded through the key table below (SmolLM3's names are Llama's)."""

from __future__ import annotations

import pytest

from family_parity import (BACKENDS, TOLERANCE, assert_runtime_bit_identical, assert_same_greedy_tokens,
                           gradient_errors, logits_error)
from hf_tiny import TinyCausalConfig
from smollm3_models import SHAPES, VARIANTS, ours_for, smollm3_fields, smollm3_rename, tiny_smollm3

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_official_per_backend(variant, backend):
    official = tiny_smollm3(variant)
    if backend == "flash_attention_2" and VARIANTS[variant].get("use_sliding_window"):
        # on CPU flash is PyTorch's kernel, which has no windows (our Triton kernel has: test_flash_triton.py)
        with pytest.raises(ValueError, match="needs attn_implementation='sdpa' or 'eager'"):
            logits_error(official, ours_for(official), backend)
        return
    assert logits_error(official, ours_for(official), backend) <= TOLERANCE


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_negative_control_nope_layers_matter(variant):
    """Rotating every layer, or the wrong ones, is caught: the check above sees a misplaced NoPE layer."""
    official = tiny_smollm3(variant)
    nope = smollm3_fields(official.config)["nope_layers"]
    for wrong in ([], [(i + 1) % official.config.num_hidden_layers for i in nope]):
        assert logits_error(official, ours_for(official, nope_layers=wrong), "sdpa") > 100 * TOLERANCE


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_tokens_with_cache_identical(variant):
    official = tiny_smollm3(variant)
    windowed = VARIANTS[variant].get("use_sliding_window")  # no windows in CPU flash
    assert_same_greedy_tokens(official, ours_for(official), ("sdpa",) if windowed else ("sdpa", "flash_attention_2"))


def test_training_loss_and_gradients_match_official():
    official = tiny_smollm3("sliding_nope_biases_tied")
    loss_error, gradient_error = gradient_errors(official, ours_for(official), smollm3_rename)
    assert loss_error <= 1e-6
    assert gradient_error <= 1e-4
    # negative control: the same weights rotating every layer
    assert gradient_errors(official, ours_for(official, nope_layers=[]), smollm3_rename)[1] > 1e-2


@pytest.mark.parametrize(
    "changes, error, message",
    [
        (dict(nope_layers=[4]), ValueError, r"nope_layers=\[4\] must list distinct layer indices 0 .. 3"),
        (dict(nope_layers=[1, 1]), ValueError, "repeated indices"),
        (dict(nope_layers=[True]), TypeError, "nope_layers must be a list of layer indices"),
        (dict(nope_layers=[0], position_embedding_type="learned"), ValueError, "needs position_embedding_type='rope'"),
    ],
)
def test_bad_nope_layers_are_clear_errors(changes, error, message):
    with pytest.raises(error, match=message):
        TinyCausalConfig(**{**SHAPES, **changes})


def test_nope_layers_exist_in_config_json_only_when_used():
    assert "nope_layers" not in TinyCausalConfig(**SHAPES).to_dict()
    assert TinyCausalConfig(**SHAPES, nope_layers=[3, 1]).to_dict()["nope_layers"] == [1, 3]


def test_runtime_on_and_off_bit_identical(monkeypatch):
    assert_runtime_bit_identical(ours_for(tiny_smollm3("sliding_nope_biases_tied")), monkeypatch)
