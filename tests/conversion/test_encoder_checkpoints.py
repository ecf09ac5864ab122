"""Encoder checkpoints as they are published: BERT with its pretraining heads (MLM + next-sentence), configs
without model_type, legacy pickles and bare state dicts, and RoBERTa.

Each parity test builds an official model with large random weights, saves it with save_pretrained, converts
it with the production converter and compares both on a padded batch at the real tokens; the reference values
come from official transformers only.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForPreTraining

import hf_tiny
from conversion import ConversionError
from conversion.__main__ import main as conversion_main
from conversion import bert as bert_conversion
from conversion import roberta as roberta_conversion
from encoder_checkpoint_models import (
    ALBERT_CLASSES, DISTILBERT_CLASSES, ELECTRA_CLASSES, PAD, ROBERTA_CLASSES, SHAPES, SHARING,
    compared_outputs, max_diff, official_albert, official_bert, official_distilbert, official_electra, official_roberta, padded_batch, save,
)
from tolerances import model_reduction_length, relative_error, rounding_bound


def parity_bound(official, batch) -> float:
    """The fp32 rounding bound on the relative error of the official model's forward (tests/helpers/tolerances.py)."""
    return rounding_bound(torch.float32, model_reduction_length(official.config, batch["attention_mask"].shape[1]))


def assert_parity(official, ours, batch, what: str = "", *, padding_too=False) -> None:
    """Every output both models return within the rounding bound, relative to the official output's largest value."""
    worst = max(relative_error(b, a) for a, b in compared_outputs(official, ours, batch, padding_too))
    bound = parity_bound(official, batch)
    assert worst <= bound, f"{what}: relative error {worst:.3g} > {bound:.3g}"


def assert_round_trip_bit_exact(conversion, official, tmp_path) -> dict:
    """official -> hf_tiny -> official again: the same class, every tensor bit-equal; returns the config.json."""
    architecture = type(official).__name__
    conversion.convert(save(official, tmp_path / "src"), tmp_path / "ours")
    report = conversion.convert_back(tmp_path / "ours", tmp_path / "back")
    assert report["architecture"] == architecture
    reloaded = getattr(transformers, architecture).from_pretrained(tmp_path / "back").eval()
    for name, tensor in official.state_dict().items():
        assert torch.equal(tensor, reloaded.state_dict()[name]), name
    return json.loads((tmp_path / "back" / "config.json").read_text())


# --- BERT pretraining checkpoints ------------------------------------------------------------------------------


@pytest.mark.parametrize("heads, layers, intermediate, hidden", SHAPES)
def test_pretraining_checkpoint_converts_with_both_heads(heads, layers, intermediate, hidden, tmp_path):
    official = official_bert(heads=heads, layers=layers, intermediate=intermediate, hidden=hidden)
    src = save(official, tmp_path / "src")
    report = bert_conversion.convert(src, tmp_path / "dst")
    assert (report["architecture"], report["hf_tiny_class"]) == ("BertForPreTraining", "TinyEncoderForPreTraining")
    ours = AutoModelForPreTraining.from_pretrained(tmp_path / "dst").eval()
    assert isinstance(ours, hf_tiny.TinyEncoderForPreTraining)
    for seed in (1, 2):
        assert_parity(official, ours, padded_batch(seed=seed))
    # Negative control: the next-sentence head's two rows swapped must be rejected by the same comparison.
    with torch.no_grad():
        ours.next_sentence.weight.copy_(ours.next_sentence.weight.flip(0))
    assert max_diff(official, ours, padded_batch()) > 1e-2


def test_pretraining_loss_matches_official(tmp_path):
    official = official_bert()
    bert_conversion.convert(save(official, tmp_path / "src"), tmp_path / "dst")
    ours = AutoModelForPreTraining.from_pretrained(tmp_path / "dst").eval()
    batch = padded_batch()
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    labels[:, ::2] = -100
    next_sentence_label = torch.tensor([0, 1, 1])
    expected = official(**batch, labels=labels, next_sentence_label=next_sentence_label).loss
    got = ours(**batch, labels=labels, next_sentence_label=next_sentence_label).loss
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert ours(**batch, labels=labels).loss is None  # as official: the loss needs both label tensors
    with pytest.raises(ValueError, match="next_sentence_label contains 2, outside \\[0, 2\\)"):
        ours(**batch, labels=labels, next_sentence_label=torch.tensor([0, 2, 1]))


