"""`python -m conversion llama`: parity through the production converter against official Llama / Mistral /
Qwen2 models, Meta's consolidated layout, the reverse direction, and bad inputs."""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import hf_tiny  # noqa: F401  (registers the Auto classes)
from causal_helpers import left_padded_batch, max_diff, real_logits, tiny_official
from conversion import llama, meta_llama
from conversion.keymap import Transform
from conversion.__main__ import main as cli
from conversion import ConversionError
from llama_models import VARIANTS

pytestmark = pytest.mark.usefixtures("single_torch_thread")

TOLERANCE = 1e-5


def convert_official(official, tmp_path, name="src"):
    src, dst = tmp_path / name, tmp_path / f"{name}_converted"
    official.save_pretrained(src)
    result = llama.convert(src, dst)
    return dst, result


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_parity_through_converter_per_backend(variant, tmp_path):
    family, overrides = VARIANTS[variant]
    official = tiny_official(family, **overrides)
    dst, result = convert_official(official, tmp_path)
    assert all(row["max_abs_diff"] <= row["tolerance"] for row in result["parity"])
    batch = left_padded_batch(official.config.vocab_size)
    for backend in ("eager", "sdpa"):
        official.set_attn_implementation(backend)
        ours = AutoModelForCausalLM.from_pretrained(dst, attn_implementation=backend).eval()
        assert type(ours).__name__ == "TinyCausalForCausalLM"
        expected = real_logits(official, batch)
        assert expected.abs().max() > 1.0  # large enough that a wrong rotation could not hide under 1e-5
        diff = max_diff(real_logits(ours, batch), expected)
        assert diff <= TOLERANCE, f"{variant} / {backend}: max |Δ| = {diff:.3g}"


@pytest.mark.parametrize(
    "variant, perturbation",
    [
        ("gqa", {"rope_parameters": {"rope_type": "default", "rope_theta": 20000.0}}),
        ("rope_linear", {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}),
        ("rope_llama3", {"rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 8.0}}),
        ("rope_yarn", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "original_max_position_embeddings": 16, "attention_factor": 1.0}}),
    ],
)
def test_negative_control_the_same_comparison_rejects_another_rope(variant, perturbation, tmp_path):
    family, overrides = VARIANTS[variant]
    official = tiny_official(family, **overrides)
    dst, _ = convert_official(official, tmp_path)
    batch = left_padded_batch(official.config.vocab_size)
    wrong = AutoModelForCausalLM.from_pretrained(dst, **perturbation).eval()
    assert max_diff(real_logits(wrong, batch), real_logits(official, batch)) > 100 * TOLERANCE


GENERATE_SETTINGS = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)


@pytest.mark.parametrize("variant", ["gemma3", "gemma3_softcap_tied_mha", "qwen2_max_window_layers", "qwen3_max_window_layers"])
def test_per_layer_windows_greedy_beam_and_static_cache_tokens_identical(variant, tmp_path):
    """Prompts up to 24 tokens with windows of 3-5 keys: every sliding layer drops keys, in the prompt and while
    decoding (transformers' sliding cache layers keep only the last window), in dynamic and static caches."""
    family, overrides = VARIANTS[variant]
    official = tiny_official(family, **overrides)
    dst, result = convert_official(official, tmp_path)
    assert result["architecture"] == type(official).__name__
    ours = AutoModelForCausalLM.from_pretrained(dst).eval()
    assert ours.config.layer_types == list(official.config.layer_types)
    assert len(set(ours.config.layer_types)) == 2
    batch = left_padded_batch(official.config.vocab_size)
    for extra in ({}, {"num_beams": 3}, {"cache_implementation": "static"}):
        expected = official.generate(batch["input_ids"], attention_mask=batch["attention_mask"], **GENERATE_SETTINGS, **extra)
        produced = ours.generate(batch["input_ids"], attention_mask=batch["attention_mask"], **GENERATE_SETTINGS, **extra)
        assert torch.equal(produced, expected), extra


