"""The causal LM family as a model: config validation, input checks, outputs, loss (incl. Trainer's
num_items_in_batch), save/load, gradient checkpointing, sequence classification."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    DynamicCache,
    LlamaConfig,
    LlamaForSequenceClassification,
)

import hf_tiny  # noqa: F401
from causal_helpers import BASE, left_padded_batch, max_diff, randomize, tiny_official, transformers_warnings
from hf_tiny import TinyCausalConfig, TinyCausalForCausalLM, TinyCausalForSequenceClassification, TinyCausalModel
from hf_tiny.transformers_api import enable_activation_checkpointing

pytestmark = pytest.mark.usefixtures("single_torch_thread")

TOLERANCE = 1e-5
SMALL = {k: v for k, v in BASE.items() if k not in ("initializer_range",)}


def tiny_ours(**overrides) -> TinyCausalForCausalLM:
    torch.manual_seed(0)
    return randomize(TinyCausalForCausalLM(TinyCausalConfig(**{**SMALL, **overrides}))).eval()


# ------------------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------------------


def test_config_defaults_and_auto_registration():
    config = TinyCausalConfig()  # transformers builds configs without arguments
    assert (config.head_dim, config.num_key_value_heads, config.rope_parameters["rope_type"]) == (128, 32, "default")
    assert AutoConfig.for_model("hf_tiny_causal").model_type == "hf_tiny_causal"
    assert type(AutoModel.from_config(TinyCausalConfig(**SMALL))) is TinyCausalModel


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(num_attention_heads=4, num_key_value_heads=3), "num_attention_heads (4) must be divisible by num_key_value_heads (3)"),
        (dict(hidden_size=30, num_attention_heads=4), "hidden_size (30) must be divisible by num_attention_heads (4)"),
        (dict(head_dim=7), "head_dim must be even for rotary embeddings, got 7"),
        (dict(vocab_size=0), "vocab_size must be a positive integer, got 0"),
        (dict(num_hidden_layers=-1), "num_hidden_layers must be a positive integer, got -1"),
        (dict(sliding_window=0), "sliding_window must be a positive integer, got 0"),
        (dict(hidden_act="swish2"), "unknown hidden_act 'swish2'"),
        (dict(rms_norm_eps=0.0), "rms_norm_eps must be a positive number, got 0.0"),
        (dict(pad_token_id=97), "pad_token_id must be None or a token id in [0, 97), got 97"),
        (dict(attention_dropout=1.5), "attention_dropout must be a float in [0, 1), got 1.5"),
    ],
)
def test_bad_config_names_field_and_value(fields, message):
    with pytest.raises(ValueError) as error:
        TinyCausalConfig(**{**SMALL, **fields})
    assert message in str(error.value)


def test_explicit_head_dim_does_not_need_divisible_hidden_size():
    model = tiny_ours(hidden_size=30, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (32, 30)
    assert model(torch.randint(0, 97, (1, 5))).logits.shape == (1, 5, 97)


# ------------------------------------------------------------------------------------------------------------
# Input checks
# ------------------------------------------------------------------------------------------------------------


def test_bad_inputs_are_clear_errors():
    model = tiny_ours(max_position_embeddings=16)
    with pytest.raises(ValueError, match=r"input_ids contains token id 97, outside the vocabulary \[0, 97\)"):
        model(torch.tensor([[1, 97]]))
    with pytest.raises(ValueError, match="input_ids contains token id -1"):
        model(torch.tensor([[-1, 3]]))
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        model(torch.tensor([[1]]), inputs_embeds=torch.zeros(1, 1, 32))
    with pytest.raises(ValueError, match=r"inputs_embeds must be \[batch, sequence, hidden_size=32\]"):
        model(inputs_embeds=torch.zeros(1, 3, 31))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 4\) but the input needs \(1, 3\)"):
        model(torch.tensor([[1, 2, 3]]), attention_mask=torch.ones(1, 4))
    with pytest.raises(ValueError, match=r"position_ids must be >= 0; got -3"):
        model(torch.tensor([[1, 2]]), position_ids=torch.tensor([[-3, 20]]))
    with pytest.raises(TypeError, match="past_key_values must be a transformers Cache"):
        model(torch.tensor([[1]]), past_key_values=((torch.zeros(1),),))
    with pytest.raises(TypeError, match=r"got \['block_table'\] without cache=: these belong to transformers' continuous"):
        model(torch.tensor([[1]]), block_table=torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="integer token ids"):
        model(torch.tensor([[1.0]]))


def test_cached_decoding_past_max_position_embeddings_equals_the_full_forward():
    """No length cap (rotary positions): 12 cached + 5 new tokens on max_position_embeddings=16 give the logits of
    one forward over all 17. (Parity past the limit against official, every rope type: tests/models/test_rope.py.)"""
    model = tiny_ours(max_position_embeddings=16)
    ids = torch.randint(0, 97, (1, 17), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        full = model(ids).logits
        model(ids[:, :12], past_key_values=cache, use_cache=True)
        step = model(ids[:, 12:], past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(step, full[:, 12:], atol=1e-5, rtol=0)


def test_dynamic_ntk_runs_past_factor_times_the_trained_length():
    model = tiny_ours(max_position_embeddings=16, rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    assert model(torch.randint(0, 97, (1, 40))).logits.shape == (1, 40, 97)


# ------------------------------------------------------------------------------------------------------------
# Outputs against the official model
# ------------------------------------------------------------------------------------------------------------


def ours_like(official):
    ours = AutoModelForCausalLM.from_config(
        TinyCausalConfig(**{k: v for k, v in official.config.to_dict().items() if k in TinyCausalConfig().to_dict() and k not in ("architectures", "model_type", "transformers_version")})
    )
    ours.load_state_dict(official.state_dict())
    return ours.eval()


def test_hidden_states_attentions_and_loss_match_official():
    official = tiny_official("llama")
    official.set_attn_implementation("eager")
    ours = ours_like(official)
    ours.set_attn_implementation("eager")
    batch = left_padded_batch(97, lengths=(10, 7))
    with torch.no_grad():
        expected = official(**batch, output_hidden_states=True, output_attentions=True)
        produced = ours(**batch, output_hidden_states=True, output_attentions=True)
    real = batch["attention_mask"].bool()
    assert len(produced.hidden_states) == len(expected.hidden_states) == 3
    for mine, theirs in zip(produced.hidden_states, expected.hidden_states):
        assert max_diff(mine[real], theirs[real]) <= TOLERANCE
    assert len(produced.attentions) == 2
    for mine, theirs in zip(produced.attentions, expected.attentions):
        rows = real[:, None, :, None].expand_as(mine)
        assert max_diff(mine[rows], theirs[rows]) <= TOLERANCE
    # The loss on a right-padded batch (how one trains): with left padding the first real token's label is
    # predicted from a padding position, whose output is meaningless in both implementations.
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [5, 6, 7, 0, 0, 0]])
    mask = (ids != 0).long()
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        expected_loss = official(ids, attention_mask=mask, labels=labels).loss
        produced_loss = ours(ids, attention_mask=mask, labels=labels).loss
    assert abs(float(produced_loss) - float(expected_loss)) <= TOLERANCE


def test_loss_with_num_items_in_batch_is_a_sum_over_that_count():
    """Trainer passes num_items_in_batch when forward takes **kwargs: the loss must be the token sum divided by
    it, so that accumulating micro-batches equals one big batch."""
    model = tiny_ours()
    batch = left_padded_batch(97, lengths=(10, 7, 3))
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    with torch.no_grad():
        logits = model(**batch).logits
    shifted = labels[:, 1:]
    token_sum = F.cross_entropy(logits[:, :-1].reshape(-1, 97), shifted.reshape(-1), ignore_index=-100, reduction="sum")
    items = int((shifted != -100).sum())
    with torch.no_grad():
        loss = model(**batch, labels=labels, num_items_in_batch=torch.tensor(items)).loss
        mean_loss = model(**batch, labels=labels).loss
    assert float(loss) == pytest.approx(float(token_sum) / items, abs=1e-5)
    assert float(mean_loss) == pytest.approx(float(token_sum) / items, abs=1e-5)

    # two micro-batches, each divided by the whole batch's count, add up to the big-batch gradient
    def grads(loss_fn):
        model.zero_grad()
        loss_fn().backward()
        return model.lm_head.weight.grad.clone()

    def big():
        return model(**batch, labels=labels).loss

    def accumulated():
        total = 0
        for rows in (slice(0, 1), slice(1, 3)):
            part = {k: v[rows] for k, v in batch.items()}
            total = total + model(**part, labels=labels[rows], num_items_in_batch=torch.tensor(items)).loss
        return total

    torch.testing.assert_close(grads(accumulated), grads(big), rtol=1e-5, atol=1e-7)
    assert not torch.allclose(grads(lambda: model(**batch, labels=labels).loss * 2), grads(big))


def test_save_and_reload_rebuilds_rotary_buffers_and_ties_weights(tmp_path):
    model = tiny_ours(tie_word_embeddings=True, rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is TinyCausalForCausalLM
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(reloaded.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)
    batch = left_padded_batch(97)
    with torch.no_grad():
        assert max_diff(reloaded(**batch).logits, model(**batch).logits) == 0.0


def test_backend_switch_at_run_time_and_flash_on_cpu():
    model = tiny_ours()
    batch = left_padded_batch(97)
    real = batch["attention_mask"].bool()
    outputs = {}
    for backend in ("eager", "sdpa"):
        model.set_attn_implementation(backend)
        assert model.config._attn_implementation == backend
        with torch.no_grad():
            outputs[backend] = model(**batch).logits[real]
    assert max_diff(outputs["eager"], outputs["sdpa"]) <= TOLERANCE
    # flash_attention_2 on CPU: PyTorch's flash kernel, per sequence for the left-padded rows
    model.set_attn_implementation("flash_attention_2")
    with torch.no_grad():
        assert max_diff(model(**batch).logits[real], outputs["sdpa"]) <= TOLERANCE
    settings = dict(attention_mask=batch["attention_mask"], max_new_tokens=6, do_sample=False, pad_token_id=0)
    flash_tokens = model.generate(batch["input_ids"], **settings)
    model.set_attn_implementation("sdpa")
    assert torch.equal(flash_tokens, model.generate(batch["input_ids"], **settings))


def test_gradient_checkpointing_gives_the_same_gradients():
    batch = left_padded_batch(97)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    grads = []
    for checkpointing in (False, True):
        model = tiny_ours().train()
        if checkpointing:
            enable_activation_checkpointing(model)
            assert model.model.layers[0].gradient_checkpointing
        model(**batch, labels=labels).loss.backward()
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad)
    torch.testing.assert_close(grads[0], grads[1])


def test_sequence_classification_matches_official_llama():
    torch.manual_seed(0)
    official = randomize(LlamaForSequenceClassification(LlamaConfig(**BASE, num_labels=3))).eval()
    fields = {k: v for k, v in official.config.to_dict().items() if k in TinyCausalConfig().to_dict() and k not in ("architectures", "model_type", "transformers_version")}
    ours = TinyCausalForSequenceClassification(TinyCausalConfig(**fields, num_labels=3)).eval()
    ours.load_state_dict(official.state_dict())
    # right padding with the pad token: the last non-pad token is scored
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 0, 0], [11, 12, 0, 0, 0]])
    mask = (ids != 0).long()
    labels = torch.tensor([0, 2, 1])
    with torch.no_grad():
        expected = official(ids, attention_mask=mask, labels=labels)
        produced = ours(ids, attention_mask=mask, labels=labels)
    assert produced.logits.shape == (3, 3)
    assert max_diff(produced.logits, expected.logits) <= TOLERANCE
    assert abs(float(produced.loss) - float(expected.loss)) <= TOLERANCE
    no_pad = TinyCausalForSequenceClassification(TinyCausalConfig(**{**fields, "pad_token_id": None}, num_labels=3))
    with pytest.raises(ValueError, match="needs config.pad_token_id"):
        no_pad(ids)


def test_sequence_classification_from_inputs_embeds_warns_as_official(caplog):
    """From inputs_embeds no pad token can be found: the last position is scored, with official's warning."""
    torch.manual_seed(0)
    official = randomize(LlamaForSequenceClassification(LlamaConfig(**BASE, num_labels=3))).eval()
    fields = {k: v for k, v in official.config.to_dict().items() if k in TinyCausalConfig().to_dict() and k not in ("architectures", "model_type", "transformers_version")}
    ours = TinyCausalForSequenceClassification(TinyCausalConfig(**fields, num_labels=3)).eval()
    ours.load_state_dict(official.state_dict())
    embeds = official.get_input_embeddings()(torch.tensor([[5, 6, 7, 0, 0], [5, 6, 7, 8, 9]]))
    logging.Logger.warning_once.cache_clear()  # transformers' warning_once: once per process, whichever test ran first
    with torch.no_grad():
        expected, official_warnings = transformers_warnings(lambda: official(inputs_embeds=embeds).logits)
        with caplog.at_level("WARNING", logger="hf_tiny"):
            produced = ours(inputs_embeds=embeds).logits
    assert max_diff(produced, expected) <= TOLERANCE
    message = "will not detect padding tokens in `inputs_embeds`"
    assert any(message in text for text in official_warnings)
    assert any(message in record.getMessage() for record in caplog.records)
