"""The hf_tiny encoder family on its own: outputs, losses, heads, Auto classes, save/load, backends, bad input.

Parity with official BERT lives in tests/conversion/test_bert.py.
"""

from __future__ import annotations

import json
import logging
import textwrap
import warnings
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)
from transformers.utils import logging as hf_logging

import hf_tiny
from fresh_interpreter import clean_env, run_python
from hf_tiny import (
    TinyEncoderConfig,
    TinyEncoderForMaskedLM,
    TinyEncoderForQuestionAnswering,
    TinyEncoderForSequenceClassification,
    TinyEncoderForTokenClassification,
    TinyEncoderModel,
)
from hf_tiny.transformers_api import enable_activation_checkpointing

VOCAB = 61
HEADS = {
    TinyEncoderModel: AutoModel,
    TinyEncoderForMaskedLM: AutoModelForMaskedLM,
    TinyEncoderForSequenceClassification: AutoModelForSequenceClassification,
    TinyEncoderForTokenClassification: AutoModelForTokenClassification,
    TinyEncoderForQuestionAnswering: AutoModelForQuestionAnswering,
}


def tiny_config(**overrides) -> TinyEncoderConfig:
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=24,
        num_hidden_layers=2,
        num_attention_heads=3,
        intermediate_size=40,
        max_position_embeddings=16,
        type_vocab_size=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        initializer_range=0.3,
    )
    fields.update(overrides)
    return TinyEncoderConfig(**fields)


def build(cls, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = cls(tiny_config(**overrides))
    with torch.no_grad():  # non-trivial norms too, so a swapped or ignored norm would show
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    return model.eval()


def padded_batch(batch: int = 3, seq_len: int = 9, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, VOCAB, (batch, seq_len), generator=generator)
    attention_mask = torch.ones(batch, seq_len, dtype=torch.long)
    attention_mask[1, 6:] = 0
    attention_mask[2, 3:] = 0
    input_ids = input_ids.masked_fill(attention_mask == 0, 0)
    return input_ids, attention_mask


@contextmanager
def no_warnings():
    """Fails if transformers logs a warning or Python warns while the block runs."""
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Collect(level=logging.WARNING)
    library_logger = hf_logging.get_logger("transformers")
    library_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        library_logger.removeHandler(handler)
    messages = [r.getMessage() for r in records] + [str(w.message) for w in caught]
    assert not messages, f"unexpected warnings: {messages}"


# ---------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------


def test_config_builds_without_arguments():
    config = TinyEncoderConfig()
    assert config.model_type == "hf_tiny_encoder"
    assert config.hidden_size % config.num_attention_heads == 0
    assert config.tie_word_embeddings is True


def test_config_hidden_not_divisible_by_heads_names_both_numbers():
    with pytest.raises(ValueError, match=r"hidden_size \(30\).*num_attention_heads \(4\)"):
        TinyEncoderConfig(hidden_size=30, num_attention_heads=4)


@pytest.mark.parametrize(
    "field, value, pattern",
    [
        ("vocab_size", 0, "vocab_size must be a positive integer, got 0"),
        ("num_hidden_layers", -1, "num_hidden_layers must be a positive integer, got -1"),
        ("intermediate_size", 2.5, "intermediate_size must be a positive integer, got 2.5"),
        ("hidden_act", "swishy", "unknown hidden_act 'swishy'"),
        ("hidden_dropout", 1.5, "hidden_dropout must be a float in"),
        ("pad_token_id", VOCAB, f"pad_token_id must be None or a token id in \\[0, {VOCAB}\\), got {VOCAB}"),
        ("layer_norm_eps", 0, "layer_norm_eps must be a positive number, got 0"),
    ],
)
def test_config_rejects_bad_fields(field, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        tiny_config(**{field: value})


# ---------------------------------------------------------------------------------------------------------------
# Outputs and losses
# ---------------------------------------------------------------------------------------------------------------


def test_base_model_outputs_shapes_hidden_states_and_attentions():
    model = build(TinyEncoderModel)
    model.set_attn_implementation("eager")
    input_ids, attention_mask = padded_batch()
    out = model(input_ids, attention_mask=attention_mask, output_hidden_states=True, output_attentions=True)
    assert out.last_hidden_state.shape == (3, 9, 24)
    assert out.pooler_output.shape == (3, 24)
    assert len(out.hidden_states) == 3 and all(h.shape == (3, 9, 24) for h in out.hidden_states)
    assert torch.equal(out.hidden_states[-1], out.last_hidden_state)
    assert len(out.attentions) == 2 and all(a.shape == (3, 3, 9, 9) for a in out.attentions)
    # Attention rows are distributions over the real keys only.
    weights = out.attentions[0]
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 3, 9))
    assert weights[2, :, :, 3:].abs().max() == 0
    # The pooler is tanh(dense(first token)).
    expected_pooled = torch.tanh(model.pooler.dense(out.last_hidden_state[:, 0]))
    torch.testing.assert_close(out.pooler_output, expected_pooled)


