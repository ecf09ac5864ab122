"""Tiny official BART models and padded batches for them."""

from __future__ import annotations

from pathlib import Path
import torch
from transformers import BartConfig, BartForConditionalGeneration


def randomize_norms(model) -> None:
    """LayerNorms at 1/0 would hide a swapped or missing norm; give them random affine parameters."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layer_norm" in name or "layernorm" in name:
                param.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)


def make_official_bart(path: Path, seed: int = 0, **overrides) -> Path:
    torch.manual_seed(seed)
    fields = dict(
        vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=40,
        init_std=0.3, dropout=0.0, activation_function="gelu",
    )
    fields.update(overrides)
    model = BartForConditionalGeneration(BartConfig(**fields)).eval()
    randomize_norms(model)
    with torch.no_grad():
        model.final_logits_bias.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return path


def padded_batch(config, *, seed: int = 1) -> dict:
    """Encoder rows of 12, 8 and 5 real tokens (right padding); decoder rows of 7, 7 and 4 real tokens."""
    generator = torch.Generator().manual_seed(seed)
    pad, start = config.pad_token_id, config.decoder_start_token_id
    input_ids = torch.randint(3, config.vocab_size - 1, (3, 12), generator=generator)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate((12, 8, 5)):
        attention_mask[row, :length] = 1
    decoder_input_ids = torch.randint(3, config.vocab_size - 1, (3, 7), generator=generator)
    decoder_input_ids[:, 0] = start
    decoder_attention_mask = torch.ones_like(decoder_input_ids)
    decoder_attention_mask[2, 4:] = 0
    return {
        "input_ids": input_ids.masked_fill(attention_mask == 0, pad),
        "attention_mask": attention_mask,
        "decoder_input_ids": decoder_input_ids.masked_fill(decoder_attention_mask == 0, pad),
        "decoder_attention_mask": decoder_attention_mask,
    }
