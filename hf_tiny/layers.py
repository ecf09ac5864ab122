"""Building blocks shared by the three families: norms, feed-forward, the one attention module, the block."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, EncoderDecoderCache
from transformers.modeling_layers import GradientCheckpointingLayer

from .attention import ALL_ATTENTION_FUNCTIONS, AttentionModule, update_cache
from .masks import AttentionMask
from .linear import Linear, linear_into
from .moe import MoeSpec, SparseMoeFeedForward
from .overwrite import (
    add_into, in_place_activation, inference_scale, mul_into, private_output, unhooked, workspace_tensor,
)
from .recompute import active as recomputing, has_hooks, linear_of_recomputed, regenerable
from .norms import NORM_TYPES, RMSNorm, build_norm  # noqa: F401  (NORM_TYPES, RMSNorm: imported from here too)
from .mla import LatentAttention, MlaSpec
from .rope import apply_rotary


def dropout_active(dropout: nn.Dropout) -> bool:
    return dropout.training and dropout.p > 0


def dropout_if_active(dropout: nn.Dropout, x: torch.Tensor) -> torch.Tensor:
    # Skipping the module call in eval / at p=0 saves a Python call and an aten op per sublayer and token.
    return dropout(x) if dropout_active(dropout) else x


class FeedForward(nn.Module):
    """Plain (down(act(up(x)))) or gated (down(act(gate(x)) * up(x)), SwiGLU / gated-GELU) feed-forward."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        *,
        gated: bool,
        bias: bool,
        activation_dropout: float = 0.0,
    ):
        super().__init__()
        if hidden_act not in ACT2FN:
            raise ValueError(f"unknown hidden_act {hidden_act!r}; choose one of {sorted(ACT2FN)}")
        self.gated = gated
        if gated:
            self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = ACT2FN[hidden_act]
        self.dropout = nn.Dropout(activation_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if recomputing() and not dropout_active(self.dropout):  # dropout's random mask could not be replayed
            return self._recomputing(x)
        activate_ = self._in_place_activation(x)
        if activate_ is not None:
            return self._in_place(x, activate_)
        if not self.gated:
            return self._plain(x)
        # Written as vLLM's GLU fuser reads source: act_fn, gate_proj and up_proj named once each in this method,
        # as act_fn(gate(x)) * up(x), so that it runs gate and up as one fused GEMM (gate_up_proj) and the
        # activation-and-multiply as one kernel. Its fx trace reaches this line (x is a Proxy there).
        hidden = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(dropout_if_active(self.dropout, hidden))

    def _plain(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(dropout_if_active(self.dropout, self.act_fn(self.up_proj(x))))

    def _in_place_activation(self, x: torch.Tensor):
        """The in-place form of act_fn when forward may overwrite its temporaries (inference on many tokens, our
        own first projection, no hooks: overwrite.py), else None."""
        # getattr: vLLM's fuser deletes gate_proj and up_proj (and swaps act_fn) in the modules it fuses.
        first = getattr(self, "gate_proj" if self.gated else "up_proj", None)
        if inference_scale(x) and private_output(first):
            return in_place_activation(self.act_fn)
        return None

    def _in_place(self, x: torch.Tensor, activate_) -> torch.Tensor:
        """forward() with the activation and the gated product written into the first projection's output."""
        hidden = activate_(self._project(self.gate_proj if self.gated else self.up_proj, x, "first"))
        if self.gated:
            hidden = mul_into(hidden, self._project(self.up_proj, x, "up"))
        return self.down_proj(dropout_if_active(self.dropout, hidden))

    def _project(self, projection: nn.Module, x: torch.Tensor, name: str) -> torch.Tensor:
        """projection(x), written into the layer workspace's tensor `name` when one is open and the module call
        can be skipped: our own Linear, no hook on it nor on the down projection that reads the result."""
        if type(projection) is Linear and not has_hooks(projection) and not has_hooks(self.down_proj):
            out = workspace_tensor(name, x.numel() // x.shape[-1], projection.out_features, x)
            if out is not None:
                product = linear_into(x, projection.weight, projection.bias, out)
                if product is not None:
                    return product
        return projection(x)

    def _recomputing(self, x: torch.Tensor) -> torch.Tensor:
        """Training: the down projection's input (and the activation) recomputed in backward from the gate and up
        outputs, which are kept (recompute.py)."""
        if not self.gated:
            return linear_of_recomputed(self.act_fn, self.down_proj, self.up_proj(x))
        return linear_of_recomputed(self._glu, self.down_proj, self.gate_proj(x), self.up_proj(x))

    def _glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.act_fn(gate) * up


@dataclass(frozen=True)
class BlockSpec:
    """Everything one TransformerBlock is built from, named the same for every family: each config builds its
    own (`config.block_spec()`; a seq2seq config one per stack), so no layer reads a config field by name.

    pre_norm=True (Llama, T5):      x = x + dropout(sublayer(norm(x)))
    sandwich_norms (Gemma 3):       x = x + dropout(output_norm(sublayer(norm(x))))
    pre_norm=False (BERT, BART):    x = norm(x + dropout(sublayer(x)))
    """

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_scale: Optional[float]  # None: head_dim ** -0.5 (T5 uses 1.0)
    attention_dropout: float
    attention_bias: bool  # on q/k/v
    attention_output_bias: bool  # on o_proj
    intermediate_size: int
    hidden_act: str
    mlp_gated: bool
    mlp_bias: bool
    pre_norm: bool
    norm_type: str
    norm_eps: float
    hidden_dropout: float = 0.0
    activation_dropout: float = 0.0
    cross_attention: bool = False
    causal: bool = False  # self-attention sees only earlier positions (decoders)
    qk_norm: bool = False  # RMSNorm over each head's query and key before RoPE (Qwen3, Gemma 3)
    norm_unit_offset: bool = False  # RMSNorms scale by (1 + weight) (Gemma)
    sandwich_norms: bool = False  # pre_norm only: also a norm on each sublayer's output before the add (Gemma 3)
    norm_bias: bool = True  # LayerNorms with a bias (MPT: without)
    moe: Optional[MoeSpec] = None  # a sparse Mixture-of-Experts feed-forward instead of the dense one
    mla: Optional[MlaSpec] = None  # Multi-head Latent Attention (DeepSeek) instead of the q/k/v projections


class Attention(AttentionModule):
    """One attention module for encoder self-attention, causal self-attention and cross-attention.

    Owns the projections, RoPE, the KV-cache update and the head reshaping; the math is the attention interface
    named by `config._attn_implementation` (AttentionModule says how it is called). Interfaces read the attributes
    transformers' attention modules carry: layer_idx, num_key_value_groups, is_causal, scaling, head_dim, config.
    """

    def __init__(self, config, spec: BlockSpec, layer_idx: int, *, is_cross_attention: bool = False):
        super().__init__()
        self.config = config  # read for config._attn_implementation only, at every call
        self.layer_idx = layer_idx
        self.is_cross_attention = is_cross_attention
        self.num_heads = spec.num_attention_heads
        self.num_key_value_heads = spec.num_key_value_heads
        self.num_key_value_groups = spec.num_attention_heads // spec.num_key_value_heads
        self.is_causal = spec.causal and not is_cross_attention
        self.head_dim = spec.head_dim
        self.scaling = self.head_dim**-0.5 if spec.attention_scale is None else spec.attention_scale
        self.dropout = spec.attention_dropout
        hidden = spec.hidden_size
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias=spec.attention_bias)
        self.k_proj = Linear(hidden, self.num_key_value_heads * self.head_dim, bias=spec.attention_bias)
        self.v_proj = Linear(hidden, self.num_key_value_heads * self.head_dim, bias=spec.attention_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=spec.attention_output_bias)
        qk_norm = RMSNorm(self.head_dim, spec.norm_eps, unit_offset=spec.norm_unit_offset) if spec.qk_norm else None
        self.q_norm, self.k_norm = qk_norm, copy.deepcopy(qk_norm)

    def _heads(self, states: torch.Tensor, norm: Optional[nn.Module]) -> torch.Tensor:
        """[B, S, H * D] -> [B, H, S, D], with the per-head norm (q/k norm) when there is one."""
        states = states.unflatten(-1, (-1, self.head_dim))  # one call, so vLLM's fx trace passes through it
        if norm is not None:
            states = norm(states)
        return states.transpose(1, 2)

    def _cross_attention_qkv(self, hidden_states, key_value_states, cache):
        """Queries from the decoder; keys and values of the encoder states, projected at the first step and then
        read from the cache."""
        if key_value_states is None:
            raise ValueError(f"cross-attention layer {self.layer_idx} needs encoder hidden states (key_value_states)")
        query = self._heads(self.q_proj(hidden_states), self.q_norm)
        cross_cache = cache
        if isinstance(cache, EncoderDecoderCache):
            cross_cache = cache.cross_attention_cache
            if cache.is_updated.get(self.layer_idx):
                # Encoder states do not change while decoding: their K/V were computed at the first step.
                layer = cross_cache.layers[self.layer_idx]
                return query, layer.keys, layer.values
        key = self._heads(self.k_proj(key_value_states), self.k_norm)
        value = self._heads(self.v_proj(key_value_states), None)
        if cross_cache is not None:
            key, value = cross_cache.update(key, value, self.layer_idx)
            if isinstance(cache, EncoderDecoderCache):
                cache.is_updated[self.layer_idx] = True
        return query, key, value

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[AttentionMask] = None,
        *,
        position_embeddings: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        key_value_states: Optional[torch.Tensor] = None,
        cache: Optional[Cache] = None,
        output_attentions: bool = False,
        **attention_kwargs,
    ):
        """cache: a transformers Cache, or continuous batching's paged cache (whose update reads and fills
        attention_kwargs, its sequence boundaries and indices). attention_kwargs: passed on to the attention interface.

        Self-attention projects q, k and v side by side from hidden_states and calls the interface once: the shape
        vLLM's Transformers backend reads from this source to fuse q/k/v into one GEMM and to put its own paged
        attention behind the interface."""
        batch, seq_len = hidden_states.shape[:2]
        if self.is_cross_attention:
            query, key, value = self._cross_attention_qkv(hidden_states, key_value_states, cache)
        else:
            query_states = self.q_proj(hidden_states)
            key_states = self.k_proj(hidden_states)
            value_states = self.v_proj(hidden_states)
            query = self._heads(query_states, self.q_norm)
            key = self._heads(key_states, self.k_norm)
            value = self._heads(value_states, None)
            if position_embeddings is not None:
                key = apply_rotary(key, *position_embeddings)
            if isinstance(cache, EncoderDecoderCache):
                cache = cache.self_attention_cache
            if cache is not None:
                key, value = update_cache(cache, key, value, self.layer_idx, attention_kwargs)
        if position_embeddings is not None:
            query = apply_rotary(query, *position_embeddings)

        mask, is_causal, visible = self.interface_mask(attention_mask, query, key, attention_kwargs)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
        out, weights = attention_interface(
            self,
            query,
            key,
            value,
            mask,
            scaling=self.scaling,
            dropout=self.dropout if self.training else 0.0,
            is_causal=is_causal,
            output_attentions=output_attentions,
            **attention_kwargs,
        )
        out = self.zero_invisible_rows(out, visible).reshape(batch, seq_len, -1)  # the interface returns [B, S, H, D]
        return self.o_proj(out), weights



def _output_is_private(out: torch.Tensor, sublayer: nn.Module, output_norm: Optional[nn.Module]) -> bool:
    """Whether a sublayer's output (after its output norm, if any) may be overwritten by the residual sum: it is
    the new tensor of our own last projection or norm, and no forward hook was handed it (overwrite.py)."""
    if not inference_scale(out):
        return False
    if output_norm is not None:
        return type(output_norm) in (RMSNorm, nn.LayerNorm) and unhooked(output_norm)
    last = getattr(sublayer, "down_proj" if isinstance(sublayer, FeedForward) else "o_proj", None)
    return unhooked(sublayer) and private_output(last)


class TransformerBlock(GradientCheckpointingLayer):
    """Self-attention [+ cross-attention] + feed-forward, each a residual sublayer with its norm (BlockSpec says
    which placement). Norm names follow Llama so tools find them by habit, and each belongs to one sublayer:
    `input_layernorm` to self-attention, `cross_attn_layernorm` to cross-attention, `post_attention_layernorm` to
    the feed-forward. In a post-LN block (BERT, BART) each therefore normalizes the output of its sublayer:
    BERT's attention.output.LayerNorm is `input_layernorm`, its output.LayerNorm `post_attention_layernorm`.
    Sandwich norms (Gemma 3) add `attn_output_layernorm` and `mlp_output_layernorm` on the sublayer outputs
    (Gemma's own names: post_attention_layernorm, pre_feedforward_layernorm = our post_attention_layernorm,
    post_feedforward_layernorm).
    """

    def __init__(self, config, spec: BlockSpec, layer_idx: int):
        super().__init__()
        hidden = spec.hidden_size
        if spec.sandwich_norms and (not spec.pre_norm or spec.cross_attention):
            raise ValueError("sandwich_norms are defined for pre-norm self-attention blocks only")
        self.pre_norm = spec.pre_norm

        def norm():
            return build_norm(spec.norm_type, hidden, spec.norm_eps, unit_offset=spec.norm_unit_offset, bias=spec.norm_bias)

        self.has_cross_attention = spec.cross_attention
        self.self_attn = LatentAttention(config, spec, layer_idx) if spec.mla else Attention(config, spec, layer_idx)
        self.input_layernorm = norm()
        if spec.cross_attention:
            self.cross_attn = Attention(config, spec, layer_idx, is_cross_attention=True)
            self.cross_attn_layernorm = norm()
        self.is_sparse = spec.moe is not None
        if self.is_sparse:
            self.mlp = SparseMoeFeedForward(
                hidden, spec.moe, lambda size: FeedForward(hidden, size, spec.hidden_act, gated=True, bias=False)
            )
        else:
            self.mlp = FeedForward(
                hidden, spec.intermediate_size, spec.hidden_act, gated=spec.mlp_gated, bias=spec.mlp_bias,
                activation_dropout=spec.activation_dropout,
            )
        self.post_attention_layernorm = norm()
        self.attn_output_layernorm = norm() if spec.sandwich_norms else None
        self.mlp_output_layernorm = norm() if spec.sandwich_norms else None
        self.dropout = nn.Dropout(spec.hidden_dropout)

    def _sublayer_input(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        # Training: the projections after the norm keep "norm(x)" rather than its result (recompute.py).
        return regenerable(norm, x) if self.pre_norm else x

    def _sublayer_output(
        self,
        residual: torch.Tensor,
        out: torch.Tensor,
        norm: nn.Module,
        output_norm: Optional[nn.Module] = None,
        *,
        sublayer: nn.Module,
    ) -> torch.Tensor:
        if output_norm is not None:
            out = output_norm(out)
        out = dropout_if_active(self.dropout, out)
        x = add_into(out, residual) if _output_is_private(out, sublayer, output_norm) else residual + out
        return x if self.pre_norm else norm(x)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_embeddings: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        encoder_hidden_states: Optional[torch.Tensor] = None,
        encoder_attention_mask: Optional[torch.Tensor] = None,
        *,
        is_causal: bool = False,
        segment_ids: Optional[torch.Tensor] = None,
        cache: Optional[Cache] = None,
        output_attentions: bool = False,
        **attention_kwargs,
    ):
        """Masks arrive as plain tensors in the positional arguments (with is_causal / segment_ids beside them)
        because reentrant gradient checkpointing detaches and re-feeds only top-level tensor arguments: a tensor
        that needs gradients inside a container (T5's relative-position bias folded into the mask, encoder states)
        would be backpropagated through once per checkpointed block. Call it as
        `block(hidden, mask.mask, position_embeddings, encoder_hidden, cross_mask.mask, is_causal=mask.is_causal,
        ...)`.

        Returns (hidden_states, self-attention weights, cross-attention weights, router logits): the weights are None
        unless output_attentions, the router logits None unless the feed-forward is a sparse MoE."""
        attn_out, self_weights = self.self_attn(
            self._sublayer_input(hidden_states, self.input_layernorm),
            AttentionMask(attention_mask, is_causal, segment_ids),
            position_embeddings=position_embeddings,
            cache=cache,
            output_attentions=output_attentions,
            **attention_kwargs,
        )
        hidden_states = self._sublayer_output(
            hidden_states, attn_out, self.input_layernorm, self.attn_output_layernorm, sublayer=self.self_attn
        )
        cross_weights = None
        if self.has_cross_attention:
            cross_out, cross_weights = self.cross_attn(
                self._sublayer_input(hidden_states, self.cross_attn_layernorm),
                AttentionMask(encoder_attention_mask, False),
                key_value_states=encoder_hidden_states,
                cache=cache,
                output_attentions=output_attentions,
            )
            hidden_states = self._sublayer_output(
                hidden_states, cross_out, self.cross_attn_layernorm, sublayer=self.cross_attn
            )
        mlp_out = self.mlp(self._sublayer_input(hidden_states, self.post_attention_layernorm))
        router_logits = None
        if self.is_sparse:
            mlp_out, router_logits = mlp_out
        hidden_states = self._sublayer_output(
            hidden_states, mlp_out, self.post_attention_layernorm, self.mlp_output_layernorm, sublayer=self.mlp
        )
        return hidden_states, self_weights, cross_weights, router_logits
