"""The seq2seq family's encoder and decoder stacks: TinySeq2SeqStack (embeddings -> N layers -> [final norm]), its
TinySeq2SeqLayer (the decoder's adds cross-attention) and its positions (learned, sinusoidal, or T5's relative
position buckets). TinySeq2SeqModel (modeling_seq2seq.py) holds one encoder and one decoder stack.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutput, BaseModelOutputWithPastAndCrossAttentions

from .configuration_seq2seq import TinySeq2SeqConfig
from .layers import Attention, build_norm, feed_forward
from .masks import AttentionMask, cross_attention_mask, self_attention_mask, with_position_bias
from .runtime import runtime_layer
from .step import (
    LayerOutputs, OutputFlags, cache_arguments, check_attention_mask, check_sequence_length, check_token_inputs,
    format_output, with_cache,
)


def relative_position_bucket(relative_position: torch.Tensor, *, bidirectional: bool, num_buckets: int, max_distance: int):
    """T5's bucketing of (key position - query position): exact buckets for short distances, log-spaced after."""
    buckets = 0
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    if_large = max_exact + (
        torch.log(relative_position.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).to(torch.long)
    if_large = torch.min(if_large, torch.full_like(if_large, num_buckets - 1))
    return buckets + torch.where(is_small, relative_position, if_large)


def sinusoidal_table(num_positions: int, dim: int) -> torch.Tensor:
    """Fixed positions (Vaswani et al. frequencies) laid out as [sin | cos] halves, like Marian; float64 math."""
    positions = torch.arange(num_positions, dtype=torch.float64)[:, None]
    inv_freq = torch.pow(10000.0, -torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = positions * inv_freq[None, :]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1).to(torch.float32)


class SinusoidalPositions(nn.Module):
    """Not trained and not saved: the table is rebuilt at init (and after from_pretrained's meta load)."""

    def __init__(self, num_positions: int, dim: int):
        super().__init__()
        self.num_positions, self.dim = num_positions, dim
        self.register_buffer("weight", sinusoidal_table(num_positions, dim), persistent=False)

    def _init_buffers(self) -> None:
        self.weight = sinusoidal_table(self.num_positions, self.dim).to(self.weight.device)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(position_ids, self.weight)


def decoder_cache_of(config, cache, past_key_values, use_cache) -> Optional[EncoderDecoderCache]:
    """The decoder's cache from a forward's `cache` / `past_key_values` (at most one), checked; with use_cache and
    none given, a new one (DynamicCache(config=...) reads the decoder view of the config: num_decoder_layers)."""
    cache, paged_cache = cache_arguments(cache, past_key_values)
    if paged_cache is not None or (cache is not None and not isinstance(cache, EncoderDecoderCache)):
        raise TypeError(
            "the cache of a seq2seq model must be an EncoderDecoderCache (self-attention + cross-attention "
            f"caches), got {type(cache if paged_cache is None else paged_cache).__name__}"
        )
    if cache is not None and cache.is_compileable:
        raise ValueError(
            "static (compileable) caches are not supported by hf_tiny seq2seq models: their zero-padded K/V need "
            "masks sized to the cache; use the default dynamic cache (cache_implementation=None)"
        )
    if cache is None and use_cache:
        cache = EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config))
    return cache


def stack_norm(config: TinySeq2SeqConfig) -> nn.Module:
    """A norm of the stacks: BART's LayerNorm, or T5's RMSNorm with T5LayerNorm's casting (t5_half_precision)."""
    return build_norm(config.norm_type, config.hidden_size, config.layer_norm_eps,
                      cast_to_half_weight=config.t5_half_precision)


def clamped_float16(hidden_states: torch.Tensor) -> torch.Tensor:
    """T5Block's float16 guard: the residual stream clamped to the float16 range, 1000 inside it once any value is
    inf (so that the next sublayer sees finite values), as official T5 does after each sublayer."""
    largest = torch.finfo(torch.float16).max
    bound = torch.where(torch.isinf(hidden_states).any(), largest - 1000, largest)
    return torch.clamp(hidden_states, min=-bound, max=bound)