@pytest.mark.parametrize(
    "variant, perturbation",
    [
        ("gemma3", {"layer_types": ["full_attention"] * 4}),
        ("gemma3", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0}}),
        ("gemma3", {"sandwich_norms": False}),
        ("gemma3", {"rms_norm_unit_offset": False}),
        ("gemma3", {"query_pre_attn_scalar": None}),
        ("gemma3_softcap_tied_mha", {"final_logit_softcapping": None}),
        ("qwen2_max_window_layers", {"layer_types": ["full_attention", "full_attention"]}),
    ],
)
def test_negative_control_each_gemma_and_window_switch_matters(variant, perturbation, tmp_path):
    family, overrides = VARIANTS[variant]
    official = tiny_official(family, **overrides)
    dst, _ = convert_official(official, tmp_path)
    batch = left_padded_batch(official.config.vocab_size)
    wrong = AutoModelForCausalLM.from_pretrained(dst, **perturbation).eval()
    assert max_diff(real_logits(wrong, batch), real_logits(official, batch)) > 100 * TOLERANCE


GEMMA3_BF16 = dict(
    hidden_size=640, head_dim=16, num_hidden_layers=2, intermediate_size=96, sliding_window=4, query_pre_attn_scalar=12,
    layer_types=["sliding_attention", "full_attention"],
)


def _gemma3_bf16_pair(tmp_path):
    """Official Gemma 3 and ours, both loaded from their folders in bfloat16 (as the real 270M runs), hidden 640 like
    the real 270M: sqrt(640) = 25.298 is not a bfloat16 number (bfloat16 holds 25.25), so the embedding scale's
    rounding shows."""
    dst, _ = convert_official(tiny_official("gemma3_text", **GEMMA3_BF16), tmp_path)
    official = transformers.Gemma3ForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.bfloat16,
                                                              attn_implementation="sdpa").eval()
    ours = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    assert ours.dtype == official.dtype == torch.bfloat16
    assert float(torch.tensor(640**0.5, dtype=torch.bfloat16)) != 640**0.5
    return official, ours


def test_gemma3_bfloat16_logits_are_bit_identical_to_official(tmp_path):
    """bf16 on CPU with the sdpa backend: the same operations in the same dtypes give the same bits: (1 + w) norms
    multiplied in fp32 and then rounded, the embedding scale rounded to bf16 before the product, as official. (Our
    eager backend computes the scores in fp32 where official's eager multiplies in bf16, so it is not compared bit for
    bit.) The negative controls are the two one-line changes this comparison exists to catch."""
    official, ours = _gemma3_bf16_pair(tmp_path)
    batch = left_padded_batch(official.config.vocab_size)
    expected = real_logits(official, batch)
    assert expected.dtype == torch.bfloat16 and expected.abs().max() > 1.0
    assert torch.equal(real_logits(ours, batch), expected)


