"""Padded batches against official transformers on the same weights (issue 33, item 2): the logits at every
position, padding positions included, for left and right padding, every causal family hf_tiny has, eager and
sdpa; right-padded generate() gives official's tokens and official's right-padding warning.

The one row allowed to differ is a query that sees no key at all (a left-padded row's leading padding queries, or a
right-padded query further than a sliding window from the last real token): hf_tiny's attention returns zeros
there in every backend, official's eager the average of the values it was handed (official's sdpa agrees with
hf_tiny on CPU); see docs/compatibility.md, "Deliberate divergences". Such rows are checked only for being finite."""

from __future__ import annotations


import pytest
import torch
from transformers import AutoModelForCausalLM

import deepseek_models
import gpt2_models
import gpt_oss_models
import llama_models
import mpt_models
import phi3_models
from causal_helpers import tiny_official, transformers_warnings
from conversion import gpt2, llama, mpt, phi3

pytestmark = pytest.mark.usefixtures("single_torch_thread")

TOLERANCE = 1e-5
LENGTHS = (12, 9, 4)


def _llama_family(kind, **overrides):
    return lambda: (tiny_official(kind, **overrides), llama)


FAMILIES = {
    "llama": _llama_family("llama"),
    "mistral_sliding": _llama_family("mistral", sliding_window=5),
    "qwen2": _llama_family("qwen2"),
    "qwen3": _llama_family("qwen3", head_dim=16),
    # per-layer-type rope_parameters spelled out: transformers 5.16's Gemma 3 default is a flat dict
    "gemma3_text": _llama_family("gemma3_text", **llama_models.VARIANTS["gemma3"][1]),
    "mixtral": _llama_family("mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": _llama_family("qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                               shared_expert_intermediate_size=24),
    "qwen3_moe": _llama_family("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                               head_dim=16),
    "deepseek_v3": lambda: (deepseek_models.tiny_deepseek("mla_moe"), llama),
    "gpt2": lambda: (gpt2_models.tiny_gpt2(), gpt2),
    "phi3": lambda: (phi3_models.tiny_phi3(), phi3),
    "mpt": lambda: (mpt_models.tiny_mpt(), mpt),
    "gpt_oss": lambda: (gpt_oss_models.tiny_official(), None),  # no converter yet: gpt_oss_models' key table
}


def padded_batch(vocab_size: int, side: str, lengths=LENGTHS, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, vocab_size, (len(lengths), width), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        if side == "left":
            mask[row, width - length:] = 1
        else:
            mask[row, :length] = 1
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def sees_a_key(attention_mask: torch.Tensor, window=None) -> torch.Tensor:
    """[batch, length] True where a causal query sees at least one real key in every layer: a real token at or
    before it, and within a sliding window (keys k with q - k < window) when a layer has one."""
    length = attention_mask.shape[1]
    query, key = torch.arange(length)[:, None], torch.arange(length)[None, :]
    visible = (key <= query) & ((query - key < window) if window else True)
    return (visible[None] & attention_mask.bool()[:, None, :]).any(-1)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            official, converter = FAMILIES[family]()
            folder = tmp_path_factory.mktemp(family)
            if converter is None:
                gpt_oss_models.ours_from(official).save_pretrained(folder / "ours")
            else:
                official.save_pretrained(folder / "src")
                converter.convert(folder / "src", folder / "ours")
            cache[family] = official, folder / "ours"
        return cache[family]

    return get


def logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).logits.double()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_at_every_position_equal_official_left_and_right_padded(family, converted):
    official, folder = converted(family)
    for backend in ("eager", "sdpa"):
        # official GPT-OSS has eager attention only: both of ours are compared with it
        official.set_attn_implementation(backend if official._supports_sdpa else "eager")
        ours = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=backend).eval()
        for side in ("left", "right"):
            batch = padded_batch(official.config.vocab_size, side)
            expected, got = logits(official, batch), logits(ours, batch)
            compared = sees_a_key(batch["attention_mask"], getattr(official.config, "sliding_window", None))
            padding = compared & (batch["attention_mask"] == 0)
            scale = max(1.0, float(expected[compared].abs().max()))
            diff = float((got - expected)[compared].abs().max())
            assert diff <= TOLERANCE * scale, f"{family} / {backend} / {side}: max |Δ| = {diff:.3g}"
            assert torch.isfinite(got).all()
            if side == "right":  # negative control: a model zeroing padding queries (issue 33's bug) would fail
                assert float(expected[padding].abs().max()) > 0.1


def generate_with_warnings(model, batch: dict) -> tuple[torch.Tensor, list[str]]:
    """Greedy tokens and the warnings transformers logged meanwhile."""
    return transformers_warnings(
        lambda: model.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None))


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt2"])
def test_right_padded_generate_gives_officials_tokens_and_warning(family, converted):
    official, folder = converted(family)
    official.set_attn_implementation("sdpa")
    ours = AutoModelForCausalLM.from_pretrained(folder).eval()
    batch = padded_batch(official.config.vocab_size, "right")
    expected, official_warnings = generate_with_warnings(official, batch)
    tokens, warnings = generate_with_warnings(ours, batch)
    assert torch.equal(tokens, expected)
    assert any("right-padding was detected" in w for w in official_warnings)
    assert warnings == official_warnings
    # negative control: the short row generated alone continues differently, so the padded positions' values (what
    # issue 33's bug got wrong) decide the padded batch's tokens
    alone = batch["input_ids"][2:, : LENGTHS[2]]
    alone_tokens = official.generate(alone, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert not torch.equal(alone_tokens[0, -6:], expected[2, -6:])