def test_padding_does_not_change_real_tokens():
    model = build(TinyEncoderModel)
    input_ids, attention_mask = padded_batch()
    batched = model(input_ids, attention_mask=attention_mask).last_hidden_state
    alone = model(input_ids[2:3, :3]).last_hidden_state
    # fp32 tolerance of DESIGN (1e-5): the masked and the unmasked SDPA kernels round differently (1.07e-6 here)
    torch.testing.assert_close(batched[2:3, :3], alone, atol=1e-5, rtol=0)
    # and the mask matters: without it, the padded row's real tokens see the padding
    unmasked = model(input_ids).last_hidden_state
    assert (unmasked[2, :3] - alone[0]).abs().max() > 1e-3


def test_token_types_positions_and_inputs_embeds():
    model = build(TinyEncoderModel)
    input_ids, attention_mask = padded_batch()
    reference = model(input_ids, attention_mask=attention_mask).last_hidden_state
    explicit = model(
        input_ids,
        attention_mask=attention_mask,
        token_type_ids=torch.zeros_like(input_ids),
        position_ids=torch.arange(9)[None],
    ).last_hidden_state
    assert torch.equal(reference, explicit)
    embeds = model(inputs_embeds=model.embed_tokens(input_ids), attention_mask=attention_mask).last_hidden_state
    assert torch.equal(reference, embeds)
    other_types = model(input_ids, attention_mask=attention_mask, token_type_ids=torch.ones_like(input_ids))
    assert (other_types.last_hidden_state - reference).abs().max() > 1e-3
    shifted = model(input_ids, attention_mask=attention_mask, position_ids=torch.arange(1, 10)[None])
    assert (shifted.last_hidden_state - reference).abs().max() > 1e-3


def test_masked_lm_logits_loss_and_tied_decoder():
    model = build(TinyEncoderForMaskedLM)
    assert model.lm_head.decoder.weight is model.model.embed_tokens.weight
    input_ids, attention_mask = padded_batch()
    labels = torch.full_like(input_ids, -100)
    labels[0, 2], labels[1, 4], labels[2, 1] = 5, 7, 11
    out = model(input_ids, attention_mask=attention_mask, labels=labels)
    assert out.logits.shape == (3, 9, VOCAB)
    picked = out.logits[labels != -100]
    torch.testing.assert_close(out.loss, F.cross_entropy(picked, labels[labels != -100]))
    hidden = model.model(input_ids, attention_mask=attention_mask).last_hidden_state
    head = model.lm_head
    manual = F.linear(head.layer_norm(F.gelu(head.dense(hidden))), model.model.embed_tokens.weight, head.decoder.bias)
    torch.testing.assert_close(out.logits, manual)


def test_masked_lm_untied_decoder_is_separate():
    model = build(TinyEncoderForMaskedLM, tie_word_embeddings=False)
    assert model.lm_head.decoder.weight is not model.model.embed_tokens.weight
    assert not torch.equal(model.lm_head.decoder.weight, model.model.embed_tokens.weight)