def test_gemma3_bfloat16_negative_controls_norm_product_and_embedding_scale_in_another_dtype(tmp_path, monkeypatch):
    from hf_tiny.layers import RMSNorm, ScaledEmbedding

    official, ours = _gemma3_bf16_pair(tmp_path)
    batch = left_padded_batch(official.config.vocab_size)
    expected = real_logits(official, batch)

    def product_in_input_dtype(self, hidden_states):
        normalized = hidden_states.float() * torch.rsqrt(hidden_states.float().pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return normalized.to(hidden_states.dtype) * (1.0 + self.weight)

    def scale_rounded_in_fp32(self, input_ids):
        return torch.nn.Embedding.forward(self, input_ids) * torch.tensor(self.embed_scale, dtype=torch.float32)

    for cls, name, wrong in ((RMSNorm, "forward", product_in_input_dtype), (ScaledEmbedding, "forward", scale_rounded_in_fp32)):
        with monkeypatch.context() as patch:
            patch.setattr(cls, name, wrong)
            assert not torch.equal(real_logits(ours, batch), expected), name


@pytest.mark.parametrize("variant", ["qwen3_qk_norm", "qwen3_biases_mha"])
def test_qwen3_greedy_and_beam_tokens_identical_and_qk_norm_negative_control(variant, tmp_path):
    family, overrides = VARIANTS[variant]
    official = tiny_official(family, **overrides)
    dst, result = convert_official(official, tmp_path)
    assert result["architecture"] == "Qwen3ForCausalLM"
    ours = AutoModelForCausalLM.from_pretrained(dst).eval()
    assert ours.config.qk_norm and ours.model.layers[0].self_attn.q_norm is not None
    batch = left_padded_batch(official.config.vocab_size, lengths=(9, 6, 3), seed=1)
    settings = dict(attention_mask=batch["attention_mask"], max_new_tokens=10, do_sample=False, pad_token_id=0,
                    eos_token_id=None)
    for extra in ({}, {"num_beams": 3}):
        expected = official.generate(batch["input_ids"], **settings, **extra)
        assert torch.equal(ours.generate(batch["input_ids"], **settings, **extra), expected), extra
    # negative control: the same weights without the q/k norms (the norm weights are then unexpected and dropped)
    wrong = AutoModelForCausalLM.from_pretrained(dst, qk_norm=False).eval()
    full = left_padded_batch(official.config.vocab_size)
    assert max_diff(real_logits(wrong, full), real_logits(official, full)) > 100 * TOLERANCE


def test_sharded_safetensors_and_bin_sources(tmp_path):
    official = tiny_official("llama")
    batch = left_padded_batch(official.config.vocab_size)
    expected = real_logits(official, batch)

    sharded = tmp_path / "sharded"
    official.save_pretrained(sharded, max_shard_size="30KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    llama.convert(sharded, tmp_path / "from_sharded")

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    official.config.save_pretrained(pickled)
    torch.save(official.state_dict(), pickled / "pytorch_model.bin")
    llama.convert(pickled, tmp_path / "from_bin")

    for name in ("from_sharded", "from_bin"):
        ours = AutoModelForCausalLM.from_pretrained(tmp_path / name).eval()
        assert max_diff(real_logits(ours, batch), expected) <= TOLERANCE


def test_classifier_and_base_model_sources(tmp_path):
    from transformers import AutoModel, AutoModelForSequenceClassification, LlamaConfig, LlamaForSequenceClassification, LlamaModel

    from causal_helpers import BASE, randomize

    config = LlamaConfig(**BASE, num_labels=3)
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 0, 0]])
    mask = (ids != 0).long()
    for official, auto, ours_class in (
        (randomize(LlamaForSequenceClassification(config)).eval(), AutoModelForSequenceClassification, "TinyCausalForSequenceClassification"),
        (randomize(LlamaModel(config)).eval(), AutoModel, "TinyCausalModel"),
    ):
        name = type(official).__name__
        official.save_pretrained(tmp_path / name)
        result = llama.convert(tmp_path / name, tmp_path / f"{name}_ours")
        assert result["hf_tiny_class"] == ours_class
        ours = auto.from_pretrained(tmp_path / f"{name}_ours").eval()
        assert type(ours).__name__ == ours_class
        with torch.no_grad():
            expected, produced = official(ids, attention_mask=mask), ours(ids, attention_mask=mask)
        if ours_class == "TinyCausalModel":
            real = mask.bool()
            assert max_diff(produced.last_hidden_state[real], expected.last_hidden_state[real]) <= TOLERANCE
        else:
            assert max_diff(produced.logits, expected.logits) <= TOLERANCE
        llama.convert_back(tmp_path / f"{name}_ours", tmp_path / f"{name}_back")
        _, info = type(official).from_pretrained(tmp_path / f"{name}_back", output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"]


def test_converted_folder_carries_card_auto_map_and_generation_config(tmp_path):
    official = tiny_official("llama", tie_word_embeddings=True)
    dst, result = convert_official(official, tmp_path)
    config = json.loads((dst / "config.json").read_text())
    assert config["model_type"] == "hf_tiny_causal"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_causal.TinyCausalForCausalLM"
    assert (dst / "modeling_causal.py").is_file() and (dst / "generation_config.json").is_file()
    card = (dst / "README.md").read_text()
    for row in result["parity"]:
        assert f"| {row['backend']} | float32 | cpu |" in card
    assert "left-padded" in card


LONGROPE = {"rope_type": "longrope", "rope_theta": 100.0, "short_factor": [1.0, 1.5, 2.0, 3.0],
            "long_factor": [2.0, 3.0, 5.0, 8.0], "original_max_position_embeddings": 8}


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_longrope_generation_past_the_switch_keeps_the_cache_as_official_llama_and_qwen2(kind, tmp_path):
    """Official Llama / Qwen2 with a longrope config keep the keys cached with the short factors when generation
    passes original_max_position_embeddings (only Phi-3 drops its cache there). Negative control: the converted
    folder with Phi-3's drop (longrope_cache_kept=False) decodes otherwise."""
    official = tiny_official(kind, max_position_embeddings=16, rope_parameters=dict(LONGROPE), head_dim=8)
    dst, _ = convert_official(official, tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(dst).eval()
    assert ours.config.longrope_cache.longrope_cache_kept
    ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(5))
    settings = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, output_logits=True,
                    return_dict_in_generate=True, pad_token_id=0)
    expected, got = official.generate(ids, **settings), ours.generate(ids, **settings)
    assert torch.equal(got.sequences, expected.sequences)
    assert max(max_diff(a, b) for a, b in zip(got.logits, expected.logits)) <= 1e-4
    dropping = AutoModelForCausalLM.from_pretrained(dst, longrope_cache_kept=False).eval()
    other = dropping.generate(ids, **settings)
    assert max(max_diff(a, b) for a, b in zip(other.logits, expected.logits)) > 1e-2


