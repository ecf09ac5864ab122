"""The modules the encoder family's task heads put on the encoder's hidden states: BERT's pooler (or the mean of
the real tokens), the prediction-head transform (dense -> activation -> LayerNorm), the MLM head with its decoder
and ELECTRA's discriminator head. The task models that own them (TinyEncoderFor*) are in modeling_encoder.py.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers.activations import ACT2FN

from .configuration_encoder import TinyEncoderConfig
from .encoder_layers import norm_of


class TinyEncoderPooler(nn.Module):
    """BERT's pooler: activation(dense(hidden state of the first token)); tanh in BERT (config.pooler_act). With
    head_transform (ModernBERT folders converted without shared_head) a LayerNorm follows; classifier_pooling
    "mean" pools the mean of the real tokens' hidden states instead of the first token's."""

    def __init__(self, config: TinyEncoderConfig):
        super().__init__()
        self.pooling = config.classifier_pooling
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=config.classifier_bias)
        self.activation = ACT2FN[config.pooler_act]
        self.layer_norm = norm_of(config) if config.head_transform else None

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        pooled = self.activation(self.dense(pooled_states(hidden_states, attention_mask, self.pooling)))
        return pooled if self.layer_norm is None else self.layer_norm(pooled)


def pooled_states(hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor], pooling: str) -> torch.Tensor:
    """[B, H]: what a sequence head reads, the first token's hidden states ("cls") or the real tokens' mean ("mean")."""
    return hidden_states[:, 0] if pooling == "cls" else mean_of_real_tokens(hidden_states, attention_mask)


def mean_of_real_tokens(hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """[B, H]: the mean of each row's hidden states over its real tokens (every token without a mask)."""
    if attention_mask is None:
        attention_mask = torch.ones(hidden_states.shape[:2], dtype=torch.bool, device=hidden_states.device)
    if attention_mask.dim() != 2:
        raise ValueError(f"classifier_pooling='mean' needs a 2-D attention_mask [batch, seq] to know the real tokens; "
                         f"got shape {tuple(attention_mask.shape)}")
    mask = attention_mask.to(hidden_states.device)
    return (hidden_states * mask.unsqueeze(-1)).sum(dim=1) / mask.sum(dim=1, keepdim=True)


class TinyEncoderPredictionHead(nn.Module):
    """dense -> activation -> LayerNorm: the transform of BERT's MLM head, which ModernBERT puts in front of every
    task head (head_transform). Activation: classifier_activation, else hidden_act."""

    def __init__(self, config: TinyEncoderConfig, width: Optional[int] = None):
        super().__init__()
        width = config.hidden_size if width is None else width
        self.dense = nn.Linear(config.hidden_size, width, bias=config.classifier_bias)
        self.act_fn = ACT2FN[config.classifier_activation or config.hidden_act]
        self.layer_norm = norm_of(config, width)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(self.act_fn(self.dense(hidden_states)))


class TinyEncoderMaskedLMHead(TinyEncoderPredictionHead):
    """BERT's MLM head: the prediction head, then the decoder (tied to the word embeddings, own bias unless
    decoder_bias=False). With a factorized embedding (embedding_size != hidden_size) the dense layer maps back to
    the embedding width."""

    def __init__(self, config: TinyEncoderConfig):
        super().__init__(config, config.embedding_size)
        self.decoder = nn.Linear(config.embedding_size, config.vocab_size, bias=config.decoder_bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.decoder(super().forward(hidden_states))


class TinyEncoderMaskedLMDecoder(nn.Module):
    """The MLM head of a shared_head model: the decoder alone, as TinyEncoderMaskedLMHead names it (its transform is
    the task model's `head`)."""

    def __init__(self, config: TinyEncoderConfig):
        super().__init__()
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=config.decoder_bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.decoder(hidden_states)


def masked_lm_heads(config: TinyEncoderConfig) -> tuple[Optional[TinyEncoderPredictionHead], nn.Module]:
    """(head, lm_head) of a masked-LM model: with shared_head the transform is `head`, else inside `lm_head`."""
    if config.shared_head:
        return TinyEncoderPredictionHead(config), TinyEncoderMaskedLMDecoder(config)
    return None, TinyEncoderMaskedLMHead(config)


class TinyEncoderDiscriminatorHead(nn.Module):
    """ELECTRA's discriminator head: dense -> activation -> one logit per token."""

    def __init__(self, config: TinyEncoderConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act_fn = ACT2FN[config.hidden_act]
        self.prediction = nn.Linear(config.hidden_size, 1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.prediction(self.act_fn(self.dense(hidden_states))).squeeze(-1)