@pytest.mark.parametrize(
    "num_labels, labels, problem_type, loss_fn",
    [
        (1, torch.tensor([0.5, -1.0, 2.0]), "regression", lambda logits, y: F.mse_loss(logits.squeeze(), y)),
        (3, torch.tensor([0, 2, 1]), "single_label_classification", F.cross_entropy),
        (
            3,
            torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 1.0]]),
            "multi_label_classification",
            F.binary_cross_entropy_with_logits,
        ),
    ],
)
def test_sequence_classification_problem_types(num_labels, labels, problem_type, loss_fn):
    model = build(TinyEncoderForSequenceClassification, num_labels=num_labels)
    input_ids, attention_mask = padded_batch()
    out = model(input_ids, attention_mask=attention_mask, labels=labels)
    assert out.logits.shape == (3, num_labels)
    assert model.config.problem_type == problem_type
    torch.testing.assert_close(out.loss, loss_fn(out.logits, labels))
    pooled = model.model(input_ids, attention_mask=attention_mask).pooler_output
    torch.testing.assert_close(out.logits, model.classifier(pooled))


@pytest.mark.parametrize("num_labels, labels", [
    (1, torch.tensor([3.7, 1.3, 2.9])),  # regression: not bf16 numbers
    (2, torch.tensor([[0.3, 0.9], [0.1, 0.7], [0.55, 0.2]])),  # multi-label, soft targets
])
def test_bf16_classification_losses_take_float32_labels_as_official_bert(num_labels, labels, tmp_path):
    """Official BERT hands its float labels to MSE / BCE as they are (the loss runs in float32 beside bf16 logits);
    hf_tiny rounded them to the logits' dtype first (a regression loss 0.014 off in a bf16 RoBERTa). Negative
    control: the labels rounded to bf16 give another loss."""
    from bert_models import convert_official, official_model

    problem = "regression" if num_labels == 1 else "multi_label_classification"
    official = official_model("BertForSequenceClassification", num_labels=num_labels, problem_type=problem)
    _, dst, _ = convert_official(official, tmp_path)
    ours = TinyEncoderForSequenceClassification.from_pretrained(dst).eval().to(torch.bfloat16)
    official = official.to(torch.bfloat16)
    input_ids, attention_mask = padded_batch()
    batch = dict(input_ids=input_ids % 97, attention_mask=attention_mask)
    with torch.no_grad():
        expected, got = official(**batch, labels=labels), ours(**batch, labels=labels)
        rounded = official(**batch, labels=labels.to(torch.bfloat16)).loss
    assert torch.equal(got.logits, expected.logits)  # the same bf16 logits: the losses differ by the labels alone
    assert got.loss.dtype == expected.loss.dtype == torch.float32 and torch.equal(got.loss, expected.loss)
    assert not torch.equal(rounded.float(), expected.loss)


def test_sequence_classification_explicit_problem_type_wins():
    model = build(TinyEncoderForSequenceClassification, num_labels=2, problem_type="multi_label_classification")
    input_ids, attention_mask = padded_batch()
    labels = torch.tensor([[1, 0], [0, 1], [1, 1]])  # integer multi-hot labels
    out = model(input_ids, attention_mask=attention_mask, labels=labels)
    torch.testing.assert_close(out.loss, F.binary_cross_entropy_with_logits(out.logits, labels.float()))


def test_token_classification_ignores_minus_100():
    model = build(TinyEncoderForTokenClassification, num_labels=4)
    input_ids, attention_mask = padded_batch()
    labels = torch.randint(0, 4, input_ids.shape).masked_fill(attention_mask == 0, -100)
    out = model(input_ids, attention_mask=attention_mask, labels=labels)
    assert out.logits.shape == (3, 9, 4)
    real = attention_mask.bool()
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits[real], labels[real]))


def test_question_answering_logits_and_loss():
    model = build(TinyEncoderForQuestionAnswering)
    input_ids, attention_mask = padded_batch()
    start, end = torch.tensor([1, 2, 50]), torch.tensor([3, 4, 60])  # the last pair lies outside: ignored
    out = model(input_ids, attention_mask=attention_mask, start_positions=start, end_positions=end)
    assert out.start_logits.shape == out.end_logits.shape == (3, 9)
    expected = (
        F.cross_entropy(out.start_logits[:2], start[:2]) + F.cross_entropy(out.end_logits[:2], end[:2])
    ) / 2
    torch.testing.assert_close(out.loss, expected)