class TinySeq2SeqLayer(GradientCheckpointingLayer):
    """An encoder layer (self-attention, feed-forward) or a decoder layer (causal self-attention, cross-attention
    over the encoder's states, feed-forward). Each sublayer is residual with the style's norm placement:
    pre-norm (T5) x = x + f(norm(x)), post-norm (BART, Marian, BERT) x = norm(x + f(x)). Each norm belongs to one
    sublayer: `input_layernorm` to self-attention, `cross_attn_layernorm` to cross-attention,
    `post_attention_layernorm` to the feed-forward."""

    def __init__(self, config: TinySeq2SeqConfig, layer_idx: int, *, decoder: bool):
        super().__init__()
        self.pre_norm = config.norm_placement == "pre"
        self.clamps_float16 = config.t5_half_precision
        self.self_attn = self._attention(config, layer_idx, decoder, cross=False)
        self.input_layernorm = stack_norm(config)
        self.cross_attn = self._attention(config, layer_idx, decoder, cross=True) if decoder else None
        self.cross_attn_layernorm = stack_norm(config) if decoder else None
        intermediate = config.decoder_intermediate_size if decoder else config.intermediate_size
        self.mlp = feed_forward(config.hidden_size, intermediate, config.hidden_act, gated=config.mlp_gated,
                                bias=config.mlp_bias, activation_dropout=config.activation_dropout,
                                down_in_weight_dtype=config.t5_half_precision)
        self.post_attention_layernorm = stack_norm(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    @staticmethod
    def _attention(config, layer_idx: int, decoder: bool, *, cross: bool) -> Attention:
        heads = config.decoder_attention_heads if decoder else config.num_attention_heads
        head_dim = config.decoder_head_dim if decoder else config.head_dim
        scale = head_dim**-0.5 if config.attention_scale is None else config.attention_scale
        return Attention(
            config, layer_idx, hidden_size=config.hidden_size, num_heads=heads,
            num_key_value_heads=config.num_key_value_heads if heads == config.num_attention_heads else heads,
            head_dim=head_dim, bias=config.attention_bias, output_bias=config.attention_bias, scaling=scale,
            dropout=config.attention_dropout, is_causal=decoder, is_cross_attention=cross,
        )

    def _residual(self, hidden_states: torch.Tensor, norm: nn.Module, sublayer) -> torch.Tensor:
        if not self.pre_norm:
            return norm(hidden_states + self.dropout(sublayer(hidden_states)))
        hidden_states = hidden_states + self.dropout(sublayer(norm(hidden_states)))
        if self.clamps_float16 and hidden_states.dtype == torch.float16:
            return clamped_float16(hidden_states)
        return hidden_states

    @runtime_layer()
    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None, *,
                is_causal: bool = False, layouts=(None, None), cache=None, output_attentions: bool = False) -> torch.Tensor:
        """Masks arrive as plain tensors among the positional arguments because reentrant gradient checkpointing
        re-feeds only top-level tensors: T5's relative-position bias, folded into the mask, needs gradients. layouts:
        the masks.MaskLayout of the self-attention mask and of the cross-attention mask."""
        self_mask = AttentionMask(attention_mask, is_causal, layouts[0])
        cross_mask = AttentionMask(encoder_attention_mask, False, layouts[1])
        self_cache = None if cache is None else cache.self_attention_cache  # an EncoderDecoderCache's own part
        hidden_states = self._residual(hidden_states, self.input_layernorm, lambda x: self.self_attn(
            x, self_mask, cache=self_cache, output_attentions=output_attentions)[0])
        if self.cross_attn is not None:
            hidden_states = self._residual(hidden_states, self.cross_attn_layernorm, lambda x: self.cross_attn(
                x, cross_mask, key_value_states=encoder_hidden_states, cache=cache, output_attentions=output_attentions)[0])
        return self._residual(hidden_states, self.post_attention_layernorm, self.mlp)


