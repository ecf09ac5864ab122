"""Tiny official encoder checkpoints as they are published (BERT with pretraining heads, ALBERT, DistilBERT, ELECTRA,
RoBERTa)."""

from __future__ import annotations

import json
from pathlib import Path
import torch
import transformers
from transformers import BertConfig, RobertaConfig
from transformers import DistilBertConfig
from transformers import ElectraConfig
from transformers import AlbertConfig


VOCAB = 97


PAD = 1  # RoBERTa's pad id; its positions start at PAD + 1


SHAPES = [(2, 1, 37, 32), (4, 2, 64, 32), (8, 3, 48, 64)]  # (heads, layers, intermediate, hidden)


ROBERTA_CLASSES = [
    "RobertaModel", "RobertaForMaskedLM", "RobertaForSequenceClassification", "RobertaForTokenClassification",
    "RobertaForQuestionAnswering",
]


def _randomize(model):
    """Every bias and norm moved off its init, so a mis-mapped tensor changes the outputs."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(0.2 * torch.randn_like(param))
            elif "LayerNorm" in name or "layer_norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    return model.eval()


def official_bert(architecture="BertForPreTraining", *, heads=4, layers=2, intermediate=64, hidden=32, seed=0, **fields):
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=intermediate, max_position_embeddings=40, type_vocab_size=2, initializer_range=0.25, **fields,
    )
    torch.manual_seed(seed)
    return _randomize(getattr(transformers, architecture)(config))


def official_roberta(architecture, *, heads=4, layers=2, intermediate=64, hidden=32, seed=0, **fields):
    fields = {"num_labels": 2 if architecture.endswith("QuestionAnswering") else 3, **fields}
    config = RobertaConfig(
        vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=intermediate, max_position_embeddings=40, type_vocab_size=1, initializer_range=0.25,
        pad_token_id=PAD, bos_token_id=0, eos_token_id=2, **fields,
    )
    torch.manual_seed(seed)
    return _randomize(getattr(transformers, architecture)(config))


def padded_batch(seq_len=12, seed=1, token_types=True):
    """Right-padded rows of lengths seq_len, seq_len - 4, 3; padding holds PAD (RoBERTa's positions read it)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (3, seq_len), generator=generator)
    attention_mask = torch.zeros(3, seq_len, dtype=torch.long)
    for row, length in enumerate([seq_len, seq_len - 4, 3]):
        attention_mask[row, :length] = 1
    batch = {"input_ids": input_ids.masked_fill(attention_mask == 0, PAD), "attention_mask": attention_mask}
    if token_types:
        batch["token_type_ids"] = (torch.arange(seq_len) >= seq_len // 2).long().expand(3, -1).contiguous()
    return batch


COMPARED = ("last_hidden_state", "pooler_output", "logits", "start_logits", "end_logits", "prediction_logits",
            "seq_relationship_logits", "sop_logits")


OUR_NAME = {"sop_logits": "seq_relationship_logits"}  # ALBERT's sentence-order logits


def compared_outputs(official, ours, batch, padding_too):
    """(official, ours) for every output both models return, per-token outputs at real tokens only (padding_too:
    at every position, padding included: RoBERTa's position ids depend on the padding, and official computes them
    there too)."""
    with torch.no_grad():
        expected, got = official(**batch), ours(**batch)
    real = torch.ones_like(batch["attention_mask"], dtype=torch.bool) if padding_too else batch["attention_mask"].bool()
    pairs = []
    for field in COMPARED:
        a, b = getattr(expected, field, None), getattr(got, OUR_NAME.get(field, field), None)
        if a is None:
            continue
        assert b is not None, f"ours has no {field}"
        if a.dim() >= 2 and tuple(a.shape[:2]) == tuple(real.shape):
            a, b = a[real], b[real]
        pairs.append((a, b))
    assert pairs, "no output compared"
    return pairs


def max_diff(official, ours, batch, *, padding_too=False) -> float:
    """max |Δ| over every output both models return (see compared_outputs)."""
    return max((a - b).abs().max().item() for a, b in compared_outputs(official, ours, batch, padding_too))


def save(model, folder: Path, **config_changes) -> Path:
    model.save_pretrained(folder)
    if config_changes:
        config = json.loads((folder / "config.json").read_text())
        for key, value in config_changes.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        (folder / "config.json").write_text(json.dumps(config))
    return folder


DISTILBERT_CLASSES = [
    "DistilBertModel", "DistilBertForMaskedLM", "DistilBertForSequenceClassification",
    "DistilBertForTokenClassification", "DistilBertForQuestionAnswering",
]


def official_distilbert(architecture, *, heads=4, layers=2, intermediate=64, hidden=32, seed=0, **fields):
    fields = {"num_labels": 2 if architecture.endswith("QuestionAnswering") else 3, **fields}
    config = DistilBertConfig(
        vocab_size=VOCAB, dim=hidden, n_layers=layers, n_heads=heads, hidden_dim=intermediate,
        max_position_embeddings=40, initializer_range=0.25, pad_token_id=0, **fields,
    )
    torch.manual_seed(seed)
    return _randomize(getattr(transformers, architecture)(config))


ELECTRA_CLASSES = [
    "ElectraModel", "ElectraForPreTraining", "ElectraForMaskedLM", "ElectraForSequenceClassification",
    "ElectraForTokenClassification", "ElectraForQuestionAnswering",
]


def official_electra(architecture, *, heads=4, layers=2, intermediate=64, hidden=32, embedding=16, seed=0, **fields):
    fields = {"num_labels": 2 if architecture.endswith("QuestionAnswering") else 3, **fields}
    config = ElectraConfig(
        vocab_size=VOCAB, embedding_size=embedding, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, intermediate_size=intermediate, max_position_embeddings=40, type_vocab_size=2,
        initializer_range=0.25, pad_token_id=0, **fields,
    )
    torch.manual_seed(seed)
    return _randomize(getattr(transformers, architecture)(config))


ALBERT_CLASSES = [
    "AlbertModel", "AlbertForPreTraining", "AlbertForMaskedLM", "AlbertForSequenceClassification",
    "AlbertForTokenClassification", "AlbertForQuestionAnswering",
]


# (layers, groups, inner): all layers shared, two groups, no sharing, two blocks per group
SHARING = [(4, 1, 1), (4, 2, 1), (3, 3, 1), (4, 2, 2)]


def official_albert(architecture, *, layers=4, groups=1, inner=1, heads=4, hidden=32, embedding=16, seed=0, **fields):
    fields = {"num_labels": 2 if architecture.endswith(("QuestionAnswering", "PreTraining")) else 3, **fields}
    config = AlbertConfig(
        vocab_size=VOCAB, embedding_size=embedding, hidden_size=hidden, num_hidden_layers=layers,
        num_hidden_groups=groups, inner_group_num=inner, num_attention_heads=heads, intermediate_size=48,
        max_position_embeddings=40, type_vocab_size=2, initializer_range=0.25, **fields,
    )
    torch.manual_seed(seed)
    return _randomize(getattr(transformers, architecture)(config))