def test_question_answering_needs_two_labels():
    with pytest.raises(ValueError, match="num_labels must be 2, got 3"):
        TinyEncoderForQuestionAnswering(tiny_config(num_labels=3))


@pytest.mark.parametrize("cls", list(HEADS))
def test_tuple_return_matches_model_output(cls):
    model = build(cls)
    model.set_attn_implementation("eager")
    input_ids, attention_mask = padded_batch()
    kwargs = dict(attention_mask=attention_mask, output_hidden_states=True, output_attentions=True)
    as_dict = model(input_ids, **kwargs)
    as_tuple = model(input_ids, return_dict=False, **kwargs)
    assert isinstance(as_tuple, tuple)
    expected = as_dict.to_tuple()
    assert len(as_tuple) == len(expected)
    for got, want in zip(as_tuple, expected):
        if isinstance(want, tuple):
            assert all(torch.equal(g, w) for g, w in zip(got, want))
        else:
            assert torch.equal(got, want)


def test_gradient_checkpointing_gives_the_same_gradients():
    input_ids, attention_mask = padded_batch()
    labels = torch.randint(0, 3, (3,))
    grads = []
    for checkpointing in (False, True):
        model = build(TinyEncoderForSequenceClassification, num_labels=3).train()
        if checkpointing:
            enable_activation_checkpointing(model)
            assert all(layer.gradient_checkpointing for layer in model.model.layers)
        model(input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5, msg=name)


def test_dropout_is_active_in_training_only():
    model = build(TinyEncoderModel, hidden_dropout=0.5, attention_dropout=0.5)
    input_ids, attention_mask = padded_batch()
    assert torch.equal(model(input_ids).last_hidden_state, model(input_ids).last_hidden_state)
    model.train()
    assert not torch.equal(model(input_ids).last_hidden_state, model(input_ids).last_hidden_state)


def test_heads_do_not_take_loss_kwargs_from_trainer():
    """The classification heads average their loss themselves (Trainer divides it under gradient accumulation);
    the masked LM takes num_items_in_batch (test below)."""
    for cls in HEADS:
        assert cls.accepts_loss_kwargs is (cls is TinyEncoderForMaskedLM)


def test_masked_lm_loss_is_transformers_for_masked_lm_loss_with_num_items_in_batch():
    """As ModernBERT's (transformers' ForMaskedLMLoss): float32 logits, and per item of num_items_in_batch, so two
    micro-batches of unequal label counts add up to the whole batch's mean (a mean of their means does not: the
    control). Before, the head averaged each micro-batch, and a bf16 model's loss was computed in bf16."""
    from transformers.loss.loss_utils import ForMaskedLMLoss

    model = build(TinyEncoderForMaskedLM).to(torch.bfloat16)
    input_ids, attention_mask = padded_batch(batch=4)
    labels = input_ids.masked_fill(torch.rand(input_ids.shape, generator=torch.Generator().manual_seed(2)) < 0.5, -100)
    labels[:2, 0] = input_ids[:2, 0]  # the first micro-batch holds more labels than the second
    count = int((labels != -100).sum())
    whole = model(input_ids, attention_mask=attention_mask, labels=labels)
    assert whole.loss.dtype == torch.float32
    assert torch.equal(whole.loss, ForMaskedLMLoss(whole.logits, labels, VOCAB))
    parts = [model(input_ids[rows], attention_mask=attention_mask[rows], labels=labels[rows], num_items_in_batch=count)
             for rows in (slice(0, 2), slice(2, 4))]
    for rows, part in zip((slice(0, 2), slice(2, 4)), parts):
        assert torch.equal(part.loss, ForMaskedLMLoss(part.logits, labels[rows], VOCAB, num_items_in_batch=count))
    torch.testing.assert_close(parts[0].loss + parts[1].loss, whole.loss, rtol=1e-6, atol=0)
    means = [model(input_ids[rows], attention_mask=attention_mask[rows], labels=labels[rows]).loss
             for rows in (slice(0, 2), slice(2, 4))]
    assert abs(float(sum(means) / 2 - whole.loss)) > 1e-3


# ---------------------------------------------------------------------------------------------------------------
# Attention backends
# ---------------------------------------------------------------------------------------------------------------