def test_longrope_cache_kept_is_taken_with_the_legacy_rope_scaling_spelling_and_refused_without_longrope():
    legacy = {"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    fields = dict(vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=32,
                  max_position_embeddings=64, original_max_position_embeddings=16, longrope_cache_kept=True)
    config = hf_tiny.TinyCausalConfig(**fields, rope_scaling=legacy)
    assert config.longrope_cache.longrope_cache_kept and config.rope_parameters["rope_type"] == "longrope"
    with pytest.raises(ValueError, match="longrope_cache_kept=True needs a longrope rope_parameters"):
        hf_tiny.TinyCausalConfig(**fields)


def test_a_partial_rotary_factor_the_default_rope_ignores_is_not_carried(tmp_path):
    """Official Llama-family classes rotate whole heads with the default rope whatever partial_rotary_factor says
    (Phi-3 alone reads it); carried, hf_tiny rotated half of each head and the conversion failed its parity."""
    official = tiny_official("llama", rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 0.5})
    dst, result = convert_official(official, tmp_path)
    assert all(row["max_abs_diff"] <= row["tolerance"] for row in result["parity"])
    assert "partial_rotary_factor" not in json.loads((dst / "config.json").read_text())["rope_parameters"]


def test_a_folder_without_generation_config_keeps_the_generation_fields_of_its_config_json(tmp_path):
    """What official from_pretrained generates with then (checkpoints saved before transformers 4.26)."""
    official = tiny_official("llama")
    official.save_pretrained(tmp_path / "src")
    (tmp_path / "src" / "generation_config.json").unlink()
    legacy = {"num_beams": 2, "no_repeat_ngram_size": 2, "max_length": 14, "min_length": 9}
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "src" / "config.json").write_text(json.dumps({**config, **legacy}))
    llama.convert(tmp_path / "src", tmp_path / "ours")
    generation = json.loads((tmp_path / "ours" / "generation_config.json").read_text())
    assert {field: generation.get(field) for field in legacy} == legacy


# ------------------------------------------------------------------------------------------------------------
# Meta's consolidated layout
# ------------------------------------------------------------------------------------------------------------