class TinySeq2SeqStack(nn.Module):
    """The encoder (is_decoder=False) or the decoder (causal self-attention + cross-attention) stack."""

    def __init__(self, config: TinySeq2SeqConfig, *, is_decoder: bool):
        super().__init__()
        self.config = config
        self.is_decoder = is_decoder
        hidden = config.hidden_size
        padding_idx = config.pad_token_id if config.use_padding_idx else None
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden, padding_idx=padding_idx)
        self.embed_scale = math.sqrt(hidden) if config.scale_embedding else 1.0
        # Optional parts exist or are None (each style has a fixed set; see TinySeq2SeqConfig.STYLES).
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, hidden) if config.type_vocab_size > 0 else None
        self.embed_positions = None
        self.relative_attention_bias = None
        if config.position_embedding_type == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings + config.position_offset, hidden)
        elif config.position_embedding_type == "sinusoidal":
            self.embed_positions = SinusoidalPositions(config.max_position_embeddings, hidden)
        else:
            heads = config.decoder_attention_heads if is_decoder else config.num_attention_heads
            self.relative_attention_bias = nn.Embedding(config.relative_attention_num_buckets, heads)
        self.embedding_norm = stack_norm(config) if config.embedding_norm else None
        num_layers = config.num_decoder_layers if is_decoder else config.num_hidden_layers
        self.layers = nn.ModuleList(TinySeq2SeqLayer(config, i, decoder=is_decoder) for i in range(num_layers))
        self.norm = stack_norm(config) if config.final_norm else None
        self.dropout = nn.Dropout(config.hidden_dropout)

    def embed(self, input_ids, inputs_embeds, past_length: int) -> torch.Tensor:
        if inputs_embeds is None:
            # like BART, the sqrt(d) scale belongs to the token lookup; caller-given embeddings are used as they are
            inputs_embeds = self.embed_tokens(input_ids) * self.embed_scale
        hidden_states = inputs_embeds
        if self.token_type_embeddings is not None:
            hidden_states = hidden_states + self.token_type_embeddings.weight[0]
        if self.embed_positions is not None:
            seq_len = hidden_states.shape[1]
            check_sequence_length(
                past_length + seq_len,
                limit=self.config.max_position_embeddings,
                field=f"{'decoder' if self.is_decoder else 'encoder'} sequence length (cached + new)",
            )
            position_ids = torch.arange(past_length, past_length + seq_len, device=hidden_states.device)
            if isinstance(self.embed_positions, nn.Embedding):
                position_ids = position_ids + self.config.position_offset
            hidden_states = hidden_states + self.embed_positions(position_ids)[None]
        if self.embedding_norm is not None:
            hidden_states = self.embedding_norm(hidden_states)
        return self.dropout(hidden_states)

    def position_bias(self, query_length: int, key_length: int, past_length: int, device) -> torch.Tensor:
        """T5 relative bias [1, heads, query_length, key_length] for queries at positions past_length + i."""
        context = torch.arange(query_length, dtype=torch.long, device=device)[:, None] + past_length
        memory = torch.arange(key_length, dtype=torch.long, device=device)[None, :]
        buckets = relative_position_bucket(
            memory - context,
            bidirectional=not self.is_decoder,
            num_buckets=self.config.relative_attention_num_buckets,
            max_distance=self.config.relative_attention_max_distance,
        )
        return self.relative_attention_bias(buckets).permute(2, 0, 1)[None]

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, encoder_hidden_states=None,
                encoder_attention_mask=None, cache: Optional[EncoderDecoderCache] = None, output_attentions: bool = False,
                output_hidden_states: bool = False, return_dict: bool = True, use_cache: Optional[bool] = None, *,
                past_key_values: Optional[EncoderDecoderCache] = None):
        names = ("decoder_input_ids", "decoder_inputs_embeds") if self.is_decoder else ("input_ids", "inputs_embeds")
        batch, seq_len = check_token_inputs(self.config, input_ids, inputs_embeds, names=names)
        if self.is_decoder and encoder_hidden_states is None:
            raise ValueError("the decoder needs encoder_hidden_states (the encoder's last_hidden_state)")
        if not self.is_decoder and (cache is not None or past_key_values is not None):
            raise ValueError("the encoder takes no cache")
        # as official decoders: the cache under either name, and use_cache=True starts one
        cache = decoder_cache_of(self.config, cache, past_key_values, use_cache and self.is_decoder)
        past_length = cache.self_attention_cache.get_seq_length() if cache is not None else 0
        hidden_states = self.embed(input_ids, inputs_embeds, past_length)
        self_mask, cross_mask = self._masks(attention_mask, encoder_hidden_states, encoder_attention_mask,
                                            (batch, seq_len, past_length), hidden_states)
        flags = OutputFlags(output_attentions, output_hidden_states, return_dict)
        attention = [layer.self_attn for layer in self.layers] if output_attentions else ()
        crossing = [layer.cross_attn for layer in self.layers] if output_attentions and self.is_decoder else ()
        with LayerOutputs(flags, attention_modules=attention, cross_attention_modules=crossing) as collected:
            for layer in self.layers:
                collected.add_hidden(hidden_states)
                # encoder states are positional so that gradient checkpointing propagates their gradients
                hidden_states = layer(hidden_states, self_mask.mask, encoder_hidden_states, cross_mask.mask,
                                      is_causal=self_mask.is_causal, layouts=(self_mask.layout, cross_mask.layout),
                                      cache=cache, output_attentions=output_attentions)
            if self.norm is not None:
                hidden_states = self.dropout(self.norm(hidden_states))
            collected.add_hidden(hidden_states)
        fields = dict(last_hidden_state=hidden_states, hidden_states=collected.hidden_states, attentions=collected.attentions)
        if self.is_decoder:
            output = with_cache(BaseModelOutputWithPastAndCrossAttentions, cache, **fields,
                                cross_attentions=collected.cross_attentions)
        else:
            output = BaseModelOutput(**fields)
        return format_output(output, return_dict)

    def _masks(self, attention_mask, encoder_hidden_states, encoder_attention_mask, shape: tuple, hidden_states):
        """(self-attention mask with T5's position bias folded in, cross-attention mask) of one forward."""
        batch, seq_len, past_length = shape
        key_length = past_length + seq_len
        name = "decoder_attention_mask" if self.is_decoder else "attention_mask"
        check_attention_mask(attention_mask, expected_shape=(batch, key_length), field=name)
        self_mask = self_attention_mask(attention_mask, batch_size=batch, query_length=seq_len, key_length=key_length,
                                        causal=self.is_decoder, device=hidden_states.device)
        if self.relative_attention_bias is not None:
            bias = self.position_bias(seq_len, key_length, past_length, hidden_states.device)
            self_mask = with_position_bias(self_mask, bias, hidden_states.dtype)
        if not self.is_decoder:
            return self_mask, AttentionMask(None, False)
        check_attention_mask(encoder_attention_mask, expected_shape=tuple(encoder_hidden_states.shape[:2]),
                             field="attention_mask (encoder padding mask)")
        return self_mask, cross_attention_mask(encoder_attention_mask, query_length=seq_len)