def test_pretraining_checkpoint_round_trip_keeps_the_next_sentence_head_bit_exact(tmp_path):
    official = official_bert()
    src = save(official, tmp_path / "src")
    bert_conversion.convert(src, tmp_path / "ours")
    report = bert_conversion.convert_back(tmp_path / "ours", tmp_path / "back")
    assert report["architecture"] == "BertForPreTraining"
    before, after = load_file(src / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    for key in ("cls.seq_relationship.weight", "cls.seq_relationship.bias", "bert.pooler.dense.weight"):
        assert torch.equal(before[key], after[key]), key
    reloaded = transformers.BertForPreTraining.from_pretrained(tmp_path / "back").eval()
    for name, tensor in official.state_dict().items():
        assert torch.equal(tensor, reloaded.state_dict()[name]), name


def test_original_bert_checkpoint_named_masked_lm_drops_the_next_sentence_head_with_a_note(tmp_path, capsys):
    """The original BERT checkpoints: BertForPreTraining weights, config.json naming BertForMaskedLM."""
    src = save(official_bert(), tmp_path / "src", architectures=["BertForMaskedLM"])
    report = bert_conversion.convert(src, tmp_path / "dst")
    assert report["hf_tiny_class"] == "TinyEncoderForMaskedLM"
    err = capsys.readouterr().err
    assert "Dropped cls.seq_relationship.bias, cls.seq_relationship.weight: BertForMaskedLM has no next sentence" in err
    assert "Dropped bert.pooler.dense.bias, bert.pooler.dense.weight: BertForMaskedLM has no pooler" in err
    assert "cls.seq_relationship.bias" in (tmp_path / "dst" / "README.md").read_text()
    official = transformers.BertForMaskedLM.from_pretrained(src).eval()  # official loading drops the same tensors
    ours = AutoModelForMaskedLM.from_pretrained(tmp_path / "dst").eval()
    assert_parity(official, ours, padded_batch())


def test_pretraining_checkpoint_as_base_model_strips_the_prefix(tmp_path):
    src = save(official_bert(), tmp_path / "src", architectures=["BertModel"])
    report = bert_conversion.convert(src, tmp_path / "dst")
    assert report["hf_tiny_class"] == "TinyEncoderModel"
    official = transformers.BertModel.from_pretrained(src).eval()
    assert_parity(official, AutoModel.from_pretrained(tmp_path / "dst").eval(), padded_batch())


def test_unknown_tensor_beside_the_heads_is_still_an_error(tmp_path):
    src = save(official_bert(), tmp_path / "src", architectures=["BertForMaskedLM"])
    state = load_file(src / "model.safetensors")
    state["cls.extra_head.weight"] = torch.zeros(2, 32)
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"unexpected source tensors .*: cls\.extra_head\.weight"):
        bert_conversion.convert(src, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


# --- old configs, legacy pickles, bare state dicts ----------------------------------------------------------


def _cli(*args):
    """The command line's main() in this process (a subprocess spends ~6 s importing torch and transformers again;
    tests/conversion/test_core.py runs `python -m conversion` itself): its exit code and what it printed."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        returncode = conversion_main([str(arg) for arg in args])
    return subprocess.CompletedProcess(["python", "-m", "conversion", *map(str, args)], returncode, out.getvalue(),
                                       err.getvalue())


@pytest.mark.slow
def test_config_without_model_type_converts_by_name_and_by_tensor_names(tmp_path):
    official = official_bert("BertForMaskedLM")
    src = save(official, tmp_path / "src", model_type=None)
    assert "model_type" not in json.loads((src / "config.json").read_text())
    named = _cli("bert", src, tmp_path / "named")
    assert named.returncode == 0, named.stderr
    assert "config.json has no model_type" in named.stderr
    detected = _cli(src, tmp_path / "detected")
    assert detected.returncode == 0, detected.stderr
    assert "detected family bert (config.json has no model_type; the checkpoint holds bert.embeddings" in detected.stderr
    for folder in ("named", "detected"):
        ours = AutoModelForMaskedLM.from_pretrained(tmp_path / folder).eval()
        assert_parity(official, ours, padded_batch())
    assert "old transformers version" in (tmp_path / "named" / "README.md").read_text()


def test_config_without_model_type_is_still_refused_by_another_family(tmp_path):
    src = save(official_bert("BertForMaskedLM"), tmp_path / "src", model_type=None)
    with pytest.raises(ConversionError, match="model_type=None"):
        from conversion import llama as llama_conversion

        llama_conversion.convert(src, tmp_path / "dst")


def test_bare_state_dict_without_model_type_asks_for_the_family(tmp_path):
    from conversion.registry import detect_family

    official = official_bert("BertModel")
    src = save(official, tmp_path / "src", model_type=None)
    with pytest.raises(ConversionError, match="name the family: python -m conversion FAMILY SRC DST"):
        detect_family(src)


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_pytorch_model_bin_in_both_serializations(zipped, tmp_path):
    official = official_bert("BertForMaskedLM")
    src = save(official, tmp_path / "src")
    state = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    torch.save(state, src / "pytorch_model.bin", _use_new_zipfile_serialization=zipped)
    with open(src / "pytorch_model.bin", "rb") as handle:
        assert (handle.read(2) == b"PK") == zipped  # the legacy format is not a zip archive
    bert_conversion.convert(src, tmp_path / "dst")
    ours = AutoModelForMaskedLM.from_pretrained(tmp_path / "dst").eval()
    assert_parity(official, ours, padded_batch())


def test_bare_encoder_state_dict_named_as_a_head_converts_as_the_base_model(tmp_path, capsys):
    official = official_bert("BertModel")
    src = save(official, tmp_path / "src", architectures=["BertForMaskedLM"])
    assert not any(key.startswith("bert.") for key in load_file(src / "model.safetensors"))
    report = bert_conversion.convert(src, tmp_path / "dst")
    assert report["hf_tiny_class"] == "TinyEncoderModel"
    assert "bare BertModel state dict" in capsys.readouterr().err
    assert_parity(official, AutoModel.from_pretrained(tmp_path / "dst").eval(), padded_batch())


# --- RoBERTa ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("heads, layers, intermediate, hidden", SHAPES)
@pytest.mark.parametrize("architecture", ROBERTA_CLASSES)
def test_roberta_parity(architecture, heads, layers, intermediate, hidden, tmp_path):
    official = official_roberta(architecture, heads=heads, layers=layers, intermediate=intermediate, hidden=hidden)
    report = roberta_conversion.convert(save(official, tmp_path / "src"), tmp_path / "dst")
    assert report["architecture"] == architecture
    auto = getattr(transformers, "AutoModel" + architecture.removeprefix("Roberta").replace("Model", ""))
    for backend in ("eager", "sdpa"):
        ours = auto.from_pretrained(tmp_path / "dst", attn_implementation=backend).eval()
        assert ours.config.positions_from_padding
        assert_parity(official, ours, padded_batch(token_types=False), backend, padding_too=True)
        # inputs_embeds: positions count every token as real, as official does
        batch = padded_batch(token_types=False)
        embeds = {"inputs_embeds": official.get_input_embeddings()(batch["input_ids"]), "attention_mask": batch["attention_mask"]}
        assert_parity(official, ours, embeds, backend)


def test_roberta_negative_control_other_positions_at_padding_are_rejected(tmp_path, monkeypatch):
    """The comparison at padded positions sees their position ids: padding counted as real tokens (positions
    continuing past the sequence) changes only the outputs at padding, and the same comparison rejects it."""
    official = official_roberta("RobertaForTokenClassification")
    roberta_conversion.convert(save(official, tmp_path / "src"), tmp_path / "dst")
    ours = transformers.AutoModelForTokenClassification.from_pretrained(tmp_path / "dst").eval()
    batch = padded_batch(token_types=False)
    base = type(ours.model)
    right = base.default_position_ids

    def padding_counted(self, input_ids, seq_len, device):
        return torch.cumsum(torch.ones_like(input_ids), dim=1) + self.config.pad_token_id

    monkeypatch.setattr(base, "default_position_ids", padding_counted)
    assert_parity(official, ours, batch)  # real tokens: the same positions either way
    assert max_diff(official, ours, batch, padding_too=True) > 1e-2
    monkeypatch.setattr(base, "default_position_ids", right)
    assert_parity(official, ours, batch, padding_too=True)


def test_roberta_negative_control_bert_positions_are_rejected(tmp_path):
    official = official_roberta("RobertaModel")
    roberta_conversion.convert(save(official, tmp_path / "src"), tmp_path / "dst")
    config = hf_tiny.TinyEncoderConfig.from_pretrained(tmp_path / "dst")
    config.positions_from_padding = False
    wrong = AutoModel.from_pretrained(tmp_path / "dst", config=config).eval()
    assert max_diff(official, wrong, padded_batch(token_types=False)) > 1e-2


def test_roberta_classification_head_dropout_placement_matches_official_in_training(tmp_path):
    """Only the head's dropouts active (encoder dropouts 0): the same seed must give the same logits, which
    holds only if the dropout before the dense layer sits where RoBERTa's classification head has it."""
    official = official_roberta(
        "RobertaForSequenceClassification", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.4
    )
    roberta_conversion.convert(save(official, tmp_path / "src"), tmp_path / "dst")
    ours = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "dst", attn_implementation="eager")
    official.train(), ours.train()
    batch = padded_batch(token_types=False)
    torch.manual_seed(5)
    expected = official(**batch).logits
    torch.manual_seed(5)
    got = ours(**batch).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    ours.config.dropout_before_pooler = False  # negative control: one dropout fewer
    torch.manual_seed(5)
    assert (ours(**batch).logits - expected).abs().max() > 1e-2


