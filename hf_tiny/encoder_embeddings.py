"""The encoder family's embeddings: the position table (learned, RoBERTa's from-padding, or DistilBERT's
sinusoidal-initialized one), the rotary positions that replace it in ModernBERT, and the checks of the index inputs
the embeddings look up (token_type_ids, position_ids). TinyEncoderModel (modeling_encoder.py) builds them.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers import initialization as init

from .configuration_encoder import TinyEncoderConfig
from .layers import RotaryEmbedding
from .validation import is_compiling


def check_index_tensor(tensor: torch.Tensor, *, field: str, limit: int, limit_name: str, shape: tuple,
                       vector_ok: bool = False) -> None:
    """token_type_ids / position_ids: integer tensors broadcastable to the input shape, values in [0, limit);
    vector_ok: a [seq_len] vector too, shared by every row (official BERT broadcasts 1-D token_type_ids)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{field} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise TypeError(f"{field} must hold integers, got dtype {tensor.dtype}")
    batch, seq_len = shape
    vector = vector_ok and tensor.dim() == 1 and tensor.shape[0] == seq_len
    if not vector and (tensor.dim() != 2 or tensor.shape[1] != seq_len or tensor.shape[0] not in (1, batch)):
        also = f", ({seq_len},)" if vector_ok else ""
        raise ValueError(f"{field} has shape {tuple(tensor.shape)} but the input needs ({batch}, {seq_len}){also} or (1, {seq_len})")
    if tensor.numel() == 0 or is_compiling():
        return
    low, high = int(tensor.min()), int(tensor.max())
    if low < 0 or high >= limit:
        bad = low if low < 0 else high
        raise ValueError(f"{field} contains {bad}, outside [0, {limit_name}={limit})")


class SinusoidalPositionTable(nn.Embedding):
    """DistilBERT's sinusoidal position table: row p holds sin(p / 10000^(2i/d)) at even columns 2i and cos at
    odd columns 2i + 1, written at init (checkpoints store it). It stays a trainable parameter, as official
    transformers 5 leaves it (after init and after loading), so fine-tuning updates it as official does."""

    @torch.no_grad()
    def _init_buffers(self) -> None:  # called by _init_weights after the generic Embedding init
        positions = torch.arange(self.num_embeddings, dtype=torch.float64)[:, None]
        pairs = torch.arange(0, self.embedding_dim, 2, dtype=torch.float64)
        angles = positions / torch.pow(10000.0, pairs / self.embedding_dim)
        table = torch.empty(self.num_embeddings, self.embedding_dim, dtype=torch.float64)
        table[:, 0::2], table[:, 1::2] = torch.sin(angles), torch.cos(angles)
        init.copy_(self.weight, table.to(self.weight.dtype))  # a loaded table stays


def rotary_embeddings_of(config: TinyEncoderConfig) -> tuple[Optional[RotaryEmbedding], Optional[RotaryEmbedding]]:
    """(rotary_emb, sliding_rotary_emb): the rotary positions of full-attention layers (of every layer when the
    rope parameters are not keyed by layer type), and of sliding layers where theirs differ (ModernBERT's local
    theta); (None, None) with a position table. A bf16 / fp16 model rotates q and k in float32 by cos / sin rounded
    to its dtype, as official ModernBERT (the encoder with rotary positions) does."""
    if config.position_embedding_type != "rope":
        return None, None
    full, sliding = config.rope_parameters_for("full_attention"), config.rope_parameters_for("sliding_attention")
    return (RotaryEmbedding(config, full, rounded_float32=True),
            RotaryEmbedding(config, sliding, rounded_float32=True) if sliding != full else None)


def position_table_of(config: TinyEncoderConfig) -> Optional[nn.Embedding]:
    """The learned (or sinusoidal-initialized) position table; None with rotary positions."""
    width = config.embedding_size
    if config.position_embedding_type == "rope":
        return None
    if config.sinusoidal_positions:
        return SinusoidalPositionTable(config.max_position_embeddings, width)
    position_padding = config.pad_token_id if config.positions_from_padding else None
    return nn.Embedding(config.max_position_embeddings, width, padding_idx=position_padding)
