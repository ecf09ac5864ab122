"""Special token ids outside the vocabulary (issue 33, item 9): a GPT-2 checkpoint keeping GPT-2's bos/eos 50256
with a small vocabulary loads in official transformers with a warning; `python -m conversion gpt2` converts it with
official's warning, the converted folder loads with it and generates as official, and the model card says so."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_tiny
from conversion.__main__ import main
from conversion.cards import special_token_note
from test_convert_gpt2 import tiny_gpt2

pytestmark = pytest.mark.usefixtures("single_torch_thread")

WARNING = "bos_token_id must be `None` or an integer within the vocabulary (between 0 and 96), got 50256"


def transformers_warnings(action) -> tuple[object, list[str]]:
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        result = action()
    finally:
        logger.removeHandler(handler)
    return result, [r.getMessage() for r in records]


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
