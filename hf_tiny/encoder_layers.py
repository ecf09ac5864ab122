"""The encoder family's residual layers: BERT's post-norm layer and ModernBERT's pre-norm one, and the sublayers
they are built of (attention, feed-forward, LayerNorm) as the encoder config sizes them. TinyEncoderModel
(modeling_encoder.py) stacks them.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from .configuration_encoder import TinyEncoderConfig
from .layers import Attention, PreNormResidual, feed_forward
from .runtime import runtime_layer


def norm_of(config: TinyEncoderConfig, width: Optional[int] = None) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size if width is None else width, eps=config.layer_norm_eps, bias=config.norm_bias)


def attention_of(config: TinyEncoderConfig, layer_idx: int) -> Attention:
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = hidden // heads
    return Attention(
        config, layer_idx, hidden_size=hidden, num_heads=heads, num_key_value_heads=heads, head_dim=head_dim,
        bias=config.attention_bias, output_bias=config.attention_bias, scaling=head_dim**-0.5,
        dropout=config.attention_dropout,
    )


def feed_forward_of(config: TinyEncoderConfig) -> nn.Module:
    return feed_forward(config.hidden_size, config.intermediate_size, config.hidden_act, gated=config.mlp_gated,
                        bias=config.mlp_bias, activation_dropout=config.activation_dropout)


class TinyEncoderLayer(GradientCheckpointingLayer):
    """A post-norm residual layer (BERT): h = norm(x + attn(x)); out = norm(h + mlp(h)). Norm names follow Llama:
    `input_layernorm` belongs to attention (BERT's attention.output.LayerNorm), `post_attention_layernorm` to the
    feed-forward (BERT's output.LayerNorm)."""

    def __init__(self, config: TinyEncoderConfig, layer_idx: int):
        super().__init__()
        self.self_attn = attention_of(config, layer_idx)
        self.input_layernorm = norm_of(config)
        self.mlp = feed_forward_of(config)
        self.post_attention_layernorm = norm_of(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    @runtime_layer(in_place="post_norm_in_place")
    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, *,
                output_attentions: bool = False) -> torch.Tensor:
        attended, _ = self.self_attn(hidden_states, attention_mask, position_embeddings, output_attentions=output_attentions)
        hidden_states = self.input_layernorm(hidden_states + self.dropout(attended))
        return self.post_attention_layernorm(hidden_states + self.dropout(self.mlp(hidden_states)))


class TinyEncoderPreNormLayer(PreNormResidual, GradientCheckpointingLayer):
    """A pre-norm residual layer (ModernBERT; layers.PreNormResidual): h = x + attn(norm(x)); out = h + mlp(norm(h)).
    The first layer's input comes out of the embeddings' norm, so it has no input norm of its own (official's
    nn.Identity)."""

    def __init__(self, config: TinyEncoderConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = nn.Identity() if layer_idx == 0 else norm_of(config)
        self.self_attn = attention_of(config, layer_idx)
        self.attn_output_layernorm = None
        self.post_attention_layernorm = norm_of(config)
        self.mlp = feed_forward_of(config)
        self.mlp_output_layernorm = None
        self.dropout = nn.Dropout(config.hidden_dropout)
