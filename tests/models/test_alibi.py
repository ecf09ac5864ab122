"""ALiBi: slopes for any head count against the paper's rule and BLOOM's / MPT's official functions, parity with
official MPT through the converter (logits per backend, greedy / beam / static-cache tokens), packed rows, the
reverse conversion, negative controls and bad inputs."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, StaticCache
from transformers.models.bloom.modeling_bloom import build_alibi_tensor
from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

import hf_tiny  # noqa: F401  (registers the Auto classes)
from causal_helpers import left_padded_batch, max_diff, real_logits
from conversion import ConversionError, mpt
from hf_tiny import TinyCausalConfig, TinyCausalForCausalLM
from hf_tiny.masks import alibi_slopes
from mpt_models import tiny_mpt

pytestmark = pytest.mark.usefixtures("single_torch_thread")

TOLERANCE = 1e-5


@pytest.mark.parametrize("heads", [1, 2, 3, 4, 5, 6, 8, 12, 16, 20, 32, 40, 64, 80])
def test_slopes_equal_bloom_and_mpt_for_any_head_count(heads):
    ours = alibi_slopes(heads)
    bloom = build_alibi_tensor(torch.ones(1, 2), heads, torch.float32)[:, 0, 1]  # slope x position 1
    mpt_slopes = -build_mpt_alibi_tensor(heads, 2)[:, 0, 0]  # bias at distance 1 = -slope
    assert torch.allclose(ours, bloom, rtol=1e-6) and torch.allclose(ours, mpt_slopes, rtol=1e-6)


def test_slopes_follow_the_papers_geometric_rule():
    """Press et al. (2022), section 3: for 8 heads the slopes are 1/2, 1/4, ..., 1/256; for n heads (a power of
    two) the geometric sequence starting at and with ratio 2^(-8/n)."""
    assert alibi_slopes(8).tolist() == [2.0**-k for k in range(1, 9)]
    ratio = 2 ** (-8 / 16)
    assert torch.allclose(alibi_slopes(16), torch.tensor([ratio**k for k in range(1, 17)]), rtol=1e-6)


def convert(official, tmp_path):
    official.save_pretrained(tmp_path / "src")
    result = mpt.convert(tmp_path / "src", tmp_path / "ours")
    assert result["architecture"] == "MptForCausalLM"
    return result


@pytest.mark.parametrize("heads", [4, 6])
def test_logits_match_official_mpt_per_backend(heads, tmp_path):
    official = tiny_mpt(heads)
    result = convert(official, tmp_path)
    assert all(row["max_abs_diff"] <= row["tolerance"] for row in result["parity"])
    batch = left_padded_batch(97)
    expected = real_logits(official, batch)
    assert expected.abs().max() > 1.0
    for backend in ("eager", "sdpa"):
        ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation=backend).eval()
        assert ours.config.position_embedding_type == "alibi" and ours.model.rotary_emb is None
        diff = max_diff(real_logits(ours, batch), expected)
        assert diff <= TOLERANCE * max(1.0, float(expected.abs().max())), f"{heads} heads / {backend}: {diff:.3g}"


@pytest.mark.parametrize("heads", [4, 6])
def test_greedy_beam_and_static_cache_tokens_identical(heads, tmp_path):
    official = tiny_mpt(heads)
    convert(official, tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    batch = left_padded_batch(97, lengths=(9, 6, 3), seed=1)
    settings = dict(attention_mask=batch["attention_mask"], max_new_tokens=10, do_sample=False, pad_token_id=0,
                    eos_token_id=None)
    for extra in ({}, {"num_beams": 3}):
        expected = official.generate(batch["input_ids"], **settings, **extra)
        assert torch.equal(ours.generate(batch["input_ids"], **settings, **extra), expected), extra
    # MPT's generation config says use_cache=False, which would leave the static cache unused
    caches = []
    ours.register_forward_pre_hook(
        lambda _module, _args, kwargs: caches.append(type(kwargs.get("cache", kwargs.get("past_key_values")))),
        with_kwargs=True)
    static = ours.generate(batch["input_ids"], cache_implementation="static", use_cache=True, **settings)
    assert caches == [StaticCache] * settings["max_new_tokens"]
    assert torch.equal(static, official.generate(batch["input_ids"], **settings))


@pytest.mark.parametrize("perturbation", [{"alibi_bias_max": 4.0}, {"num_attention_heads": 4, "alibi_bias_max": 16.0}])
def test_negative_control_other_slopes_are_rejected(perturbation, tmp_path):
    official = tiny_mpt()
    convert(official, tmp_path)
    batch = left_padded_batch(97)
    wrong = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", **perturbation).eval()
    assert max_diff(real_logits(wrong, batch), real_logits(official, batch)) > 100 * TOLERANCE


def test_packed_rows_equal_each_sequence_alone(tmp_path):
    """The distance bias is relative, so a sequence packed after another (restarting position_ids) scores as alone."""
    official = tiny_mpt()
    convert(official, tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    generator = torch.Generator().manual_seed(3)
    first, second = torch.randint(3, 97, (1, 7), generator=generator), torch.randint(3, 97, (1, 5), generator=generator)
    packed = torch.cat((first, second), dim=1)
    positions = torch.cat((torch.arange(7), torch.arange(5)))[None]
    with torch.no_grad():
        logits = ours(packed, position_ids=positions).logits
        alone = torch.cat((ours(first).logits, ours(second).logits), dim=1)
    assert max_diff(logits, alone) <= 1e-5


def test_convert_back_is_bit_exact_and_loads_cleanly(tmp_path):
    official = tiny_mpt(heads=6)
    convert(official, tmp_path)
    result = mpt.convert_back(tmp_path / "ours", tmp_path / "back")
    assert result["architecture"] == "MptForCausalLM"
    src, back = load_file(tmp_path / "src" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert src.keys() == back.keys() and all(torch.equal(src[k], back[k]) for k in src)


def test_cli_detects_mpt_and_converts_back(tmp_path):
    from conversion.__main__ import main as cli

    tiny_mpt().save_pretrained(tmp_path / "src")
    assert cli([str(tmp_path / "src"), str(tmp_path / "ours")]) == 0
    assert cli([str(tmp_path / "ours"), str(tmp_path / "back"), "--reverse"]) == 0
    assert (tmp_path / "back" / "config.json").is_file()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"attn_config": {"clip_qkv": 6.0}}, "'attn_config.clip_qkv': 6.0"),
        ({"attn_config": {"alibi": False}}, "'attn_config.alibi': False"),
        ({"expansion_ratio": 2}, "'expansion_ratio': 2"),
    ],
)
def test_mpt_options_we_cannot_reproduce_are_clear_errors(changes, message, tmp_path):
    import json

    tiny_mpt().save_pretrained(tmp_path / "src")
    path = tmp_path / "src" / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if key == "attn_config":
            raw["attn_config"].update(value)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))
    with pytest.raises(ConversionError) as error:
        mpt.convert(tmp_path / "src", tmp_path / "ours")
    assert message in str(error.value)
    assert not (tmp_path / "ours").exists()


BASE = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
            position_embedding_type="alibi", norm_type="layernorm")


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}, "takes no rotary embeddings"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}, "takes no rotary embeddings"),
        ({"alibi_bias_max": 0.0}, "alibi_bias_max must be a positive number"),
        ({"num_nextn_predict_layers": 1}, "position_embedding_type='alibi' is not supported with them"),
    ],
)
def test_bad_alibi_config_is_a_clear_error(changes, message):
    with pytest.raises(ValueError) as error:
        TinyCausalConfig(**{**BASE, **changes})
    assert message in str(error.value)


def test_alibi_with_a_backend_that_takes_no_bias_is_a_clear_error():
    model = TinyCausalForCausalLM(TinyCausalConfig(**BASE)).eval()
    model.set_attn_implementation("flash_attention_2")
    with pytest.raises(ValueError, match="bias"):
        model(torch.tensor([[1, 2, 3]]))