def test_backends_agree_and_switch_without_warnings():
    model = build(TinyEncoderForMaskedLM)
    input_ids, attention_mask = padded_batch()
    outputs = {}
    with no_warnings():
        for backend in ("eager", "sdpa"):
            model.set_attn_implementation(backend)
            assert model.config._attn_implementation == backend
            outputs[backend] = model(input_ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()
    torch.testing.assert_close(outputs["sdpa"][real], outputs["eager"][real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["flash_attention_2", "flex_attention"])
def test_flash_and_flex_attention_on_cpu_equal_sdpa_on_a_padded_batch(backend, static_flex_compilation):
    """flash_attention_2 runs PyTorch's CPU flash kernel (one sequence at a time for a padded batch);
    flex_attention is transformers' function from its AttentionInterface, fed our mask as an additive bias."""
    model = build(TinyEncoderModel)
    input_ids, attention_mask = padded_batch()
    real = attention_mask.bool()
    outputs = {}
    for name in ("sdpa", backend):
        model.set_attn_implementation(name)
        with torch.no_grad():
            outputs[name] = model(input_ids, attention_mask=attention_mask).last_hidden_state[real]
    torch.testing.assert_close(outputs[backend], outputs["sdpa"], atol=1e-5, rtol=0)


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="'flash_attention_9'.*neither an hf_tiny backend.*registered: .*flex_attention"):
        build(TinyEncoderModel).set_attn_implementation("flash_attention_9")


def test_output_attentions_needs_eager():
    model = build(TinyEncoderModel)
    model.set_attn_implementation("sdpa")
    input_ids, attention_mask = padded_batch()
    with pytest.raises(ValueError, match="output_attentions=True.*attn_implementation='sdpa'.*'eager'"):
        model(input_ids, attention_mask=attention_mask, output_attentions=True)


# ---------------------------------------------------------------------------------------------------------------
# Auto classes, save / load
# ---------------------------------------------------------------------------------------------------------------


def test_auto_classes_are_registered():
    fields = {k: v for k, v in tiny_config().to_diff_dict().items() if k != "model_type"}
    config = AutoConfig.for_model("hf_tiny_encoder", **fields)
    assert isinstance(config, TinyEncoderConfig)
    for cls, auto in HEADS.items():
        assert type(auto.from_config(config)) is cls


@pytest.mark.parametrize("cls", list(HEADS))
def test_save_load_round_trip_is_bit_exact(cls, tmp_path):
    model = build(cls, num_labels=2)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "hf_tiny_encoder"
    assert saved["auto_map"]["AutoConfig"] == "configuration_encoder.TinyEncoderConfig"
    assert saved["auto_map"][HEADS[cls].__name__] == f"modeling_encoder.{cls.__name__}"
    assert (tmp_path / "modeling_encoder.py").is_file() and (tmp_path / "layers.py").is_file()

    with no_warnings():
        loaded, info = HEADS[cls].from_pretrained(tmp_path, attn_implementation="eager", output_loading_info=True)
    assert type(loaded) is cls
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert loaded.config._attn_implementation == "eager"
    original, reloaded = model.state_dict(), loaded.state_dict()
    assert original.keys() == reloaded.keys()
    for key in original:
        assert torch.equal(original[key], reloaded[key]), key
    model.set_attn_implementation("eager")
    input_ids, attention_mask = padded_batch()
    assert torch.equal(model(input_ids, attention_mask=attention_mask)[0], loaded(input_ids, attention_mask=attention_mask)[0])


def test_tied_decoder_is_saved_once_and_tied_after_loading(tmp_path):
    model = build(TinyEncoderForMaskedLM)
    model.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert "lm_head.decoder.weight" not in stored and "model.embed_tokens.weight" in stored
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path)
    assert loaded.lm_head.decoder.weight is loaded.model.embed_tokens.weight


def test_base_model_loads_from_a_head_checkpoint(tmp_path):
    head = build(TinyEncoderForSequenceClassification)
    head.save_pretrained(tmp_path)
    base = AutoModel.from_pretrained(tmp_path)
    assert type(base) is TinyEncoderModel
    for name, tensor in base.state_dict().items():
        assert torch.equal(tensor, head.model.state_dict()[name]), name