@pytest.mark.parametrize("architecture", ROBERTA_CLASSES)
def test_roberta_round_trip_is_bit_exact(architecture, tmp_path):
    back = assert_round_trip_bit_exact(roberta_conversion, official_roberta(architecture), tmp_path)
    assert (back["model_type"], back["pad_token_id"], back["type_vocab_size"]) == ("roberta", PAD, 1)


@pytest.mark.slow
def test_roberta_is_detected_both_ways(tmp_path):
    src = save(official_roberta("RobertaForMaskedLM"), tmp_path / "src")
    forward = _cli(src, tmp_path / "ours")
    assert forward.returncode == 0, forward.stderr
    assert "detected family roberta" in forward.stderr
    back = _cli(tmp_path / "ours", tmp_path / "back", "--reverse")
    assert back.returncode == 0, back.stderr
    assert "detected family roberta (model_type 'hf_tiny_encoder' with positions_from_padding=True, dropout_before_pooler=True)" in back.stderr


def test_bert_reverse_refuses_a_roberta_style_encoder(tmp_path):
    roberta_conversion.convert(save(official_roberta("RobertaModel"), tmp_path / "src"), tmp_path / "ours")
    with pytest.raises(ConversionError, match="not a bert model: positions_from_padding=True"):
        bert_conversion.convert_back(tmp_path / "ours", tmp_path / "back")


