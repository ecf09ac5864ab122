"""SmolLM3, OLMo 2 and Llama 4 text through `python -m conversion` (the llama family's tables conversion/smollm3.py,
olmo2.py, llama4.py): family detection, parity per backend, greedy tokens with the cache, the bit-exact way back, a
negative control per table, and what each official class cannot hold refused by name. (GPT-OSS:
conversion/test_gpt_oss.py; the models' own parity tests: models/test_smollm3.py, test_olmo2.py, test_llama4_text.py.)"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_tiny  # noqa: F401
from conversion import ConversionError, detect_family, llama, llama4, llama_configs, olmo2
from conversion.__main__ import main
from family_parity import TOLERANCE, greedy_tokens, logits_error
from llama4_models import tiny_llama4
from olmo2_models import tiny_olmo2
from smollm3_models import tiny_smollm3

pytestmark = pytest.mark.usefixtures("single_torch_thread")

CASES = {  # case -> (official model maker, its variant, official model_type)
    "smollm3_nope": (tiny_smollm3, "nope_every_2nd", "smollm3"),
    "smollm3_sliding_biases": (tiny_smollm3, "sliding_nope_biases_tied", "smollm3"),
    "olmo2_gqa": (tiny_olmo2, "gqa", "olmo2"),
    "olmo2_biases_tied": (tiny_olmo2, "mha_biases_tied_theta", "olmo2"),
    "llama4_scout_like": (tiny_llama4, "scout_like", "llama4_text"),
    "llama4_maverick_like": (tiny_llama4, "maverick_like_biases_top2", "llama4_text"),
    # no MoE layer (moe_layers=[]): every layer dense, and back to moe_layers=[]
    "llama4_dense": (lambda variant: tiny_llama4(variant, moe_layers=[]), "scout_like", "llama4_text"),
}


def convert(case: str, tmp_path):
    make, variant, _ = CASES[case]
    official = make(variant)
    official.save_pretrained(tmp_path / "src")
    return official, llama.convert(tmp_path / "src", tmp_path / "ours")


@pytest.mark.parametrize("case", sorted(CASES))
def test_converts_with_parity_tokens_and_back_bit_exact(case, tmp_path):
    official, result = convert(case, tmp_path)
    model_type = CASES[case][2]
    assert detect_family(tmp_path / "src") == ("llama", f"model_type {model_type!r}")
    assert result["architecture"] == type(official).__name__
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    # official's float32 q / k rotation in bf16 / fp16 models (models/test_llama4_text.py, test_olmo2.py)
    assert ours.config.rounding.rope_float32 is (model_type in ("llama4_text", "olmo2"))
    for backend in ("eager", "sdpa"):
        assert logits_error(official, ours, backend) <= TOLERANCE, backend
    assert torch.equal(greedy_tokens(ours), greedy_tokens(official))
    assert main(["llama", str(tmp_path / "ours"), str(tmp_path / "back"), "--reverse"]) == 0
    source, back = (load_file(tmp_path / f / "model.safetensors") for f in ("src", "back"))
    assert source.keys() == back.keys() and all(torch.equal(source[k], back[k]) for k in source)
    # the config reads as the source's, down to the intervals official derives its layer lists from
    source_config, back_config = (json.loads((tmp_path / f / "config.json").read_text()) for f in ("src", "back"))
    assert back_config == source_config and back_config["model_type"] == model_type


def test_llama4_rotary_rows_not_permuted_fail_parity(tmp_path, monkeypatch):
    """Negative control: Llama 4's q/k rows read without the interleaved -> rotate-half permutation."""
    identity = llama4.Transform("identity", lambda t: t, lambda t: t)
    monkeypatch.setattr(llama4, "rotary_rows", lambda heads: identity)
    with pytest.raises(ConversionError, match="does not match the official"):
        convert("llama4_scout_like", tmp_path)


def test_olmo2_norms_swapped_fail_parity(tmp_path, monkeypatch):
    """Negative control: OLMo 2's two post-norms read the wrong way round."""
    swapped = {"post_attention_layernorm": "mlp_output_layernorm", "post_feedforward_layernorm": "attn_output_layernorm"}
    monkeypatch.setitem(llama_configs.OFFICIAL_TYPES, "olmo2", dataclasses.replace(olmo2.VARIANT, layer_norms=swapped))
    with pytest.raises(ConversionError, match="does not match the official"):
        convert("olmo2_gqa", tmp_path)


def test_llama4_moe_layers_without_experts_are_refused_by_name(tmp_path):
    """Official builds MoE layers of no experts where num_local_experts=0 keeps the default moe_layers."""
    official = tiny_llama4("scout_like", num_local_experts=0)
    official.save_pretrained(tmp_path / "src")
    with pytest.raises(ConversionError, match=r"moe_layers=\[0, 1, 2, 3\] but num_local_experts=0"):
        llama.convert(tmp_path / "src", tmp_path / "ours")
    assert not (tmp_path / "ours").exists()


@pytest.mark.parametrize("case, change, message", [
    ("olmo2_gqa", {"mlp_bias": True}, r"OLMo 2 needs .*'mlp_bias': True"),
    ("smollm3_nope", {"qk_norm": True}, r"SmolLM3 needs .*'qk_norm': True"),
    ("llama4_scout_like", {"sandwich_norms": True, "rms_norm_unit_offset": False},
     r"Llama 4 text needs .*'sandwich_norms': True"),
])
def test_a_config_the_official_class_cannot_hold_is_refused_by_name(case, change, message, tmp_path):
    convert(case, tmp_path)
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    (tmp_path / "ours" / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConversionError, match=message):
        llama.convert_back(tmp_path / "ours", tmp_path / "back")


def test_llama4_router_reads_what_official_reads_in_training(tmp_path):
    """Official Llama 4 text adds no load-balancing loss and no router jitter, whatever its config says, and returns
    router logits when output_router_logits is set: the converted model's training-mode loss equals official's under
    any seed, and its config says output_router_logits as the source's does, both ways."""
    official = tiny_llama4("scout_like", router_aux_loss_coef=0.5, router_jitter_noise=0.5, output_router_logits=True)
    official.save_pretrained(tmp_path / "src")
    llama.convert(tmp_path / "src", tmp_path / "ours")
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    ids = torch.randint(3, official.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    official.train(), ours.train()
    for seed in range(3):
        torch.manual_seed(seed)
        expected = official(input_ids=ids, labels=ids)
        torch.manual_seed(seed)
        got = ours(input_ids=ids, labels=ids)
        torch.testing.assert_close(got.loss, expected.loss, rtol=1e-5, atol=1e-6)
        theirs = getattr(expected, "router_logits", None)  # official returns them from transformers 5.2x
        assert got.router_logits and (theirs is None or len(theirs) == len(got.router_logits))
    assert main(["llama", str(tmp_path / "ours"), str(tmp_path / "back"), "--reverse"]) == 0
    assert json.loads((tmp_path / "back" / "config.json").read_text())["output_router_logits"] is True