@pytest.mark.slow
def test_saved_model_loads_with_remote_code_without_hf_tiny(tmp_path):
    model = build(TinyEncoderForMaskedLM)
    model.save_pretrained(tmp_path / "saved")
    input_ids, attention_mask = padded_batch()
    torch.save({"input_ids": input_ids, "attention_mask": attention_mask}, tmp_path / "inputs.pt")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the child runs one thread (clean_env); same summation order -> bit-equal logits
    try:
        torch.save(model(input_ids, attention_mask=attention_mask).logits, tmp_path / "expected.pt")
    finally:
        torch.set_num_threads(threads)
    # The shared hf_tiny-free interpreter (tests/helpers/fresh_interpreter.py) refuses hf_tiny even where it is
    # pip-installed, as it is after the README's `pip install -e`.
    script = textwrap.dedent(
        f"""
        import torch
        from transformers import AutoModelForMaskedLM
        model = AutoModelForMaskedLM.from_pretrained({str(tmp_path / "saved")!r}, trust_remote_code=True)
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        inputs = torch.load({str(tmp_path / "inputs.pt")!r}, weights_only=True)
        logits = model(**inputs).logits
        assert torch.equal(logits, torch.load({str(tmp_path / "expected.pt")!r}, weights_only=True))
        print("ok")
        """
    )
    result = run_python(script, cwd=tmp_path, env=clean_env({"HF_HOME": str(tmp_path / "hf_home")}), isolated=True)
    assert "ok" in result.stdout


# ---------------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make_kwargs, error, pattern",
    [
        (lambda ids, mask: dict(input_ids=ids.masked_fill(ids == ids[0, 0], VOCAB)), ValueError,
         f"input_ids contains token id {VOCAB}, outside the vocabulary \\[0, {VOCAB}\\)"),
        (lambda ids, mask: dict(input_ids=ids - 100), ValueError, "input_ids contains token id -"),
        (lambda ids, mask: dict(input_ids=ids.float()), TypeError, "input_ids must hold integer token ids, got dtype torch.float32"),
        (lambda ids, mask: dict(input_ids=ids, attention_mask=mask[:, :-1]), ValueError,
         r"attention_mask has shape \(3, 8\) but the input needs \(3, 9\)"),
        (lambda ids, mask: dict(input_ids=torch.ones(1, 17, dtype=torch.long)), ValueError,
         "input sequence length 17 exceeds max_position_embeddings=16"),
        (lambda ids, mask: dict(input_ids=ids, token_type_ids=torch.full_like(ids, 2)), ValueError,
         r"token_type_ids contains 2, outside \[0, type_vocab_size=2\)"),
        (lambda ids, mask: dict(input_ids=ids, position_ids=torch.arange(9)[None] + 10), ValueError,
         r"position_ids contains 18, outside \[0, max_position_embeddings=16\)"),
        (lambda ids, mask: dict(input_ids=ids, token_type_ids=ids[:, :4]), ValueError,
         r"token_type_ids has shape \(3, 4\)"),
        (lambda ids, mask: dict(), ValueError, "exactly one of input_ids or inputs_embeds"),
        (lambda ids, mask: dict(input_ids=ids, inputs_embeds=torch.zeros(3, 9, 24)), ValueError,
         "exactly one of input_ids or inputs_embeds"),
        (lambda ids, mask: dict(inputs_embeds=torch.zeros(3, 9, 20)), ValueError,
         r"inputs_embeds has shape \(3, 9, 20\).*hidden_size=24"),
    ],
)
def test_bad_inputs_raise_clear_errors(make_kwargs, error, pattern):
    model = build(TinyEncoderModel)
    input_ids, attention_mask = padded_batch()
    with pytest.raises(error, match=pattern):
        model(**make_kwargs(input_ids, attention_mask))


def test_hf_tiny_exports_the_encoder_family():
    for name in ("TinyEncoderConfig", "TinyEncoderModel", "TinyEncoderForMaskedLM", "TinyEncoderPreTrainedModel"):
        assert hasattr(hf_tiny, name)
