"""Encoder and encoder-decoder inputs as official transformers takes them (issue 33): outputs at every position of
a right-padded batch, padding positions included (BERT: a padding query sees every real key; BART: a padded
decoder query sees the real decoder tokens before it and every real encoder token), and 1-D token_type_ids,
which official BERT broadcasts over the batch (item 8)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel, AutoModelForSeq2SeqLM, BartForConditionalGeneration

import hf_tiny  # noqa: F401  (registers the Auto classes)
from conversion import bart
from bart_models import make_official_bart
from bart_models import padded_batch as bart_batch
from bert_models import convert_official, official_model
from bert_models import padded_batch as bert_batch

pytestmark = pytest.mark.usefixtures("single_torch_thread")

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def bert_pair(tmp_path_factory):
    official = official_model("BertModel")
    _, folder, _ = convert_official(official, tmp_path_factory.mktemp("bert"))
    return official, folder


def everywhere(official, ours, batch, field: str) -> tuple[float, torch.Tensor]:
    with torch.no_grad():
        expected = getattr(official(**batch), field).double()
        got = getattr(ours(**batch), field).double()
    return float((got - expected).abs().max()), expected


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_bert_outputs_at_every_position_of_a_right_padded_batch(bert_pair, backend):
    official, folder = bert_pair
    official.set_attn_implementation(backend)
    ours = AutoModel.from_pretrained(folder, attn_implementation=backend).eval()
    batch = bert_batch()
    diff, expected = everywhere(official, ours, batch, "last_hidden_state")
    assert diff <= TOLERANCE * max(1.0, float(expected.abs().max())), f"{backend}: max |Δ| = {diff:.3g}"
    # negative control: padding positions carry real values (an encoder zeroing them would fail the check above)
    assert float(expected[batch["attention_mask"] == 0].abs().max()) > 0.1


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_bart_logits_at_every_decoder_position_of_a_padded_batch(backend, tmp_path):
    src = make_official_bart(tmp_path / "official")
    bart.convert(src, tmp_path / "ours")
    official = BartForConditionalGeneration.from_pretrained(src, attn_implementation=backend).eval()
    ours = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "ours", attn_implementation=backend).eval()
    batch = {**bart_batch(official.config), "use_cache": False}
    diff, expected = everywhere(official, ours, batch, "logits")
    assert diff <= TOLERANCE * max(1.0, float(expected.abs().max())), f"{backend}: max |Δ| = {diff:.3g}"
    assert float(expected[batch["decoder_attention_mask"] == 0].abs().max()) > 0.1


def test_one_dimensional_token_type_ids_broadcast_as_official(bert_pair):
    official, folder = bert_pair
    ours = AutoModel.from_pretrained(folder).eval()
    batch = bert_batch()
    types = batch.pop("token_type_ids")[0]  # [seq_len], shared by every row
    with torch.no_grad():
        expected = official(**batch, token_type_ids=types).last_hidden_state
        got = ours(**batch, token_type_ids=types).last_hidden_state
        as_rows = ours(**batch, token_type_ids=types.expand(3, -1)).last_hidden_state
        other = ours(**batch, token_type_ids=types.flip(0)).last_hidden_state
    assert float((got - expected).abs().max()) <= TOLERANCE * max(1.0, float(expected.abs().max()))
    assert torch.equal(got, as_rows)
    assert float((other - expected).abs().max()) > 1e-2  # negative control: the types are read, not dropped


@pytest.mark.parametrize("types, message", [
    (torch.zeros(11, dtype=torch.long), r"token_type_ids has shape \(11,\) but the input needs \(3, 12\), \(12,\)"),
    (torch.full((12,), 3), r"token_type_ids contains 3, outside \[0, type_vocab_size=3\)"),
])
def test_bad_one_dimensional_token_type_ids_are_named(bert_pair, types, message):
    ours = AutoModel.from_pretrained(bert_pair[1]).eval()
    batch = bert_batch()
    batch.pop("token_type_ids")
    with pytest.raises(ValueError, match=message):
        ours(**batch, token_type_ids=types)


@pytest.mark.parametrize("kind", ["additive", "bool"])
def test_an_extended_mask_with_one_row_for_every_query_is_read_as_official(bert_pair, kind):
    """[batch, 1, 1, keys], what BERT-era code passes (get_extended_attention_mask: 0 / finfo.min): official
    broadcasts it over the queries; so does hf_tiny (before: refused, asking for [batch, 1, queries, keys])."""
    official, folder = bert_pair
    ours = AutoModel.from_pretrained(folder).eval()
    batch = bert_batch()
    mask = batch.pop("attention_mask")
    extended = {"additive": (1.0 - mask.float()) * torch.finfo(torch.float32).min, "bool": mask.bool()}[kind][:, None, None, :]
    real = mask.bool()
    with torch.no_grad():
        expected = official(**batch, attention_mask=mask).last_hidden_state
        got = ours(**batch, attention_mask=extended).last_hidden_state
        unmasked = ours(**batch).last_hidden_state  # negative control: the padding keys seen
    assert float((got - expected)[real].abs().max()) <= TOLERANCE * max(1.0, float(expected.abs().max()))
    assert float((unmasked - expected)[real].abs().max()) > 1e-2
    with pytest.raises(ValueError, match=r"expected \[batch, 1, 12, 12\] or \[batch, 1, 1, 12\]"):
        ours(**batch, attention_mask=extended[..., :11])
