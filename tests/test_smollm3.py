"""SmolLM3 (`smollm3`, SmolLM3ForCausalLM) as hf_tiny's causal LM with NoPE layers (`nope_layers`: layers that do
not rotate their queries and keys) and GQA: logits per backend, greedy tokens and gradients against the official
class, loaded through the key table below (SmolLM3's names are Llama's)."""

from __future__ import annotations

import pytest
import torch
import transformers

from causal_helpers import BASE, randomize
from family_parity import (BACKENDS, TOLERANCE, assert_runtime_bit_identical, assert_same_greedy_tokens,
                           gradient_errors, load_ours, logits_error)
from hf_tiny import TinyCausalConfig

pytestmark = pytest.mark.usefixtures("single_torch_thread")

SHAPES = dict(BASE, hidden_size=36, intermediate_size=44, num_hidden_layers=4, num_attention_heads=6,
              num_key_value_heads=3)
VARIANTS = {
    # every 2nd layer without RoPE (SmolLM3-3B: every 4th), untied head
    "nope_every_2nd": dict(no_rope_layer_interval=2, tie_word_embeddings=False),
    # SmolLM3's sliding windows (on the NoPE layers), biases everywhere, tied head, explicit no_rope_layers
    "sliding_nope_biases_tied": dict(no_rope_layers=[1, 0, 0, 1], use_sliding_window=True, sliding_window=5,
                                     attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
}


def tiny_smollm3(variant: str, seed: int = 0):
    torch.manual_seed(seed)
    official = transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(**SHAPES, **VARIANTS[variant]))
    return randomize(official, seed).eval()


def smollm3_fields(official_config) -> dict:
    """SmolLM3Config -> TinyCausalConfig: Llama's fields, plus no_rope_layers (1 = rotates) read as the indices
    of the layers that do not; the window only where use_sliding_window turns it on."""
    c = official_config
    sliding = "sliding_attention" in c.layer_types
    return dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_parameters=dict(c.rope_parameters), attention_bias=c.attention_bias, mlp_bias=c.mlp_bias,
        tie_word_embeddings=c.tie_word_embeddings, layer_types=list(c.layer_types),
        sliding_window=c.sliding_window if sliding else None,
        nope_layers=[i for i, rotates in enumerate(c.no_rope_layers[: c.num_hidden_layers]) if not rotates],
        pad_token_id=c.pad_token_id, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
    )


def smollm3_rename(name: str, tensor: torch.Tensor) -> dict:
    return {name: tensor}  # SmolLM3's tensors carry Llama's names


def ours_for(official, **changes):
    return load_ours(official, {**smollm3_fields(official.config), **changes}, smollm3_rename)


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