def test_roberta_head_checkpoint_without_architectures_is_read_by_its_head_tensors(tmp_path):
    """RoBERTa has no pretraining class: a config.json without `architectures` is matched against the classes the
    variant has (it once asked for RobertaForPreTraining and failed with a KeyError)."""
    official = official_roberta("RobertaForMaskedLM")
    result = roberta_conversion.convert(save(official, tmp_path / "src", architectures=None), tmp_path / "ours")
    assert result["architecture"] == "RobertaForMaskedLM"
    assert_parity(official, AutoModelForMaskedLM.from_pretrained(tmp_path / "ours").eval(), padded_batch(token_types=False))


@pytest.mark.parametrize("family, message", [
    ("distilbert", "not a distilbert model: .*seq_classif_dropout"),
    ("albert", "not an albert model: .*classifier_dropout_prob"),
    ("modernbert", "not a modernbert model: its config has no rope_parameters"),
])
def test_reverse_with_another_encoder_family_names_the_family(family, message, tmp_path):
    """A BERT-style hf_tiny folder converted back by another encoder family: a ConversionError naming the family
    and the field, not the official config class's own exception."""
    import importlib

    no_dropout = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}  # ModernBERT refuses dropout first
    bert_conversion.convert(save(official_bert("BertModel", **no_dropout), tmp_path / "src"), tmp_path / "ours")
    with pytest.raises(ConversionError, match=message):
        importlib.import_module(f"conversion.{family}").convert_back(tmp_path / "ours", tmp_path / "back")
    assert not (tmp_path / "back").exists()


def test_roberta_position_table_without_room_for_the_offset_fails_at_config_construction():
    with pytest.raises(ValueError, match=r"pad_token_id \+ 1 = 2, so max_position_embeddings=2 leaves no room"):
        hf_tiny.TinyEncoderConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=8, max_position_embeddings=2, pad_token_id=1, positions_from_padding=True)
    config = hf_tiny.TinyEncoderConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=8, max_position_embeddings=6, pad_token_id=1,
                                       positions_from_padding=True)
    model = hf_tiny.TinyEncoderModel(config)
    model(torch.ones(1, 4, dtype=torch.long) * 3)  # 4 = 6 - (1 + 1) tokens fit
    with pytest.raises(ValueError, match="input sequence length"):
        model(torch.ones(1, 5, dtype=torch.long) * 3)


# --- DistilBERT ------------------------------------------------------------------------------------------------

from conversion import distilbert as distilbert_conversion  # noqa: E402


def _auto_for(architecture: str, prefix: str):
    return getattr(transformers, "AutoModel" + architecture.removeprefix(prefix).replace("Model", ""))


@pytest.mark.parametrize("heads, layers, intermediate, hidden", SHAPES)
@pytest.mark.parametrize("architecture", DISTILBERT_CLASSES)
def test_distilbert_parity(architecture, heads, layers, intermediate, hidden, tmp_path):
    official = official_distilbert(architecture, heads=heads, layers=layers, intermediate=intermediate, hidden=hidden)
    report = distilbert_conversion.convert(save(official, tmp_path / "src"), tmp_path / "dst")
    assert report["architecture"] == architecture
    for backend in ("eager", "sdpa"):
        ours = _auto_for(architecture, "DistilBert").from_pretrained(tmp_path / "dst", attn_implementation=backend).eval()
        base = ours.model if hasattr(ours, "model") else ours
        assert ours.config.type_vocab_size == 0 and base.embed_token_types is None
        assert_parity(official, ours, padded_batch(token_types=False), backend)


