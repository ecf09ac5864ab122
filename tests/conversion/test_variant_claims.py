"""Legal checkpoints of the 2025 types that lack the field their type used to be recognised by (SmolLM3 without a NoPE
layer, Llama 4 text without chunked attention, L2 q/k norm, temperature or experts) convert through `python -m
conversion`: the official side is the source's own model type (config.json says which), with parity. The way back
is decided by the hf_tiny config's fields: to the source's type where the fields say it (bit-exact), else to the
official type that holds the same model (its official class gives the source's logits).

Issue 41.2: a SmolLM3 whose sliding windows alternate with full attention and which has no NoPE layer was refused
("per-layer sliding windows ... exist officially in Qwen2 ..."), and a Llama 4 text checkpoint without experts was
refused or measured against another class."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_tiny  # noqa: F401
from conversion import ConversionError, detect_family, llama, llama4, llama_configs, smollm3
from conversion.__main__ import main
from family_parity import TOLERANCE, logits_error

pytestmark = pytest.mark.usefixtures("single_torch_thread")

SHAPES = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.3)
SMOLLM3 = dict(intermediate_size=48, use_sliding_window=True, sliding_window=4, no_rope_layers=[1, 1])
# Every layer full attention (layer_types given; transformers 5.16.1 builds the chunked mask whatever the layer types,
# so the chunk size stays set, unused)
LLAMA4 = dict(intermediate_size=16, intermediate_size_mlp=48, head_dim=8, num_local_experts=0, moe_layers=[],
              use_qk_norm=False, no_rope_layers=[1, 1], layer_types=["full_attention"] * 2, attn_temperature_tuning=False)
CASES = {  # case -> (official config class, its fields, official class, the model type it goes back to)
    # the checkpoint: windows on layer 0, full attention on layer 1, no NoPE layer
    "smollm3_windows_and_full_no_nope": (
        "SmolLM3Config", dict(SMOLLM3, layer_types=["sliding_attention", "full_attention"]), "SmolLM3ForCausalLM",
        "smollm3"),
    "smollm3_windows_everywhere_biases": (
        "SmolLM3Config", dict(SMOLLM3, layer_types=["sliding_attention"] * 2, attention_bias=True, mlp_bias=True),
        "SmolLM3ForCausalLM", "smollm3"),
    "smollm3_windows_everywhere": (  # Mistral's model
        "SmolLM3Config", dict(SMOLLM3, layer_types=["sliding_attention"] * 2), "SmolLM3ForCausalLM", "mistral"),
    "smollm3_no_nope_no_window": (  # Llama's model
        "SmolLM3Config", dict(SMOLLM3, use_sliding_window=False, sliding_window=None), "SmolLM3ForCausalLM", "llama"),
    "llama4_dense_no_nope": ("Llama4TextConfig", LLAMA4, "Llama4ForCausalLM", "llama"),  # interleaved q/k rows
    "llama4_dense_one_nope_layer": (  # SmolLM3's model
        "Llama4TextConfig", dict(LLAMA4, no_rope_layers=[0, 1]), "Llama4ForCausalLM", "smollm3"),
    "llama4_experts_on_no_layer": (
        "Llama4TextConfig", dict(LLAMA4, num_local_experts=2), "Llama4ForCausalLM", "llama4_text"),
}


def official_model(case: str):
    config_class, fields, official_class, _ = CASES[case]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**SHAPES, **fields)
    return getattr(transformers, official_class)(config).eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_converts_with_parity_and_goes_back_to_the_type_its_fields_name(case, tmp_path):
    official = official_model(case)
    official.save_pretrained(tmp_path / "src")
    model_type = official.config.model_type
    assert detect_family(tmp_path / "src") == ("llama", f"model_type {model_type!r}")
    result = llama.convert(tmp_path / "src", tmp_path / "ours")
    assert result["architecture"] == type(official).__name__  # the source's own class is the parity reference
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    for backend in ("eager", "sdpa"):
        assert logits_error(official, ours, backend) <= TOLERANCE, backend

    assert main(["llama", str(tmp_path / "ours"), str(tmp_path / "back"), "--reverse"]) == 0
    back_type = json.loads((tmp_path / "back" / "config.json").read_text())["model_type"]
    assert back_type == CASES[case][3]
    if back_type == model_type:
        source, back = (load_file(tmp_path / folder / "model.safetensors") for folder in ("src", "back"))
        assert source.keys() == back.keys() and all(torch.equal(source[k], back[k]) for k in source)
    else:
        back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
        assert logits_error(official, back, "eager") <= TOLERANCE


def _wider_window(official, *, src) -> dict:
    return {**smollm3.fields_from_official(official, src=src), "sliding_window": official.sliding_window + 1}


@pytest.mark.parametrize("case, patch", [
    ("smollm3_windows_and_full_no_nope", "window"),
    ("llama4_dense_no_nope", "rows"),
])
def test_negative_control_a_wrong_table_fails_parity(case, patch, tmp_path, monkeypatch):
    """The window one token wider; Llama 4's q/k rows read without their interleaved -> rotate-half permutation."""
    if patch == "window":
        monkeypatch.setitem(llama_configs.OFFICIAL_TYPES, "smollm3",
                            dataclasses.replace(smollm3.VARIANT, fields_from_official=_wider_window))
    else:
        monkeypatch.setattr(llama4, "rotary_rows", lambda heads: llama4.Transform("identity", lambda t: t, lambda t: t))
    official_model(case).save_pretrained(tmp_path / "src")
    with pytest.raises(ConversionError, match="does not match the official"):
        llama.convert(tmp_path / "src", tmp_path / "ours")
