"""generate()'s tokenizer-driven stopping against official transformers on the same weights (issue 33, item 5):
generate(..., tokenizer=tok, stop_strings=[...]) and the text-generation pipeline's stop_sequence give official's
tokens and stop where official stops. The tokenizer is all-MiniLM-L6-v2's WordPiece (a real tokenizer, local)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

import hf_tiny  # noqa: F401  (registers the Auto classes)
from causal_helpers import tiny_official
from conversion import llama

pytestmark = [pytest.mark.usefixtures("single_torch_thread"), pytest.mark.real_weights]

PROMPT = "the cat sat on"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def setup(real_minilm_dir, tmp_path_factory):
    tokenizer = AutoTokenizer.from_pretrained(real_minilm_dir)
    official = tiny_official("llama", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                             bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id)
    folder = tmp_path_factory.mktemp("llama")
    official.save_pretrained(folder / "src")
    llama.convert(folder / "src", folder / "ours")
    ours = AutoModelForCausalLM.from_pretrained(folder / "ours").eval()
    inputs = tokenizer(PROMPT, return_tensors="pt", return_token_type_ids=False)
    free = official.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    # a stop string that the free-running answer reaches half-way: its fourth new word
    stop = tokenizer.decode(free[0, inputs["input_ids"].shape[1]:]).split()[3]
    return tokenizer, official, ours, inputs, free, stop


def test_generate_with_tokenizer_and_stop_strings_stops_where_official_stops(setup):
    tokenizer, official, ours, inputs, free, stop = setup
    settings = dict(max_new_tokens=NEW_TOKENS, do_sample=False, tokenizer=tokenizer, stop_strings=[stop])
    expected = official.generate(**inputs, **settings)
    got = ours.generate(**inputs, **settings)
    assert torch.equal(got, expected)
    assert free.shape[1] > expected.shape[1]  # negative control: without the stop string generation runs on
    assert tokenizer.decode(got[0]).endswith(stop)


def test_pipeline_stop_sequence_gives_officials_text(setup):
    tokenizer, official, ours, inputs, free, stop = setup
    texts = []
    for model in (official, ours):
        generate = pipeline("text-generation", model=model, tokenizer=tokenizer)
        texts.append(generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, stop_sequence=stop)[0]["generated_text"])
    assert texts[1] == texts[0]
    assert len(texts[0]) < len(tokenizer.decode(free[0], skip_special_tokens=True))