def test_distilbert_sinusoidal_positions_convert_and_init_like_official(tmp_path):
    official = official_distilbert("DistilBertForMaskedLM", sinusoidal_pos_embds=True)
    distilbert_conversion.convert(save(official, tmp_path / "src"), tmp_path / "dst")
    ours = AutoModelForMaskedLM.from_pretrained(tmp_path / "dst").eval()
    assert ours.config.sinusoidal_positions
    # trainable, as official leaves it after loading
    reloaded_official = transformers.DistilBertForMaskedLM.from_pretrained(tmp_path / "src")
    assert ours.model.embed_positions.weight.requires_grad == (
        reloaded_official.distilbert.embeddings.position_embeddings.weight.requires_grad)
    assert_parity(official, ours, padded_batch(token_types=False))
    # A model built from the config writes the same fixed table official DistilBERT writes.
    expected = torch.empty(40, 32)
    transformers.models.distilbert.modeling_distilbert.create_sinusoidal_embeddings(40, 32, expected)
    fresh = hf_tiny.TinyEncoderForMaskedLM(ours.config)
    torch.testing.assert_close(fresh.model.embed_positions.weight, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("architecture", ["DistilBertForSequenceClassification", "DistilBertForQuestionAnswering"])
def test_distilbert_head_dropouts_match_official_in_training(architecture, tmp_path):
    """Encoder dropouts 0, head dropouts on: the same seed must give the same outputs (seq_classif_dropout after
    the ReLU pre-classifier; qa_dropout before the QA outputs)."""
    official = official_distilbert(architecture, dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.4, qa_dropout=0.4)
    distilbert_conversion.convert(save(official, tmp_path / "src"), tmp_path / "dst")
    ours = _auto_for(architecture, "DistilBert").from_pretrained(tmp_path / "dst", attn_implementation="eager")
    official.train(), ours.train()
    batch = padded_batch(token_types=False)
    torch.manual_seed(3)
    expected = official(**batch)
    torch.manual_seed(3)
    got = ours(**batch)
    field = "logits" if architecture.endswith("Classification") else "start_logits"
    torch.testing.assert_close(getattr(got, field), getattr(expected, field), rtol=1e-5, atol=1e-5)


def test_distilbert_negative_control_tanh_pooler_is_rejected(tmp_path):
    official = official_distilbert("DistilBertForSequenceClassification")
    distilbert_conversion.convert(save(official, tmp_path / "src"), tmp_path / "dst")
    config = hf_tiny.TinyEncoderConfig.from_pretrained(tmp_path / "dst")
    config.pooler_act = "tanh"
    wrong = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "dst", config=config).eval()
    assert max_diff(official, wrong, padded_batch(token_types=False)) > 1e-2


@pytest.mark.parametrize("architecture", DISTILBERT_CLASSES)
def test_distilbert_round_trip_is_bit_exact(architecture, tmp_path):
    assert_round_trip_bit_exact(distilbert_conversion, official_distilbert(architecture), tmp_path)


def test_distilbert_refuses_token_types_and_bert_reverse_refuses_it(tmp_path):
    distilbert_conversion.convert(save(official_distilbert("DistilBertModel"), tmp_path / "src"), tmp_path / "ours")
    ours = AutoModel.from_pretrained(tmp_path / "ours")
    batch = padded_batch()
    with pytest.raises(ValueError, match=r"token_type_ids were given, but this encoder has no token types \(type_vocab_size=0\)"):
        ours(**batch)
    with pytest.raises(ConversionError, match="not a bert model: .*type_vocab_size|not a bert model: .*add_pooling_layer=False"):
        bert_conversion.convert_back(tmp_path / "ours", tmp_path / "back")


@pytest.mark.slow
def test_distilbert_is_detected_both_ways(tmp_path):
    src = save(official_distilbert("DistilBertForMaskedLM"), tmp_path / "src")
    forward = _cli(src, tmp_path / "ours")
    assert forward.returncode == 0, forward.stderr
    assert "detected family distilbert" in forward.stderr
    back = _cli(tmp_path / "ours", tmp_path / "back", "--reverse")
    assert back.returncode == 0, back.stderr
    assert "detected family distilbert (model_type 'hf_tiny_encoder' with type_vocab_size=0, add_pooling_layer=False, pooler_act='relu')" in back.stderr


# --- ELECTRA ---------------------------------------------------------------------------------------------------

from conversion import electra as electra_conversion  # noqa: E402

ELECTRA_AUTO = {"ElectraForPreTraining": AutoModelForPreTraining}


@pytest.mark.parametrize("embedding", [16, 32], ids=["factorized", "same-width"])
@pytest.mark.parametrize("heads, layers, intermediate, hidden", SHAPES[1:])
@pytest.mark.parametrize("architecture", ELECTRA_CLASSES)
def test_electra_parity(architecture, heads, layers, intermediate, hidden, embedding, tmp_path):
    official = official_electra(architecture, heads=heads, layers=layers, intermediate=intermediate, hidden=hidden,
                                embedding=embedding)
    report = electra_conversion.convert(save(official, tmp_path / "src"), tmp_path / "dst")
    assert report["architecture"] == architecture
    auto = ELECTRA_AUTO.get(architecture) or _auto_for(architecture, "Electra")
    for backend in ("eager", "sdpa"):
        ours = auto.from_pretrained(tmp_path / "dst", attn_implementation=backend).eval()
        base = ours.model if hasattr(ours, "model") else ours
        assert (base.embed_projection is not None) == (embedding != hidden)
        assert_parity(official, ours, padded_batch(), backend)


