"""Tiny official BERT models, their conversion, and padded batches for them."""

from __future__ import annotations

from pathlib import Path
import torch
import transformers
from transformers import (
    BertConfig,
)
from conversion import bert as bert_conversion


VOCAB = 97


def official_model(architecture: str, *, heads=4, layers=2, intermediate=64, hidden=32, seed=0, **overrides):
    """A tiny official BERT with large random weights: every weight, bias and norm differs from its init so a
    mis-mapped tensor changes the outputs."""
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        max_position_embeddings=40,
        type_vocab_size=3,
        initializer_range=0.25,
        num_labels=2 if architecture == "BertForQuestionAnswering" else 3,
    )
    fields.update(overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(BertConfig(**fields))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(0.2 * torch.randn_like(param))
            elif "LayerNorm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    return model.eval()


def padded_batch(seq_len=12, type_vocab=3, seed=1):
    generator = torch.Generator().manual_seed(seed)
    lengths = [seq_len, seq_len - 4, 3]
    input_ids = torch.randint(1, VOCAB, (3, seq_len), generator=generator)
    token_type_ids = torch.randint(0, type_vocab, (3, seq_len), generator=generator)
    attention_mask = torch.zeros(3, seq_len, dtype=torch.long)
    for row, length in enumerate(lengths):
        attention_mask[row, :length] = 1
    input_ids = input_ids.masked_fill(attention_mask == 0, 0)
    return {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": attention_mask}


def convert_official(model, tmp_path: Path, name="bert"):
    src, dst = tmp_path / f"{name}_src", tmp_path / f"{name}_hf_tiny"
    model.save_pretrained(src)
    report = bert_conversion.convert(src, dst)
    return src, dst, report
