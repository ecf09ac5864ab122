"""Phi-3 / Phi-4-mini <-> hf_tiny causal LM: fused qkv_proj and gate_up_proj split bit for bit, partial rotary
(Phi-4-mini), longrope (Phi-3 128k) and Phi-3's sliding window, against the official Phi3ForCausalLM (tiny random
weights), from HF folders and GGUF files, both ways."""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_tiny  # noqa: F401
from causal_helpers import left_padded_batch, max_diff, real_logits
from conversion import ConversionError, detect_family, phi3
from conversion.__main__ import main
from gguf_writer import write_gguf_from_official
from phi3_models import tiny_phi3

pytestmark = pytest.mark.usefixtures("single_torch_thread")

TOLERANCE = 1e-5
LONGROPE = dict(
    original_max_position_embeddings=16,
    rope_parameters={"rope_type": "longrope", "rope_theta": 100.0, "short_factor": [1.0, 1.5, 2.0, 1.2],
                     "long_factor": [3.0, 2.0, 4.0, 8.0]},
)
VARIANTS = {
    "phi3_mini": dict(),
    "phi4_mini_partial_rotary_tied": dict(partial_rotary_factor=0.5, tie_word_embeddings=True),
    "longrope_128k": LONGROPE,
    "sliding_window_mha": dict(sliding_window=5, num_key_value_heads=4),
}
GENERATE = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)


def official_switch_keeps_the_sequence() -> bool:
    """Official Phi-3 drops the cache when generation crosses original_max_position_embeddings (the long factors
    apply to every position); before transformers 5.2x (5.16.1 here) it then still fed only the last token, with
    no cache, and generated from that one token. The fix passes next_sequence_length=None."""
    return "next_sequence_length" in inspect.getsource(transformers.Phi3ForCausalLM.prepare_inputs_for_generation)


