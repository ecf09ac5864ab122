"""PEFT's task_type="SEQ_CLS" on converted RoBERTa, ELECTRA and DistilBERT classifiers trains what it trains on
official's: PEFT keeps modules whose name ends in "classifier" trainable and saved, and those three hold the dense
layer before the classifier in their head (`classifier.dense`, DistilBERT's `pre_classifier`). hf_tiny names it
`pre_classifier` (config.pre_classifier, set by the converters), so the same adapter training gives the same model.
Official's models are the reference; dropouts are 0, so one seed gives both sides the same LoRA initialisation."""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model

from encoder_checkpoint_models import official_distilbert, official_electra, official_roberta, padded_batch, save

pytestmark = pytest.mark.usefixtures("single_torch_thread")

NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
# family -> (official sequence classifier, its LoRA targets: the attention's query and value projections)
FAMILIES = {
    "roberta": (lambda: official_roberta("RobertaForSequenceClassification", **NO_DROPOUT), ["query", "value"]),
    "electra": (lambda: official_electra("ElectraForSequenceClassification", **NO_DROPOUT), ["query", "value"]),
    "distilbert": (lambda: official_distilbert("DistilBertForSequenceClassification", dropout=0.0,
                                               attention_dropout=0.0, seq_classif_dropout=0.0), ["q_lin", "v_lin"]),
}
OUR_TARGETS = ["q_proj", "v_proj"]
STEPS = 3


def adapted(model, targets):
    torch.manual_seed(0)  # LoRA's A matrices: the same draws on both sides (same order, same shapes)
    return get_peft_model(model, LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=targets,
                                            task_type="SEQ_CLS"))


def trainable(peft_model) -> dict[str, int]:
    """Parameter count of each module PEFT trains besides the LoRA matrices, and of the LoRA matrices."""
    counts: dict[str, int] = {}
    for name, param in peft_model.named_parameters():
        if param.requires_grad:
            key = "lora" if ".lora_" in name else name.split(".modules_to_save.")[0].rsplit(".", 1)[-1]
            counts[key] = counts.get(key, 0) + param.numel()
    return counts


def trained_logits(peft_model, batch) -> torch.Tensor:
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=3e-2)
    peft_model.train()
    for _ in range(STEPS):
        peft_model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        return peft_model.eval()(**{k: v for k, v in batch.items() if k != "labels"}).logits


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    """(family, official classifier, its hf_tiny conversion's folder)."""
    family = request.param
    make, targets = FAMILIES[family]
    official = make()
    folder = tmp_path_factory.mktemp(family)
    importlib.import_module(f"conversion.{family}").convert(save(official, folder / "src"), folder / "ours")
    return family, official, folder / "ours"


def load_ours(folder):
    return transformers.AutoModelForSequenceClassification.from_pretrained(folder, attn_implementation="eager")


def test_seq_cls_adapter_trains_and_saves_what_it_does_on_official(pair, tmp_path):
    family, official, folder = pair
    batch = padded_batch(token_types=False)
    batch["labels"] = torch.arange(batch["input_ids"].shape[0]) % 3
    theirs = adapted(official, FAMILIES[family][1])
    ours = adapted(load_ours(folder), OUR_TARGETS)
    assert sum(trainable(ours).values()) == sum(trainable(theirs).values())
    assert "pre_classifier" in trainable(ours) and trainable(ours)["lora"] == trainable(theirs)["lora"]
    expected = trained_logits(theirs, batch)
    torch.testing.assert_close(trained_logits(ours, batch), expected, rtol=1e-4, atol=1e-4)
    ours.save_pretrained(tmp_path / "adapter")
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert any(name.startswith("base_model.model.pre_classifier.") for name in saved), sorted(saved)


def test_negative_control_a_frozen_pre_classifier_trains_another_model(pair):
    """What PEFT made of hf_tiny's layout before pre_classifier (the dense layer inside the encoder, out of
    modules_to_save): freezing it gives other logits after the same training."""
    family, official, folder = pair
    batch = padded_batch(token_types=False)
    batch["labels"] = torch.arange(batch["input_ids"].shape[0]) % 3
    expected = trained_logits(adapted(official, FAMILIES[family][1]), batch)
    ours = adapted(load_ours(folder), OUR_TARGETS)
    for name, param in ours.named_parameters():
        if ".pre_classifier." in name:
            param.requires_grad_(False)
    assert (trained_logits(ours, batch) - expected).abs().max() > 1e-3
