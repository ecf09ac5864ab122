"""DeepSeek-V3 through the converter: Multi-head Latent Attention + sigmoid-routed MoE against official
DeepseekV3ForCausalLM (logits per backend, greedy and beam tokens, the absorbed path, the latent cache), MTP
modules kept through conversion both ways, and bad inputs."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import hf_tiny  # noqa: F401  (registers the Auto classes)
from causal_helpers import left_padded_batch, max_diff, real_logits
from conversion import ConversionError, llama
from hf_tiny import TinyCausalConfig
from hf_tiny.transformers_api import deepseek_router_float32
from deepseek_models import MLA, VARIANTS, tiny_deepseek

pytestmark = pytest.mark.usefixtures("single_torch_thread")

TOLERANCE = 1e-5


def bound(expected: torch.Tensor) -> float:
    """The converter's fp32 rule (conversion/parity.py): 1e-5 relative to max(1, max |official logit|). MLA's
    3-D vs 4-D kv_b_proj calls and the sigmoid-weighted experts move the last fp32 digits (measured 1.2e-5 at
    max |logit| 7.2)."""
    return TOLERANCE * max(1.0, float(expected.abs().max()))


def convert(official, tmp_path):
    official.save_pretrained(tmp_path / "src")
    result = llama.convert(tmp_path / "src", tmp_path / "ours")
    assert result["architecture"] == "DeepseekV3ForCausalLM"
    return result


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_official_per_backend(variant, tmp_path):
    official = tiny_deepseek(variant)
    result = convert(official, tmp_path)
    assert all(row["max_abs_diff"] <= row["tolerance"] for row in result["parity"])
    batch = left_padded_batch(official.config.vocab_size)
    expected = real_logits(official, batch)
    assert expected.abs().max() > 1.0
    for backend in ("eager", "sdpa"):
        ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation=backend).eval()
        diff = max_diff(real_logits(ours, batch), expected)
        assert diff <= bound(expected), f"{variant} / {backend}: max |Δ| = {diff:.3g}, max |logit| {float(expected.abs().max()):.3g}"
    absorbed = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", mla_absorb=True).eval()
    assert max_diff(real_logits(absorbed, batch), expected) <= bound(expected)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_beam_and_absorbed_tokens_identical(variant, tmp_path):
    official = tiny_deepseek(variant)
    convert(official, tmp_path)
    batch = left_padded_batch(official.config.vocab_size, lengths=(9, 6, 3), seed=1)
    settings = dict(attention_mask=batch["attention_mask"], max_new_tokens=10, do_sample=False, pad_token_id=0,
                    eos_token_id=None)
    for absorb in (False, True):
        ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", mla_absorb=absorb).eval()
        for extra in ({}, {"num_beams": 3}):
            expected = official.generate(batch["input_ids"], **settings, **extra)
            assert torch.equal(ours.generate(batch["input_ids"], **settings, **extra), expected), (absorb, extra)


DISTINCT_MSCALES = {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                    "mscale": 0.7, "mscale_all_dim": 1.3}


def test_distinct_mscale_and_mscale_all_dim_match_official(tmp_path):
    """YaRN with mscale != mscale_all_dim (the variants above set both to 1.0, where exchanging them changes nothing):
    the rotary attention factor is mscale(factor, mscale) / mscale(factor, mscale_all_dim) and MLA scales its scores
    by mscale(factor, mscale_all_dim)^2, as official. Negative control: the same weights with the two values
    exchanged."""
    official = tiny_deepseek("yarn_mscale_dense_norm_off", rope_parameters=dict(DISTINCT_MSCALES))
    convert(official, tmp_path)
    batch = left_padded_batch(official.config.vocab_size)
    expected = real_logits(official, batch)
    for extra in ({"attn_implementation": "eager"}, {"attn_implementation": "sdpa"}, {"mla_absorb": True}):
        ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", **extra).eval()
        assert ours.config.rope_parameters["mscale"] == 0.7 and ours.config.rope_parameters["mscale_all_dim"] == 1.3
        assert max_diff(real_logits(ours, batch), expected) <= bound(expected), extra
    exchanged = {**DISTINCT_MSCALES, "mscale": 1.3, "mscale_all_dim": 0.7}
    wrong = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", rope_parameters=exchanged).eval()
    assert max_diff(real_logits(wrong, batch), expected) > 100 * bound(expected)


def test_the_cache_holds_the_latent_not_keys_and_values(tmp_path):
    official = tiny_deepseek("mla_moe")
    convert(official, tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    ids = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    cache = ours(ids, use_cache=True).past_key_values
    layer = cache.layers[0]
    assert tuple(layer.keys.shape) == (2, 1, 7, 16)  # kv_lora_rank
    assert tuple(layer.values.shape) == (2, 1, 7, 8)  # qk_rope_head_dim
    official_cache = official(ids, use_cache=True).past_key_values
    assert torch.allclose(layer.keys, official_cache.layers[0].keys, atol=1e-5)


def test_a_static_cache_with_chunked_prefill_gives_officials_tokens(tmp_path):
    """generate(cache_implementation="static", prefill_chunk_size=N) fills the static cache before the first forward
    with transformers' (heads, head dimension); MLA's latent cache has none, so hf_tiny leaves it to the first write,
    as official does for MLA models (before: "the cache ... holds keys of shape ... key/value heads 4 (expected 1)")."""
    official = tiny_deepseek("mla_moe")
    convert(official, tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    ids = torch.randint(3, 97, (2, 11), generator=torch.Generator().manual_seed(2))
    settings = dict(max_new_tokens=6, do_sample=False, cache_implementation="static", pad_token_id=0, eos_token_id=None)
    expected = official.generate(ids, prefill_chunk_size=4, **settings)
    assert torch.equal(expected, official.generate(ids, **settings))
    assert torch.equal(ours.generate(ids, prefill_chunk_size=4, **settings), expected)
    assert not torch.equal(ours.generate(ids.flip(-1), prefill_chunk_size=4, **settings)[:, 11:], expected[:, 11:])


def test_negative_controls_interleaving_and_correction_bias(tmp_path):
    official = tiny_deepseek("mla_moe")
    convert(official, tmp_path)
    batch = left_padded_batch(official.config.vocab_size)
    expected = real_logits(official, batch)
    # the same tensors converted as if their rotary rows were already in halves
    wrong_rope = tmp_path / "wrong_rope"
    config = TinyCausalConfig.from_pretrained(tmp_path / "ours")
    state = load_file(tmp_path / "src" / "model.safetensors")
    mapped = llama.key_map(config, rope_interleave=False).to_target(state, num_layers=llama.layer_counts(config))
    model = hf_tiny.TinyCausalForCausalLM(config)
    model.load_state_dict(mapped, strict=True)
    model.save_pretrained(wrong_rope)
    wrong = AutoModelForCausalLM.from_pretrained(wrong_rope).eval()
    assert max_diff(real_logits(wrong, batch), expected) > 100 * TOLERANCE
    unbiased = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        for layer in unbiased.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.zero_()
    assert max_diff(real_logits(unbiased, batch), expected) > 100 * TOLERANCE


def test_convert_back_is_bit_exact_and_loads_cleanly(tmp_path):
    official = tiny_deepseek("mla_moe")
    convert(official, tmp_path)
    result = llama.convert_back(tmp_path / "ours", tmp_path / "back")
    assert result["architecture"] == "DeepseekV3ForCausalLM"
    src, back = load_file(tmp_path / "src" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert src.keys() == back.keys() and all(torch.equal(src[k], back[k]) for k in src)


# ------------------------------------------------------------------------------------------------------------
# Multi-Token Prediction modules: official transformers drops them; we keep them
# ------------------------------------------------------------------------------------------------------------


def add_mtp_layer(folder, source_layer: int, mtp_index: int, seed: int = 0):
    """Writes DeepSeek's MTP tensors into a saved folder, as DeepSeek's checkpoints hold them: decoder layer
    `mtp_index` = a copy of layer `source_layer`'s tensors, plus enorm, hnorm, eh_proj, shared_head.norm (random)
    and copies of the embedding and head. Returns the added tensors."""
    path = folder / "model.safetensors"
    state = load_file(path)
    generator = torch.Generator().manual_seed(seed)
    hidden = state["model.norm.weight"].shape[0]
    added = {
        key.replace(f"model.layers.{source_layer}.", f"model.layers.{mtp_index}."): tensor.clone()
        for key, tensor in state.items() if key.startswith(f"model.layers.{source_layer}.")
    }
    prefix = f"model.layers.{mtp_index}."
    added[prefix + "enorm.weight"] = 1 + 0.3 * torch.randn(hidden, generator=generator)
    added[prefix + "hnorm.weight"] = 1 + 0.3 * torch.randn(hidden, generator=generator)
    added[prefix + "eh_proj.weight"] = 0.3 * torch.randn(hidden, 2 * hidden, generator=generator)
    added[prefix + "shared_head.norm.weight"] = 1 + 0.3 * torch.randn(hidden, generator=generator)
    added[prefix + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    head = state.get("lm_head.weight", state["model.embed_tokens.weight"])  # a tied head is not stored
    added[prefix + "shared_head.head.weight"] = head.clone()
    save_file({**state, **added}, path, metadata={"format": "pt"})
    return added


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_mtp_module_survives_conversion_both_ways_and_drafts(tied, tmp_path):
    """Tied embeddings too: the MTP modules' copies of the embedding and the head are then all one tensor (before,
    the converter stopped on its own rule: 'cannot map several keys to several keys')."""
    official = tiny_deepseek("mla_moe", tie_word_embeddings=tied)
    official.save_pretrained(tmp_path / "src")
    added = add_mtp_layer(tmp_path / "src", source_layer=2, mtp_index=3)
    result = llama.convert(tmp_path / "src", tmp_path / "ours")
    assert all(row["max_abs_diff"] <= row["tolerance"] for row in result["parity"])
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert ours.config.mtp_depth() == 1
    # the MTP block's tensors are layer 2's, converted by the same rules (rotary rows included)
    main, mtp_block = ours.model.layers[2].state_dict(), ours.mtp[0].block.state_dict()
    assert main.keys() == mtp_block.keys() and all(torch.equal(main[k], mtp_block[k]) for k in main)
    assert torch.equal(ours.mtp[0].eh_proj.weight, added["model.layers.3.eh_proj.weight"])
    assert torch.equal(ours.mtp[0].norm.weight, added["model.layers.3.shared_head.norm.weight"])
    card = (tmp_path / "ours" / "README.md").read_text()
    assert "Multi-Token Prediction module" in card and "weight mtp_loss_weight=0.3" in card  # the loss official lacks
    batch = left_padded_batch(97, lengths=(8, 5), seed=2)
    settings = dict(attention_mask=batch["attention_mask"], max_new_tokens=8, pad_token_id=0, eos_token_id=None)
    assert torch.equal(ours.generate(batch["input_ids"], use_mtp=True, **settings),
                       official.generate(batch["input_ids"], do_sample=False, **settings))
    llama.convert_back(tmp_path / "ours", tmp_path / "back")
    src, back = load_file(tmp_path / "src" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert src.keys() == back.keys() and all(torch.equal(src[k], back[k]) for k in src)


def test_checkpoint_without_mtp_tensors_converts_without_modules(tmp_path):
    official = tiny_deepseek("mla_moe", num_nextn_predict_layers=1)
    convert(official, tmp_path)  # official save_pretrained drops MTP tensors but keeps the field
    config = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").config
    assert config.mtp_depth() == 0 and not hasattr(config, "num_nextn_predict_layers")  # no MTP field at all
    assert "converted without MTP modules" in (tmp_path / "ours" / "README.md").read_text()


def test_mtp_depth_the_checkpoint_does_not_hold_and_unequal_copies_are_errors(tmp_path):
    official = tiny_deepseek("mla_moe", num_nextn_predict_layers=2)
    official.save_pretrained(tmp_path / "src")
    add_mtp_layer(tmp_path / "src", source_layer=2, mtp_index=3)
    with pytest.raises(ConversionError, match=r"num_nextn_predict_layers=2 but the checkpoint holds MTP module\(s\) \[0\]"):
        llama.convert(tmp_path / "src", tmp_path / "ours")
    official = tiny_deepseek("mla_moe", num_nextn_predict_layers=1)
    official.save_pretrained(tmp_path / "src2")
    add_mtp_layer(tmp_path / "src2", source_layer=2, mtp_index=3)
    state = load_file(tmp_path / "src2" / "model.safetensors")
    state["model.layers.3.shared_head.head.weight"] = state["model.layers.3.shared_head.head.weight"] + 1
    save_file(state, tmp_path / "src2" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match="model.layers.3.shared_head.head.weight"):
        llama.convert(tmp_path / "src2", tmp_path / "ours2")
    assert not (tmp_path / "ours2").exists()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"kv_lora_rank": 0}, "kv_lora_rank must be a positive integer, got 0"),
        ({"kv_lora_rank": -4}, "kv_lora_rank must be a positive integer, got -4"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim must be even (rotary pairs), got 7"),
        ({"q_lora_rank": 0}, "q_lora_rank must be a positive integer, got 0"),
        ({"num_key_value_heads": 2}, "num_key_value_heads=2 must equal num_attention_heads=4"),
        ({"head_dim": 8}, "head_dim is qk_nope_head_dim + qk_rope_head_dim = 20; got head_dim=8"),
        ({"qk_norm": True}, "'qk_norm': True"),
        ({"sliding_window": 4}, "'sliding_window': 4"),
    ],
)
def test_bad_mla_config_is_a_clear_error(changes, message):
    fields = dict(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                  **MLA)
    with pytest.raises(ValueError) as error:
        TinyCausalConfig(**{**fields, **changes})
    assert message in str(error.value)


def test_flash_backends_refuse_mla_value_width_clearly():
    from hf_tiny.attention import ATTENTION_BACKENDS

    q = k = torch.randn(1, 2, 3, 8)
    v = torch.randn(1, 2, 3, 6)
    with pytest.raises(ValueError, match="needs one head_dim for queries, keys and values"):
        ATTENTION_BACKENDS["flash_attention_2"](q, k, v, None, scale=1.0, is_causal=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_load_keeps_the_router_in_float32_as_official(dtype, tmp_path):
    """Official DeepSeek-V3 lists its router (gate.weight, e_score_correction_bias) as kept in float32 whatever the
    load dtype: ours keeps the same tensors, with the checkpoint's float32 values; before, they were rounded to the
    load dtype. Control: the other weights are in the load dtype on both sides."""
    convert(tiny_deepseek("mla_moe"), tmp_path)
    official = AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=dtype)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=dtype)
    source = load_file(tmp_path / "src" / "model.safetensors")
    kept = {name for name, tensor in official.state_dict().items() if tensor.dtype == torch.float32 and ".gate." in name}
    assert kept and all(name.endswith(("gate.weight", "gate.e_score_correction_bias")) for name in kept)
    state = ours.state_dict()
    for name in kept:
        assert state[name].dtype == torch.float32, name
        if name in source:
            assert torch.equal(state[name], source[name]), name
    assert state["model.layers.0.self_attn.q_a_proj.weight"].dtype == dtype
    assert {t.dtype for n, t in state.items() if n not in kept and t.is_floating_point()} == {dtype}


def test_a_bf16_load_with_a_moe_layer_offloaded_to_disk_equals_the_plain_load_as_official(tmp_path):
    """Disk offload restores a tensor in the dtype its parameter was created in: official's router is created in
    float32 (transformers >= 5.24), ours was created in the load dtype and came back bf16 from the disk (logits 0.047
    off its own plain load). Official's offloaded logits equal its plain ones: ours now too."""
    convert(tiny_deepseek("mla_moe"), tmp_path)
    ids = torch.randint(3, 60, (2, 7), generator=torch.Generator().manual_seed(0))
    router_dtype = torch.float32 if "gate.weight" in deepseek_router_float32() else torch.bfloat16  # 5.16: bf16
    differences = []
    for folder in ("src", "ours"):
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / folder, dtype=torch.bfloat16)
        layers = {f"model.layers.{i}": "disk" if i == 1 else "cpu" for i in range(plain.config.num_hidden_layers)}
        rest = {name: "cpu" for name, _ in plain.named_children() if name != "model"}
        rest.update({f"model.{name}": "cpu" for name, _ in plain.model.named_children() if name != "layers"})
        offloaded = AutoModelForCausalLM.from_pretrained(
            tmp_path / folder, dtype=torch.bfloat16, device_map={**layers, **rest}, offload_folder=tmp_path / folder / "offload"
        )
        assert plain.model.layers[1].mlp.gate.weight.dtype == router_dtype
        with torch.no_grad():
            differences.append(max_diff(plain(ids).logits.float(), offloaded(ids).logits.float()))
    assert differences == [0.0, 0.0]
