"""GPT-OSS checkpoints through `python -m conversion` (the llama family's gpt_oss table, conversion/gpt_oss.py): family
detection, parity, greedy tokens, the bit-exact way back, MXFP4 sources dequantised, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import hf_tiny  # noqa: F401
from causal_helpers import left_padded_batch, max_diff, real_logits
from conversion import ConversionError, detect_family, gpt_oss, llama
from conversion.__main__ import main
from conversion.mxfp4 import dequantize_mxfp4
from gpt_oss_models import FIELDS, TOLERANCE, tiny_official

pytestmark = pytest.mark.usefixtures("single_torch_thread")
GENERATE = dict(max_new_tokens=8, do_sample=False, eos_token_id=None)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss")
    official = tiny_official()
    official.save_pretrained(root / "src")
    result = llama.convert(root / "src", root / "ours")
    return official, root, result


def test_detects_converts_and_matches_official(converted):
    official, root, result = converted
    assert detect_family(root / "src") == ("llama", "model_type 'gpt_oss'")
    assert result["architecture"] == "GptOssForCausalLM" and result["parity"]
    ours = AutoModelForCausalLM.from_pretrained(root / "ours").eval()
    batch = left_padded_batch(FIELDS["vocab_size"])
    expected = real_logits(official, batch)
    for backend in ("eager", "sdpa"):
        ours.set_attn_implementation(backend)
        assert max_diff(real_logits(ours, batch), expected) <= TOLERANCE * expected.abs().max(), backend
    settings = dict(attention_mask=batch["attention_mask"], **GENERATE)
    assert torch.equal(ours.generate(batch["input_ids"], **settings), official.generate(batch["input_ids"], **settings))


def test_converts_back_bit_exact(converted, tmp_path):
    _, root, _ = converted
    assert main(["llama", str(root / "ours"), str(tmp_path / "back"), "--reverse"]) == 0
    source, back = load_file(root / "src" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert source.keys() == back.keys() and all(torch.equal(source[k], back[k]) for k in source)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "gpt_oss"


def test_halves_instead_of_interleaved_gate_up_fails_parity(tmp_path, monkeypatch):
    """Negative control: reading gate and up as the two halves of gate_up_proj is caught by the parity check."""
    official = tiny_official()
    official.save_pretrained(tmp_path / "src")

    def halves(experts, kind):
        def split(fused):
            half = fused.shape[-1] // 2
            parts = [(e[..., :half], e[..., half:]) for e in fused]
            return tuple((p.T if kind == "weight" else p).contiguous() for pair in parts for p in pair)

        return gpt_oss.Transform("halves", split, lambda *parts: None)

    monkeypatch.setattr(gpt_oss, "_gate_up", halves)
    with pytest.raises(ConversionError, match="does not match the official"):
        llama.convert(tmp_path / "src", tmp_path / "ours")
    assert not (tmp_path / "ours").exists()


def _mxfp4_pair(fused: torch.Tensor, generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks / scales for an official fused tensor's shape [E, in, out]; and their bf16 value."""
    experts, inputs, outputs = fused.shape
    blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(122, 127, (experts, outputs, inputs // 32), generator=generator, dtype=torch.uint8)
    value = dequantize_mxfp4(blocks, scales, dtype=torch.bfloat16).transpose(-1, -2)
    return blocks, scales, value


def test_mxfp4_source_converts_as_its_dequantised_weights(tmp_path):
    """An MXFP4 checkpoint (the released layout: *_blocks / *_scales + quantization_config) converts to the same
    weights as the bf16 checkpoint holding its dequantised values, and the card says the source was MXFP4."""
    official = tiny_official(hidden_size=64, intermediate_size=32, head_dim=16, num_attention_heads=4).bfloat16()
    generator = torch.Generator().manual_seed(3)
    state = {k: v.contiguous() for k, v in official.state_dict().items()}
    quantized = dict(state)
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales, value = _mxfp4_pair(state[key], generator)
        state[key] = value.contiguous()
        del quantized[key]
        quantized.update({f"{key}_blocks": blocks, f"{key}_scales": scales})
    for folder, tensors in (("plain", state), ("mxfp4", quantized)):
        official.config.save_pretrained(tmp_path / folder)
        save_file(tensors, tmp_path / folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "mxfp4" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(config))

    for folder in ("plain", "mxfp4"):
        llama.convert(tmp_path / folder, tmp_path / f"{folder}_ours")
    plain, mxfp4 = (load_file(tmp_path / f"{f}_ours" / "model.safetensors") for f in ("plain", "mxfp4"))
    assert plain.keys() == mxfp4.keys() and all(torch.equal(plain[k], mxfp4[k]) for k in plain)
    assert "stored in MXFP4" in (tmp_path / "mxfp4_ours" / "README.md").read_text()
    assert "stored in MXFP4" not in (tmp_path / "plain_ours" / "README.md").read_text()


def test_a_config_gpt_oss_cannot_hold_is_refused_naming_the_fields(converted, tmp_path):
    _, root, _ = converted
    edited = tmp_path / "edited"
    edited.mkdir()
    for path in (root / "ours").iterdir():
        if path.is_file():
            (edited / path.name).write_bytes(path.read_bytes())
    config = json.loads((edited / "config.json").read_text())
    config["router_bias"] = False
    (edited / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=r"GPT-OSS needs .*'router_bias': False"):
        llama.convert_back(edited, tmp_path / "back")


def test_a_swiglu_limit_the_installed_official_class_ignores_is_named(tmp_path):
    """transformers 5.16.1's GptOssForCausalLM computes with swiglu_limit 7 whatever config.json says; 5.24 reads
    the field. A checkpoint with limit 2 converts with parity where the official class reads it, and elsewhere is
    refused naming that cause (parity could only fail, "3.1 > 5.93e-05", with no hint). Which release does which is
    measured here on the official class itself (limit 2 against limit 7 on the same weights)."""
    official = tiny_official(swiglu_limit=2.0)
    official.save_pretrained(tmp_path / "src")
    assert json.loads((tmp_path / "src" / "config.json").read_text())["swiglu_limit"] == 2.0
    batch = left_padded_batch(FIELDS["vocab_size"])
    honours_the_limit = not torch.equal(real_logits(official, batch), real_logits(tiny_official(swiglu_limit=7.0), batch))
    assert gpt_oss.official_reads_swiglu() == honours_the_limit
    if honours_the_limit:
        result = llama.convert(tmp_path / "src", tmp_path / "ours")  # raises if an fp32 row is over tolerance
        assert result["config"].swiglu_limit == 2.0 and result["parity"]
    else:
        with pytest.raises(ConversionError, match=r"'swiglu_limit': 2\.0.* ignores these fields and computes with "
                                                  r"\{'swiglu_limit': 7\.0"):
            llama.convert(tmp_path / "src", tmp_path / "ours")
        assert not (tmp_path / "ours").exists()