@pytest.mark.parametrize("family", ["electra", "albert"])
def test_factorized_embeddings_take_inputs_embeds_of_the_embedding_width(family, tmp_path):
    """ELECTRA (embedding_size != hidden_size) and ALBERT: inputs_embeds are what get_input_embeddings() gives,
    embedding_size wide (projected to hidden_size after the embeddings' norm), as official takes them. Before, the
    check asked for hidden_size and refused them."""
    official = official_electra("ElectraModel") if family == "electra" else official_albert("AlbertModel")
    conversion = electra_conversion if family == "electra" else albert_conversion
    conversion.convert(save(official, tmp_path / "src"), tmp_path / "dst")
    ours = AutoModel.from_pretrained(tmp_path / "dst").eval()
    batch = padded_batch()
    ids = batch.pop("input_ids")
    with torch.no_grad():
        expected = official(inputs_embeds=official.get_input_embeddings()(ids), **batch).last_hidden_state
        embeds = ours.get_input_embeddings()(ids)
        assert embeds.shape[-1] == ours.config.embedding_size == 16 != ours.config.hidden_size
        got = ours(inputs_embeds=embeds, **batch).last_hidden_state
        real = batch["attention_mask"].bool()
        assert relative_error(got[real], expected[real]) <= parity_bound(official, padded_batch())
        # negative control: other tokens' embeddings
        other = ours(inputs_embeds=ours.get_input_embeddings()(ids.flip(-1)), **batch).last_hidden_state
        assert relative_error(other[real], expected[real]) > 1e-2
        with pytest.raises(ValueError, match=r"inputs_embeds has shape \(3, \d+, 32\), but inputs_embeds must be "
                                             r"\[batch, sequence, embedding_size=16\]"):
            ours(inputs_embeds=torch.randn(*ids.shape, 32), **batch)