def write_meta_checkpoint(official, folder, shards: int = 1):
    """Writes what Meta ships (consolidated.NN.pth + params.json) from an official model: the inverse of the RoPE
    permutation, written here independently of the converter, and model-parallel splits."""
    config = official.config
    sd = official.state_dict()
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.hidden_size

    def interleave(weight, n_heads):  # Llama halves -> Meta interleaved pairs
        rows = weight.shape[0]
        return weight.view(n_heads, 2, rows // n_heads // 2, dim).transpose(1, 2).reshape(rows, dim)

    meta = {
        "tok_embeddings.weight": sd["model.embed_tokens.weight"],
        "norm.weight": sd["model.norm.weight"],
        "output.weight": sd["lm_head.weight"],
        "rope.freqs": torch.ones(4),  # Llama 1 checkpoints carry this buffer
    }
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        meta.update(
            {
                f"layers.{i}.attention.wq.weight": interleave(sd[p + "self_attn.q_proj.weight"], heads),
                f"layers.{i}.attention.wk.weight": interleave(sd[p + "self_attn.k_proj.weight"], kv_heads),
                f"layers.{i}.attention.wv.weight": sd[p + "self_attn.v_proj.weight"],
                f"layers.{i}.attention.wo.weight": sd[p + "self_attn.o_proj.weight"],
                f"layers.{i}.feed_forward.w1.weight": sd[p + "mlp.gate_proj.weight"],
                f"layers.{i}.feed_forward.w2.weight": sd[p + "mlp.down_proj.weight"],
                f"layers.{i}.feed_forward.w3.weight": sd[p + "mlp.up_proj.weight"],
                f"layers.{i}.attention_norm.weight": sd[p + "input_layernorm.weight"],
                f"layers.{i}.ffn_norm.weight": sd[p + "post_attention_layernorm.weight"],
            }
        )
    folder.mkdir()
    for shard in range(shards):
        part = {}
        for key, tensor in meta.items():
            suffix = re.sub(r"^layers\.\d+\.", "", key)
            split = meta_llama.META_SHARD_DIMS.get(suffix, None)
            if key == "tok_embeddings.weight":
                split = 1  # Llama 2 splits the embedding width
            part[key] = tensor.chunk(shards, dim=split)[shard].clone() if split is not None else tensor.clone()
        torch.save(part, folder / f"consolidated.{shard:02d}.pth")
    params = {
        "dim": dim,
        "n_layers": config.num_hidden_layers,
        "n_heads": heads,
        "n_kv_heads": kv_heads,
        "vocab_size": -1,
        "multiple_of": 16,
        "norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_parameters["rope_theta"],
        "max_seq_len": config.max_position_embeddings,
    }
    (folder / "params.json").write_text(json.dumps(params))


@pytest.mark.parametrize("shards", [1, 2])
def test_meta_layout_round_trip(shards, tmp_path):
    official = tiny_official("llama", num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    write_meta_checkpoint(official, tmp_path / "meta", shards=shards)
    result = llama.convert(tmp_path / "meta", tmp_path / "ours")
    assert result["source_kind"] == "meta"
    batch = left_padded_batch(official.config.vocab_size)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert max_diff(real_logits(ours, batch), real_logits(official, batch)) <= TOLERANCE

    # back to the official layout: loads with no missing / unexpected keys, bit-identical to the start
    llama.convert_back(tmp_path / "ours", tmp_path / "back")
    back, info = LlamaForCausalLM.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    original = official.state_dict()
    assert all(torch.equal(back.state_dict()[key], original[key]) for key in original)


def test_meta_shards_are_merged_lazily_and_both_sides_stream(tmp_path, monkeypatch):
    """Opening Meta's two model-parallel shards reads no tensor (merged shapes come from the headers); a split
    tensor is joined when asked; the official reference streams the merged tensors (the whole-model loader, which
    would hold the checkpoint in float32, is not called)."""
    official = tiny_official("llama", num_key_value_heads=2)
    write_meta_checkpoint(official, tmp_path / "meta", shards=2)
    monkeypatch.setattr(torch, "cat", _refuse("torch.cat while opening"))
    source = meta_llama.read_meta_source(tmp_path / "meta")
    monkeypatch.undo()
    hidden = official.config.hidden_size
    assert source.state.info("layers.0.feed_forward.w2.weight").shape == (hidden, official.config.intermediate_size)
    shards = [torch.load(tmp_path / "meta" / f"consolidated.0{n}.pth", weights_only=True) for n in range(2)]
    key = "layers.1.feed_forward.w2.weight"  # split along dimension 1
    assert torch.equal(source.state[key], torch.cat([shard[key] for shard in shards], dim=1))
    monkeypatch.setattr(llama, "meta_official_model", _refuse("the whole official model"))
    result = llama.convert(tmp_path / "meta", tmp_path / "ours")
    assert all(row["max_abs_diff"] <= row["tolerance"] for row in result["parity"])


def _refuse(what: str):
    def refused(*args, **kwargs):
        raise AssertionError(f"{what} was called")

    return refused


@pytest.mark.parametrize(
    "key, spoil, fragments",
    [
        ("tok_embeddings.weight", lambda t: t.flatten(), ["'tok_embeddings.weight'", "consolidated.00.pth", "1-D"]),
        ("layers.1.attention.wq.weight", lambda t: t[:, :-1],
         ["'layers.1.attention.wq.weight'", "do not concatenate along dimension 0", "shard 00: (16, 31)",
          "shard 01: (16, 32)"]),
    ],
    ids=["1-D-embedding", "shards-that-do-not-concatenate"],
)
def test_malformed_meta_shards_name_the_tensor_and_the_shapes(key, spoil, fragments, tmp_path):
    official = tiny_official("llama", num_key_value_heads=2)
    write_meta_checkpoint(official, tmp_path / "meta", shards=2)
    shard = torch.load(tmp_path / "meta" / "consolidated.00.pth", weights_only=True)
    shard[key] = spoil(shard[key]).contiguous()
    torch.save(shard, tmp_path / "meta" / "consolidated.00.pth")
    with pytest.raises(ConversionError) as error:
        llama.convert(tmp_path / "meta", tmp_path / "ours")
    for fragment in fragments:
        assert fragment in str(error.value), str(error.value)
    assert not (tmp_path / "ours").exists()


def test_meta_layout_without_permutation_is_rejected_by_parity(tmp_path, monkeypatch):
    """Negative control: the same comparison fails when the RoPE permutation is skipped."""
    official = tiny_official("llama", num_key_value_heads=2)
    write_meta_checkpoint(official, tmp_path / "meta")
    identity = Transform("identity", lambda w: w, lambda w: w)
    monkeypatch.setattr(meta_llama, "rope_permutation", lambda num_heads: identity)
    llama.convert(tmp_path / "meta", tmp_path / "ours")  # its own check compares against the same wrong weights
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    batch = left_padded_batch(official.config.vocab_size)
    assert max_diff(real_logits(ours, batch), real_logits(official, batch)) > 100 * TOLERANCE


# ------------------------------------------------------------------------------------------------------------
# Reverse direction
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "variant",
    [
        "tied", "biases", "mistral_sliding_window", "qwen2_qkv_bias", "rope_llama3", "qwen3_qk_norm", "qwen3_biases_mha",
        "qwen2_max_window_layers", "qwen3_max_window_layers", "gemma3", "gemma3_softcap_tied_mha",
    ],
)
def test_convert_back_is_bit_exact_and_loads_cleanly(variant, tmp_path):
    family, overrides = VARIANTS[variant]
    official = tiny_official(family, **overrides)
    dst, _ = convert_official(official, tmp_path)
    result = llama.convert_back(dst, tmp_path / "back")
    assert result["architecture"] == type(official).__name__
    back, info = type(official).from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    src_tensors = load_file(tmp_path / "src" / "model.safetensors")
    back_tensors = load_file(tmp_path / "back" / "model.safetensors")
    assert src_tensors.keys() == back_tensors.keys()
    assert all(torch.equal(src_tensors[k], back_tensors[k]) for k in src_tensors)
    assert back.config.rope_parameters == official.config.rope_parameters


def test_cli_forward_and_reverse(tmp_path, capsys):
    official = tiny_official("llama")
    official.save_pretrained(tmp_path / "src")
    assert cli(["llama", str(tmp_path / "src"), str(tmp_path / "ours")]) == 0
    assert cli(["llama", str(tmp_path / "ours"), str(tmp_path / "back"), "--reverse"]) == 0
    assert cli(["llama", str(tmp_path / "src"), str(tmp_path / "ours")]) == 1  # exists, no --force
    assert "already exists" in capsys.readouterr().err
    assert cli(["llama", str(tmp_path / "src"), str(tmp_path / "ours_bf16"), "--dtype", "bfloat16"]) == 0
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path / "ours_bf16")
    assert bf16.dtype == torch.bfloat16
    card = (tmp_path / "ours_bf16" / "README.md").read_text()
    assert "| eager | bfloat16 | cpu |" in card
    assert cli(["llama", str(tmp_path / "missing"), str(tmp_path / "x")]) == 1
    assert "does not exist" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------------
