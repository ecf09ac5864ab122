"""Special token ids outside the vocabulary (issue 33, item 9): a GPT-2 checkpoint keeping GPT-2's bos/eos 50256
with a small vocabulary loads in official transformers with a warning; `python -m conversion gpt2` converts it with
official's warning, the converted folder loads with it and generates as official, and the model card says so."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_tiny
from conversion.__main__ import main
from conversion.cards import special_token_note
from causal_helpers import tiny_official, transformers_warnings
from gpt2_models import tiny_gpt2

pytestmark = pytest.mark.usefixtures("single_torch_thread")

WARNING = "bos_token_id must be `None` or an integer within the vocabulary (between 0 and 96), got 50256"


def test_gpt2_with_bos_eos_outside_a_small_vocabulary_converts_with_officials_warning(tmp_path):
    official = tiny_gpt2(bos_token_id=50256, eos_token_id=50256, pad_token_id=None)
    official.save_pretrained(tmp_path / "src")
    hf_tiny.validation.logger.warning_once.cache_clear()  # warning_once: each test sees its own warnings
    code, warnings = transformers_warnings(lambda: main(["gpt2", str(tmp_path / "src"), str(tmp_path / "ours")]))
    assert code == 0
    assert any(WARNING in w for w in warnings), warnings
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["vocab_size"]) == (50256, 50256, 97)
    card = (tmp_path / "ours" / "README.md").read_text()
    assert "`bos_token_id` = 50256, `eos_token_id` = 50256 lie outside the vocabulary (ids 0 .. 96)" in card
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(0))
    settings = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **settings), official.generate(ids, **settings))


def test_card_note_only_for_ids_outside_the_vocabulary(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"vocab_size": 97, "bos_token_id": 1, "eos_token_id": [2, 96], "pad_token_id": None}))
    assert special_token_note(path) == ""  # negative control: ids inside the vocabulary say nothing
    path.write_text(json.dumps({"vocab_size": 97, "bos_token_id": 1, "eos_token_id": [2, 97], "pad_token_id": -1}))
    note = special_token_note(path)
    assert "`eos_token_id` = [2, 97], `pad_token_id` = -1 lie outside the vocabulary (ids 0 .. 96)" in note
    assert "bos_token_id" not in note


def test_pad_token_id_minus_one_is_accepted_as_official_llama_accepts_it():
    """Old LLaMA configs store pad_token_id=-1: official warns and loads, its embedding reading -1 as the last row
    (padding_idx: that row gets no gradient); hf_tiny's config and embedding do the same. An id past the
    vocabulary stays an error (official's embedding refuses it too)."""
    official = tiny_official("llama", pad_token_id=-1)
    hf_tiny.validation.logger.warning_once.cache_clear()
    fields = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=1, pad_token_id=-1)
    config, warnings = transformers_warnings(lambda: hf_tiny.TinyCausalConfig(**fields))
    assert any("pad_token_id must be `None` or an integer within the vocabulary (between 0 and 96), got -1" in w
               for w in warnings), warnings
    ours = hf_tiny.TinyCausalForCausalLM(config).train()
    assert ours.model.embed_tokens.padding_idx == official.model.embed_tokens.padding_idx == 96
    ids = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    ids[:, 2] = 96  # the padding row as an input token: no gradient reaches it in either model
    ours(input_ids=ids, labels=ids).loss.backward()
    official.train()(input_ids=ids, labels=ids).loss.backward()
    for model in (ours, official):
        grad = model.model.embed_tokens.weight.grad
        assert torch.equal(grad[96], torch.zeros(32))
        assert float(grad[ids[0, 0]].abs().max()) > 0  # negative control: other input rows do get gradient
    with pytest.raises(ValueError, match=r"pad_token_id must be None or a token id in \[0, 97\), got 97"):
        hf_tiny.TinyCausalConfig(**{**fields, "pad_token_id": 97})


def test_pad_token_id_minus_one_survives_conversion(tmp_path):
    """A Llama checkpoint with pad_token_id=-1 converts keeping it: the same padding row (the last) as official."""
    from conversion import llama

    tiny_official("llama").save_pretrained(tmp_path / "src")  # transformers 5.16 refuses to save pad -1 itself
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "src" / "config.json").write_text(json.dumps({**config, "pad_token_id": -1}))
    (tmp_path / "src" / "generation_config.json").unlink(missing_ok=True)
    llama.convert(tmp_path / "src", tmp_path / "ours")
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    assert ours.config.pad_token_id == -1 and ours.model.embed_tokens.padding_idx == 96