def test_electra_discriminator_loss_matches_official_and_negative_control(tmp_path):
    official = official_electra("ElectraForPreTraining")
    electra_conversion.convert(save(official, tmp_path / "src"), tmp_path / "dst")
    ours = AutoModelForPreTraining.from_pretrained(tmp_path / "dst").eval()
    assert isinstance(ours, hf_tiny.TinyEncoderForReplacedTokenDetection)
    batch = padded_batch()
    labels = torch.randint(0, 2, batch["input_ids"].shape, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(ours(**batch, labels=labels).loss, official(**batch, labels=labels).loss, rtol=1e-6, atol=1e-6)
    without_mask = {"input_ids": batch["input_ids"], "token_type_ids": batch["token_type_ids"]}
    torch.testing.assert_close(ours(**without_mask, labels=labels).loss, official(**without_mask, labels=labels).loss,
                               rtol=1e-6, atol=1e-6)
    with torch.no_grad():  # in bf16 official's loss runs in float32 (its labels .float()); ours did in bf16
        half, official_half = ours.to(torch.bfloat16), official.to(torch.bfloat16)
        expected, got = official_half(**batch, labels=labels), half(**batch, labels=labels)
        assert torch.equal(got.logits, expected.logits) and got.loss.dtype == torch.float32
        assert torch.equal(got.loss, expected.loss)
        ours, official = half.float(), official_half.float()
    with torch.no_grad():  # negative control: the embedding projection's bias dropped
        ours.model.embed_projection.bias.zero_()
    assert max_diff(official, ours, batch) > 1e-2


@pytest.mark.parametrize("architecture", ELECTRA_CLASSES)
def test_electra_round_trip_is_bit_exact(architecture, tmp_path):
    assert_round_trip_bit_exact(electra_conversion, official_electra(architecture), tmp_path)


def test_electra_generator_with_another_activation_is_refused(tmp_path):
    src = save(official_electra("ElectraForMaskedLM", hidden_act="relu"), tmp_path / "src")
    with pytest.raises(ConversionError, match="ElectraForMaskedLM with hidden_act='relu' is not supported"):
        electra_conversion.convert(src, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


@pytest.mark.slow
def test_electra_is_detected_both_ways(tmp_path):
    src = save(official_electra("ElectraForPreTraining"), tmp_path / "src")
    forward = _cli(src, tmp_path / "ours")
    assert forward.returncode == 0, forward.stderr
    assert "detected family electra" in forward.stderr
    back = _cli(tmp_path / "ours", tmp_path / "back", "--reverse")
    assert back.returncode == 0, back.stderr
    assert ("detected family electra (model_type 'hf_tiny_encoder' with add_pooling_layer=False, pooler_act='gelu', "
            "dropout_before_pooler=True)") in back.stderr


def test_tensors_of_another_variant_name_the_class_tried_and_the_first_misfits(tmp_path):
    src = save(official_distilbert("DistilBertForMaskedLM"), tmp_path / "src", model_type="bert",
               architectures=["BertForMaskedLM"])
    with pytest.raises(ConversionError, match=r"do not fit BertModel \(family bert\): missing source tensors: embeddings\.LayerNorm\.bias.*unexpected source tensors .*: distilbert\.embeddings\.LayerNorm\.bias"):
        bert_conversion.convert(src, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


# --- ALBERT ----------------------------------------------------------------------------------------------------

from conversion import albert as albert_conversion  # noqa: E402


def _albert_auto(architecture):
    return AutoModelForPreTraining if architecture == "AlbertForPreTraining" else _auto_for(architecture, "Albert")


@pytest.mark.parametrize("layers, groups, inner", SHARING, ids=lambda v: str(v))
@pytest.mark.parametrize("architecture", ALBERT_CLASSES)
def test_albert_parity(architecture, layers, groups, inner, tmp_path):
    official = official_albert(architecture, layers=layers, groups=groups, inner=inner)
    report = albert_conversion.convert(save(official, tmp_path / "src"), tmp_path / "dst")
    assert report["architecture"] == architecture
    for backend in ("eager", "sdpa"):
        ours = _albert_auto(architecture).from_pretrained(tmp_path / "dst", attn_implementation=backend).eval()
        base = ours.model if hasattr(ours, "model") else ours
        assert len(base.layers) == groups * inner  # the weights are shared, not copied
        assert_parity(official, ours, padded_batch(), backend)
    if architecture == "AlbertModel":  # one hidden state per block run, as official records them
        with torch.no_grad():
            expected = official(**padded_batch(), output_hidden_states=True).hidden_states
            got = ours(**padded_batch(), output_hidden_states=True).hidden_states
        assert len(got) == len(expected) == 1 + layers * inner
        real = padded_batch()["attention_mask"].bool()
        bound = parity_bound(official, padded_batch())
        assert max(relative_error(b[real], a[real]) for a, b in zip(expected, got)) <= bound


def test_albert_sentence_order_loss_and_dropout_match_official(tmp_path):
    official = official_albert("AlbertForPreTraining", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                               classifier_dropout_prob=0.4)
    albert_conversion.convert(save(official, tmp_path / "src"), tmp_path / "dst")
    ours = AutoModelForPreTraining.from_pretrained(tmp_path / "dst", attn_implementation="eager")
    assert ours.config.next_sentence_dropout == 0.4
    batch = padded_batch()
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    order = torch.tensor([1, 0, 1])
    official.train(), ours.train()
    torch.manual_seed(7)
    expected = official(**batch, labels=labels, sentence_order_label=order)
    torch.manual_seed(7)
    got = ours(**batch, labels=labels, next_sentence_label=order)
    torch.testing.assert_close(got.seq_relationship_logits, expected.sop_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-5, atol=1e-5)
    # official ALBERT's names: sentence_order_label in, sop_logits out
    torch.manual_seed(7)
    named = ours(**batch, labels=labels, sentence_order_label=order)
    torch.testing.assert_close(named.sop_logits, expected.sop_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(named.loss, expected.loss, rtol=1e-5, atol=1e-5)
    torch.manual_seed(7)
    swapped = ours(**batch, labels=labels, sentence_order_label=1 - order)  # negative control
    assert abs(float(swapped.loss) - float(expected.loss)) > 1e-3
    with pytest.raises(ValueError, match="pass next_sentence_label or sentence_order_label"):
        ours(**batch, labels=labels, sentence_order_label=order, next_sentence_label=order)


def test_albert_negative_control_unshared_schedule_is_rejected(tmp_path):
    """The same blocks run as if each group held one pass (no sharing of the schedule) must differ."""
    official = official_albert("AlbertModel", layers=4, groups=2)
    albert_conversion.convert(save(official, tmp_path / "src"), tmp_path / "dst")
    config = hf_tiny.TinyEncoderConfig.from_pretrained(tmp_path / "dst")
    config.num_hidden_layers = 2  # each of the 2 blocks once instead of twice
    wrong = AutoModel.from_pretrained(tmp_path / "dst", config=config).eval()
    assert max_diff(official, wrong, padded_batch()) > 1e-2


@pytest.mark.parametrize("architecture", ALBERT_CLASSES)
def test_albert_round_trip_is_bit_exact(architecture, tmp_path):
    official = official_albert(architecture, layers=4, groups=2, inner=2)
    back = assert_round_trip_bit_exact(albert_conversion, official, tmp_path)
    assert (back["num_hidden_groups"], back["inner_group_num"], back["embedding_size"]) == (2, 2, 16)


def test_albert_groups_not_dividing_layers_fail_at_config_construction(tmp_path):
    with pytest.raises(ValueError, match="num_hidden_groups=3 must divide num_hidden_layers=4"):
        hf_tiny.TinyEncoderConfig(vocab_size=10, hidden_size=8, num_hidden_layers=4, num_attention_heads=2,
                                  intermediate_size=8, num_hidden_groups=3)
    src = save(official_albert("AlbertModel"), tmp_path / "src", num_hidden_groups=3)
    with pytest.raises(ConversionError, match="num_hidden_groups=3 must divide num_hidden_layers=4"):
        albert_conversion.convert(src, tmp_path / "dst")


def test_reverse_refuses_what_the_official_config_cannot_hold(tmp_path):
    albert_conversion.convert(save(official_albert("AlbertForPreTraining"), tmp_path / "src"), tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    config["next_sentence_dropout"] = 0.3  # ALBERT reads it from classifier_dropout_prob (0.1 here)
    (tmp_path / "ours" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=r"not an albert model: next_sentence_dropout=0.3"):
        albert_conversion.convert_back(tmp_path / "ours", tmp_path / "back")
    with pytest.raises(ConversionError, match="not a bert model: .*project_embeddings=True"):
        bert_conversion.convert_back(tmp_path / "ours", tmp_path / "back2")


@pytest.mark.slow
def test_albert_is_detected_both_ways(tmp_path):
    src = save(official_albert("AlbertForMaskedLM"), tmp_path / "src")
    forward = _cli(src, tmp_path / "ours")
    assert forward.returncode == 0, forward.stderr
    assert "detected family albert" in forward.stderr
    back = _cli(tmp_path / "ours", tmp_path / "back", "--reverse")
    assert back.returncode == 0, back.stderr
    assert "detected family albert (model_type 'hf_tiny_encoder' with project_embeddings=True)" in back.stderr


# --- the sequence classifier's own pooler (pre_classifier) -------------------------------------------------------

SEQUENCE_CLASSIFIERS = {
    "roberta": lambda: official_roberta("RobertaForSequenceClassification"),
    "electra": lambda: official_electra("ElectraForSequenceClassification"),
    "distilbert": lambda: official_distilbert("DistilBertForSequenceClassification"),
}


def pre_classifier_free_layout(folder, destination):
    """A copy of a converted sequence-classifier folder as converters wrote it before pre_classifier: the dense
    layer as the encoder's pooler (model.pooler.dense), no pre_classifier in config.json."""
    import shutil

    shutil.copytree(folder, destination)
    config = json.loads((destination / "config.json").read_text())
    assert config.pop("pre_classifier") is True
    (destination / "config.json").write_text(json.dumps(config))
    state = load_file(destination / "model.safetensors")
    renamed = {k.replace("pre_classifier.", "model.pooler.", 1) if k.startswith("pre_classifier.") else k: v
               for k, v in state.items()}
    assert renamed != state
    save_file(renamed, destination / "model.safetensors", metadata={"format": "pt"})
    return destination


@pytest.mark.parametrize("family", sorted(SEQUENCE_CLASSIFIERS))
def test_a_sequence_classifier_converted_before_pre_classifier_loads_and_converts_back_bit_for_bit(family, tmp_path):
    import importlib

    from conversion.registry import detect_family

    conversion = importlib.import_module(f"conversion.{family}")
    official = SEQUENCE_CLASSIFIERS[family]().eval()
    conversion.convert(save(official, tmp_path / "src"), tmp_path / "ours")
    assert hf_tiny.TinyEncoderConfig.from_pretrained(tmp_path / "ours").pre_classifier is True
    older = pre_classifier_free_layout(tmp_path / "ours", tmp_path / "older")
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(older).eval()
    assert loaded.pre_classifier is None and loaded.model.pooler is not None
    assert_parity(official, loaded, padded_batch(token_types=family == "electra"), f"{family}, older layout")
    assert detect_family(older, reverse=True)[0] == family  # pre_classifier only names tensors
    conversion.convert_back(older, tmp_path / "back")
    reloaded = type(official).from_pretrained(tmp_path / "back").state_dict()
    assert all(torch.equal(tensor, reloaded[name]) for name, tensor in official.state_dict().items())


def test_a_roberta_classifier_loaded_from_a_base_folder_starts_its_dense_layer_fresh_as_official(tmp_path):
    """Official's classification head is new when loaded from a RobertaModel folder (its pooler is unused); so is
    hf_tiny's pre_classifier: the pooler's trained weights are not read into it."""
    roberta_conversion.convert(save(official_roberta("RobertaModel"), tmp_path / "src"), tmp_path / "ours")
    _, theirs = transformers.RobertaForSequenceClassification.from_pretrained(tmp_path / "src", output_loading_info=True)
    ours, info = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert sorted(theirs["missing_keys"]) == [f"classifier.{m}.{p}" for m in ("dense", "out_proj") for p in ("bias", "weight")]
    assert sorted(info["missing_keys"]) == [f"{m}.{p}" for m in ("classifier", "pre_classifier.dense") for p in ("bias", "weight")]
    assert {k.split(".")[0] for k in theirs["unexpected_keys"]} == {"pooler"}
    assert sorted(info["unexpected_keys"]) == ["pooler.dense.bias", "pooler.dense.weight"]
    pooler = load_file(tmp_path / "ours" / "model.safetensors")["pooler.dense.weight"]
    assert not torch.equal(ours.pre_classifier.dense.weight, pooler)


def test_a_config_saying_return_dict_false_converts_and_loads_as_official(tmp_path):
    """BERT-era configs may say return_dict=false: official returns tuples then; the conversion measures parity on
    output fields all the same, and the converted model returns tuples too. from_pretrained(..., use_cache=False),
    which official BertModel takes, loads it as well."""
    source = save(official_bert("BertModel"), tmp_path / "src", return_dict=False)
    bert_conversion.convert(source, tmp_path / "ours")
    official = AutoModel.from_pretrained(source).eval()
    ours = AutoModel.from_pretrained(tmp_path / "ours", use_cache=False).eval()
    batch = padded_batch()
    with torch.no_grad():
        expected, got = official(**batch), ours(**batch)
    assert isinstance(expected, tuple) and isinstance(got, tuple) and len(got) == len(expected)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
    assert ours.config.use_cache is False