# Bad inputs: clear errors, destination untouched
# ------------------------------------------------------------------------------------------------------------


@pytest.fixture
def existing_dst(tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("previous contents")
    return dst


def assert_untouched(dst):
    assert sorted(p.name for p in dst.parent.iterdir() if p.name.startswith(".dst")) == []
    assert [p.name for p in dst.iterdir()] == ["keep.txt"] and (dst / "keep.txt").read_text() == "previous contents"


def edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10.0}}, "'short_factor'"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 10.0, "factor": 8.0}}, "low_freq_factor"),
        ({"model_type": "gpt2"}, "model_type='gpt2'"),
        ({"architectures": ["LlamaForTokenClassification"]}, "'LlamaForTokenClassification' is not supported"),
    ],
)
def test_bad_config_is_a_clear_error(changes, message, tmp_path, existing_dst):
    tiny_official("llama").save_pretrained(tmp_path / "src")
    edit_config(tmp_path / "src", **changes)
    with pytest.raises((ConversionError, ValueError, KeyError)) as error:
        llama.convert(tmp_path / "src", existing_dst, force=True)
    assert message in str(error.value)
    assert_untouched(existing_dst)


def test_gemma3_layer_type_we_do_not_know_names_the_entry(tmp_path, existing_dst):
    family, overrides = VARIANTS["gemma3"]
    tiny_official(family, **overrides).save_pretrained(tmp_path / "src")
    edit_config(tmp_path / "src", layer_types=["sliding_attention", "full_attention", "linear_attention", "full_attention"])
    with pytest.raises(ConversionError, match=r"layer_types\[2\]='linear_attention' is not a layer type hf_tiny knows"):
        llama.convert(tmp_path / "src", existing_dst, force=True)
    assert_untouched(existing_dst)