def convert(official, tmp_path):
    official.save_pretrained(tmp_path / "src")
    assert detect_family(tmp_path / "src") == ("phi3", "model_type 'phi3'")
    result = phi3.convert(tmp_path / "src", tmp_path / "ours")
    return tmp_path / "ours", result


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_parity_generation_and_bit_exact_reverse(variant, tmp_path):
    official = tiny_phi3(**VARIANTS[variant])
    dst, result = convert(official, tmp_path)
    assert result["architecture"] == "Phi3ForCausalLM"
    # 24-token prompts: longrope runs on its long factors (past original_max_position_embeddings=16)
    batch = left_padded_batch(official.config.vocab_size)
    for backend in ("eager", "sdpa"):
        official.set_attn_implementation(backend)
        ours = AutoModelForCausalLM.from_pretrained(dst, attn_implementation=backend).eval()
        expected = real_logits(official, batch)
        assert expected.abs().max() > 1.0
        diff = max_diff(real_logits(ours, batch), expected)
        assert diff <= TOLERANCE, f"{variant} {backend}: {diff}"
    # short prompts: longrope switches from the short to the long factors while generating, as official does
    short = left_padded_batch(official.config.vocab_size, lengths=(9, 6, 3), seed=1)
    switch = official.config.original_max_position_embeddings + 1  # the first sequence length on long factors
    for extra in ({}, {"num_beams": 3}):
        settings = dict(attention_mask=short["attention_mask"], **GENERATE, **extra)
        ours_tokens, official_tokens = (model.generate(short["input_ids"], **settings) for model in (ours, official))
        if official_switch_keeps_the_sequence():
            assert torch.equal(ours_tokens, official_tokens)
        elif not extra:  # older official Phi-3 breaks at the switch (see below): equal up to it
            assert torch.equal(ours_tokens[:, :switch], official_tokens[:, :switch])

    assert main(["phi3", str(dst), str(tmp_path / "back"), "--reverse"]) == 0
    back, info = transformers.Phi3ForCausalLM.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    source, returned = load_file(tmp_path / "src" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert source.keys() == returned.keys() and all(torch.equal(source[k], returned[k]) for k in source)
    assert back.config.rope_parameters == official.config.rope_parameters


def test_a_model_pickled_before_it_kept_the_longrope_switch_generates_as_official(tmp_path):
    """torch.save of a whole model (or copy.deepcopy) pickles its instance attributes: one pickled before hf_tiny
    kept the longrope switch on the instance has none, and gets it from its config when unpickled; it then switches
    to the long factors where official does. Without the switch it generated nothing (AttributeError)."""
    import copy
    import pickle

    official = tiny_phi3(**LONGROPE)
    dst, _ = convert(official, tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(dst).eval()
    older = ours.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    del older[2]["_longrope_switch"]  # the instance state as pickled before the switch was kept
    restored = older[0](*older[1])
    restored.__setstate__(older[2])
    assert restored._longrope_switch == official.config.original_max_position_embeddings == 16
    assert copy.deepcopy(restored)._longrope_switch == 16  # through __reduce_ex__ and __setstate__, as pickling
    short = left_padded_batch(official.config.vocab_size, lengths=(9, 6, 3), seed=1)
    settings = dict(attention_mask=short["attention_mask"], **GENERATE)
    ours_tokens, official_tokens = (model.generate(short["input_ids"], **settings) for model in (restored, official))
    switch = official.config.original_max_position_embeddings + 1
    if official_switch_keeps_the_sequence():
        assert torch.equal(ours_tokens, official_tokens)
    else:
        assert torch.equal(ours_tokens[:, :switch], official_tokens[:, :switch])


@pytest.mark.parametrize(
    "variant, perturbation",
    [
        ("phi4_mini_partial_rotary_tied", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
        ("longrope_128k", {"rope_parameters": {**LONGROPE["rope_parameters"], "long_factor": [1.0, 1.5, 2.0, 1.2],
                                               "original_max_position_embeddings": 16}}),
    ],
)
def test_negative_control_partial_rotary_and_long_factors_matter(variant, perturbation, tmp_path):
    official = tiny_phi3(**VARIANTS[variant])
    dst, _ = convert(official, tmp_path)
    wrong = AutoModelForCausalLM.from_pretrained(dst, **perturbation).eval()
    batch = left_padded_batch(official.config.vocab_size)
    assert max_diff(real_logits(wrong, batch), real_logits(official, batch)) > 100 * TOLERANCE


def test_reverse_without_a_family_picks_phi3_only_where_phi3_is_needed(tmp_path):
    plain, _ = convert(tiny_phi3(), tmp_path / "plain")
    assert detect_family(plain, reverse=True)[0] == "llama"  # a plain Phi-3 block is exactly a Llama block
    longrope, _ = convert(tiny_phi3(**LONGROPE), tmp_path / "longrope")
    assert detect_family(longrope, reverse=True)[0] == "phi3"
    with pytest.raises(ConversionError, match="convert it with the phi3 or gpt2 family"):
        from conversion import llama

        llama.convert_back(longrope, tmp_path / "as_llama")


def test_sequence_classifier(tmp_path):
    official = tiny_phi3(transformers.Phi3ForSequenceClassification, num_labels=3)
    dst, result = convert(official, tmp_path)
    assert result["hf_tiny_class"] == "TinyCausalForSequenceClassification"
    ours = hf_tiny.TinyCausalForSequenceClassification.from_pretrained(dst).eval()
    batch = left_padded_batch(official.config.vocab_size)
    with torch.no_grad():
        assert max_diff(ours(**batch).logits, official(**batch).logits) <= TOLERANCE


def test_gguf_phi3_converts_with_parity_against_official_gguf_loading(tmp_path, capsys):
    official = tiny_phi3()
    path = write_gguf_from_official(official, tmp_path / "phi3.gguf", "phi3", quantization="Q8_0")
    assert detect_family(path) == ("phi3", "GGUF architecture 'phi3'")
    assert main([str(path), str(tmp_path / "ours")]) == 0
    capsys.readouterr()
    from_gguf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="phi3.gguf", dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    batch = left_padded_batch(official.config.vocab_size)
    assert max_diff(real_logits(ours, batch), real_logits(from_gguf, batch)) <= TOLERANCE


# ------------------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------------------


def test_longrope_without_its_factors_names_the_field(tmp_path):
    import json

    tiny_phi3(**LONGROPE).save_pretrained(tmp_path / "src")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    del config["rope_parameters"]["long_factor"]
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    with pytest.raises((ConversionError, ValueError), match="long_factor"):
        phi3.convert(tmp_path / "src", tmp_path / "ours")
    assert not (tmp_path / "ours").exists()
    with pytest.raises(ValueError, match=r"rope_parameters\['long_factor'\] has 3 entries; 8 rotary dimensions need 4"):
        hf_tiny.TinyCausalConfig(
            vocab_size=97, hidden_size=32, num_attention_heads=4, intermediate_size=48, num_hidden_layers=1,
            rope_parameters={**LONGROPE["rope_parameters"], "long_factor": [1.0, 2.0, 3.0]},
        )


def test_fused_projection_of_the_wrong_height_names_the_tensor_and_sizes(tmp_path):
    from safetensors.torch import save_file

    tiny_phi3().save_pretrained(tmp_path / "src")
    state = load_file(tmp_path / "src" / "model.safetensors")
    state["model.layers.0.self_attn.qkv_proj.weight"] = state["model.layers.0.self_attn.qkv_proj.weight"][:60].contiguous()
    save_file(state, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"qkv_proj.weight has shape \(60, 32\): its 60 rows must be 32 \+ 16 \+ 16 = 64"):
        phi3.convert(tmp_path / "src", tmp_path / "ours")


def test_reverse_refuses_a_config_phi3_cannot_hold():
    config = hf_tiny.TinyCausalConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, attention_bias=True)
    with pytest.raises(ConversionError, match="Phi-3 cannot hold this hf_tiny config.*attention_bias"):
        phi3.phi3_config_from_causal(config, "Phi3ForCausalLM")