def test_unknown_or_missing_tensor_names_it(tmp_path, existing_dst):
    official = tiny_official("llama")
    official.config.save_pretrained(tmp_path / "src")
    state = dict(official.state_dict())
    state["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    del state["model.layers.1.mlp.up_proj.weight"]
    torch.save(state, tmp_path / "src" / "pytorch_model.bin")
    with pytest.raises(ConversionError) as error:
        llama.convert(tmp_path / "src", existing_dst, force=True)
    assert "model.layers.0.self_attn.extra.weight" in str(error.value)
    assert "model.layers.1.mlp.up_proj.weight" in str(error.value)
    assert_untouched(existing_dst)


def write_gguf(path, architecture, tensor, raw_dtype=None):
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", tensor, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_of_another_architecture_is_rejected(tmp_path, existing_dst):
    import numpy as np

    path = write_gguf(tmp_path / "gpt2.gguf", "gpt2", np.zeros((4, 8), dtype=np.float32))
    with pytest.raises(ConversionError, match="architecture 'gpt2', expected 'llama'"):
        llama.convert(path, existing_dst, force=True)
    assert_untouched(existing_dst)


def test_gguf_with_unsupported_quantization_is_rejected(tmp_path, existing_dst):
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_1]  # gguf-py cannot dequantize Q8_1
    raw = np.zeros((4, 64 // block * size), dtype=np.uint8)
    path = write_gguf(tmp_path / "q8_1.gguf", "llama", raw, raw_dtype=GGMLQuantizationType.Q8_1)
    with pytest.raises(ConversionError, match=r"unsupported quantization type: token_embd.weight \(Q8_1\)"):
        llama.convert(path, existing_dst, force=True)
    assert_untouched(existing_dst)


def test_source_detection(tmp_path):
    import numpy as np

    folder = tmp_path / "one"
    folder.mkdir()
    gguf = write_gguf(folder / "model.gguf", "llama", np.zeros((4, 8), dtype=np.float32))
    assert llama.detect_source(folder) == ("gguf", gguf)
    assert llama.detect_source(gguf) == ("gguf", gguf)
    write_gguf(folder / "other.gguf", "llama", np.zeros((4, 8), dtype=np.float32))
    with pytest.raises(ConversionError, match="holds 2 GGUF files"):
        llama.detect_source(folder)
    (folder / "notes.txt").write_text("x")
    with pytest.raises(ConversionError, match="not a .gguf"):
        llama.detect_source(folder / "notes.txt")


def test_source_that_is_no_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConversionError, match="not a Llama checkpoint"):
        llama.convert(tmp_path / "empty", tmp_path / "dst")
    with pytest.raises(ConversionError, match="does not exist"):
        llama.convert(tmp_path / "missing", tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_tied_checkpoint_with_a_different_head_is_rejected(tmp_path):
    official = tiny_official("llama", tie_word_embeddings=False)
    official.save_pretrained(tmp_path / "src")
    edit_config(tmp_path / "src", tie_word_embeddings=True)
    with pytest.raises(ConversionError, match="lm_head.weight differs from model.embed_tokens.weight"):
        llama.convert(tmp_path / "src", tmp_path / "dst")


def test_parity_rows_in_half_precision_do_not_leak_into_float32_rows(tmp_path, monkeypatch):
    """On a GPU machine a bf16 checkpoint is measured in bf16 on CPU, then fp32 on CUDA. Casting the model to bf16
    rounds RoPE's inv_freq buffer too, and casting back does not undo it: run in that order, the fp32 row was
    0.0055 off on an H100 (llama1b benchmark). Full-precision rows now run first; here the same plan order on CPU."""
    from conversion import parity

    official = tiny_official("llama").to(torch.bfloat16)
    src = tmp_path / "src"
    official.save_pretrained(src)
    plans = [("cpu", torch.bfloat16, "eager"), ("cpu", torch.float32, "eager")]
    monkeypatch.setattr(parity, "parity_plans", lambda dtype: plans)
    result = llama.convert(src, tmp_path / "dst")
    row = next(r for r in result["parity"] if r["dtype"] == "float32")
    assert row["max_abs_diff"] <= row["tolerance"]
    # the mechanism the order avoids: a bf16 round trip changes the rotary frequencies for good
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "dst", dtype=torch.float32).eval()
    exact = ours.model.rotary_emb.inv_freq.clone()
    ours.to(torch.bfloat16).to(torch.float32)
    assert ours.model.rotary_emb.inv_freq.dtype == torch.float32
    assert not torch.equal(ours.model.rotary_emb.inv_freq, exact)


def test_a_language_models_label_fields_travel_both_ways(tmp_path):
    """A LlamaForCausalLM config may name labels (LlamaForSequenceClassification.from_pretrained reads them from
    it): the hf_tiny folder and the way back keep them."""
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    label2id = {name: i for i, name in labels.items()}
    tiny_official("llama", id2label=labels, label2id=label2id).save_pretrained(tmp_path / "src")
    llama.convert(tmp_path / "src", tmp_path / "ours")
    assert transformers.AutoConfig.from_pretrained(tmp_path / "ours").id2label == labels
    assert cli(["llama", str(tmp_path / "ours"), str(tmp_path / "back"), "--reverse"]) == 0
    back = transformers.AutoConfig.from_pretrained(tmp_path / "back")
    assert (back.architectures, back.id2label, back.label2id) == (["LlamaForCausalLM"], labels, label2id)


def test_the_dtype_a_source_config_names_is_the_one_the_converted_folder_loads_in(tmp_path):
    """transformers 5 loads weights in the dtype config.json names (dtype="auto"), whatever they are stored in: a
    source storing float32 weights under dtype=bfloat16 (or the older torch_dtype) loads in bfloat16 officially, and
    so does the converted folder, with official's logits; the tensors stay float32 (a card note says so), and the way
    back names bfloat16 again. --dtype float32 overrides it, as it casts the tensors."""
    for key in ("dtype", "torch_dtype"):
        tiny_official("llama").save_pretrained(tmp_path / key / "src")
        config_file = tmp_path / key / "src" / "config.json"
        raw = json.loads(config_file.read_text())
        raw.pop("dtype", None)
        config_file.write_text(json.dumps({**raw, key: "bfloat16"}))
        llama.convert(tmp_path / key / "src", tmp_path / key / "ours")
        official = AutoModelForCausalLM.from_pretrained(tmp_path / key / "src").eval()
        ours = AutoModelForCausalLM.from_pretrained(tmp_path / key / "ours").eval()
        assert official.dtype == ours.dtype == torch.bfloat16, key
        batch = left_padded_batch(official.config.vocab_size)
        assert torch.equal(real_logits(ours, batch), real_logits(official, batch)), key
        assert all(t.dtype == torch.float32 for t in load_file(tmp_path / key / "ours" / "model.safetensors").values())
        assert "names dtype=bfloat16" in (tmp_path / key / "ours" / "README.md").read_text()
        assert cli(["llama", str(tmp_path / key / "ours"), str(tmp_path / key / "back"), "--reverse"]) == 0
        assert json.loads((tmp_path / key / "back" / "config.json").read_text())["dtype"] == "bfloat16"
    llama.convert(tmp_path / "dtype" / "src", tmp_path / "float32", dtype="float32")
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "float32").dtype == torch.float32


def test_a_value_officials_config_validation_refuses_is_a_conversion_error_naming_the_source(tmp_path, capsys):
    """transformers 5 validates configs (huggingface_hub's strict dataclasses): 5 heads over a width of 32 is refused
    there; the CLI says so as a one-line error naming the source and config.json, without the --debug hint of an
    unexpected failure, and writes nothing."""
    tiny_official("llama").save_pretrained(tmp_path / "src")
    config_file = tmp_path / "src" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "num_attention_heads": 5}))
    assert cli(["llama", str(tmp_path / "src"), str(tmp_path / "dst")]) == 1
    error = capsys.readouterr().err
    assert f"{tmp_path / 'src'}: config.json is not a valid llama config" in error and "--debug" not in error
    assert "not a multiple of the number of attention heads (5)" in error and not (tmp_path / "dst").exists()
