"""The modules every family is built from: norms, feed-forwards, the pre-norm residual layer, rotary positions and
the one attention module.

Each is the math of its paper (and of transformers' own file) and nothing else: projections are plain nn.Linear, so
quantizers, PEFT and vLLM find and replace them as in official models. Making them faster or leaner is the
runtime's job (runtime.py): a forward it may run differently carries its declaration (`@runtime_layer`, `@runtime_feed_forward`, ...).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, EncoderDecoderCache

from .runtime import runtime_feed_forward, runtime_layer
from .attention import ALL_ATTENTION_FUNCTIONS, HF_TINY_BACKEND_NAMES, check_takes_sinks
from .engines import foreign_mask, paged_cache_update
from .rope import MAX_TABLE_POSITIONS, SEQUENCE_DEPENDENT_TYPES, compute_inv_freq, rotary_dim, standardize_rope_parameters

NORM_TYPES = ("layernorm", "rmsnorm")
HALF_DTYPES = (torch.float16, torch.bfloat16)


class RMSNorm(nn.Module):
    """Root-mean-square norm, statistics in fp32.

    Llama: weight * x, the product in the input dtype (weights initialized to 1).
    unit_offset=True (Gemma): (1 + weight) * x, the product in fp32 and then cast (weights initialized to 0). The
    offset is applied here rather than folded into the stored weight, so checkpoints convert bit for bit.
    float32_product=True (OLMo 2, GPT-OSS): weight * x with x still in fp32, then cast.
    cast_to_half_weight=True (T5): weight * x, x cast to the weight's dtype where the weight is fp16 / bf16 and
    kept fp32 otherwise (T5LayerNorm), so that a float32 residual stream (T5 in float16 keeps its feed-forward's
    output float32) enters each sublayer in the weights' dtype. The same as Llama's where the dtypes agree.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, unit_offset: bool = False,
                 elementwise_affine: bool = True, float32_product: bool = False, cast_to_half_weight: bool = False):
        """elementwise_affine=False: no weight, the normalized x itself (Llama 4's q/k norm, `Llama4TextL2Norm`)."""
        super().__init__()
        self.unit_offset = unit_offset
        self.float32_product = float32_product
        self.cast_to_half_weight = cast_to_half_weight
        self.hidden_size = hidden_size
        if elementwise_affine:
            self.weight = nn.Parameter(torch.zeros(hidden_size) if unit_offset else torch.ones(hidden_size))
        else:
            self.register_parameter("weight", None)
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        weight = self.weight
        if weight is None:
            return hidden_states.to(input_dtype)
        if self.unit_offset:
            return (hidden_states * (1.0 + weight.float())).to(input_dtype)
        if self.float32_product:
            return (weight * hidden_states).to(input_dtype)
        if self.cast_to_half_weight:
            return weight * (hidden_states.to(weight.dtype) if weight.dtype in HALF_DTYPES else hidden_states)
        return weight * hidden_states.to(input_dtype)

    def extra_repr(self) -> str:
        offset = ", unit_offset=True" if self.unit_offset else ""
        weight = "" if self.weight is not None else ", elementwise_affine=False"
        return f"{(self.hidden_size,)}, eps={self.variance_epsilon}{offset}{weight}"


class ScaledEmbedding(nn.Embedding):
    """Gemma's token embedding: the rows times sqrt(hidden_size), the scale rounded to the weights' dtype, as
    official's Gemma3TextScaledWordEmbedding. The scale belongs to the module, so get_input_embeddings()(ids) gives
    what the layers get from input_ids (PEFT's prompt tuning embeds that way, and its LoRA reads `embed_scale` to
    scale an adapter's rows alike)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int], embed_scale: float):
        super().__init__(num_embeddings, embedding_dim, padding_idx)
        self.embed_scale = embed_scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeds = super().forward(input_ids)
        return embeds * torch.tensor(self.embed_scale, dtype=embeds.dtype, device=embeds.device)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, embed_scale={self.embed_scale}"


def build_norm(norm_type: str, hidden_size: int, eps: float, *, unit_offset: bool = False, bias: bool = True,
               float32_product: bool = False, cast_to_half_weight: bool = False) -> nn.Module:
    """bias: the LayerNorm's additive bias (MPT's have none); RMSNorm has none anyway."""
    if norm_type == "layernorm":
        return nn.LayerNorm(hidden_size, eps=eps, bias=bias)
    if norm_type == "rmsnorm":
        return RMSNorm(hidden_size, eps=eps, unit_offset=unit_offset, float32_product=float32_product,
                       cast_to_half_weight=cast_to_half_weight)
    raise ValueError(f"unknown norm_type {norm_type!r}; choose one of {list(NORM_TYPES)}")


def _activation(hidden_act: str) -> nn.Module:
    if hidden_act not in ACT2FN:
        raise ValueError(f"unknown hidden_act {hidden_act!r}; choose one of {sorted(ACT2FN)}")
    return ACT2FN[hidden_act]


def down_input(feed_forward: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The input of a down_in_weight_dtype feed-forward's down projection (T5's) cast to its weight's dtype, as official
    T5DenseActDense casts before `wo`, which from_pretrained(dtype=float16) keeps float32 (official T5's
    _keep_in_fp32_modules); an int8 weight (bitsandbytes) takes the input as it is. down_proj stays a plain nn.Linear,
    for the quantizers and tools that pick modules by their exact type. Callers test the feed-forward's
    down_in_weight_dtype first: every other model's feed-forwards then make no call here (host work per step)."""
    weight = feed_forward.down_proj.weight
    if isinstance(weight, torch.Tensor) and hidden.dtype != weight.dtype and weight.dtype != torch.int8:
        return hidden.to(weight.dtype)
    return hidden


class FeedForward(nn.Module):
    """down(act(up(x))): BERT, GPT-2, BART (c_fc / c_proj, intermediate / output); activation_dropout drops the
    activation while training (BART). down_in_weight_dtype: the down projection's input takes its weight's dtype
    (T5: down_input)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, *, bias: bool,
                 activation_dropout: float = 0.0, down_in_weight_dtype: bool = False):
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.down_in_weight_dtype = down_in_weight_dtype
        self.act_fn = _activation(hidden_act)
        self.dropout = nn.Dropout(activation_dropout) if activation_dropout else None

    @runtime_feed_forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.act_fn(self.up_proj(x))
        hidden = hidden if self.dropout is None else self.dropout(hidden)
        return self.down_proj(down_input(self, hidden) if self.down_in_weight_dtype else hidden)


class GatedFeedForward(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (Llama), gated GELU (Gemma, T5 v1.1). Written as vLLM's GLU fuser reads
    source (act_fn, gate_proj and up_proj named once each), so that it fuses gate and up into one GEMM.
    down_in_weight_dtype: as FeedForward's."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, *, bias: bool,
                 activation_dropout: float = 0.0, down_in_weight_dtype: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.down_in_weight_dtype = down_in_weight_dtype
        self.act_fn = _activation(hidden_act)
        self.dropout = nn.Dropout(activation_dropout) if activation_dropout else None

    @runtime_feed_forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        hidden = hidden if self.dropout is None else self.dropout(hidden)
        return self.down_proj(down_input(self, hidden) if self.down_in_weight_dtype else hidden)


class ClampedSwiGLUFeedForward(nn.Module):
    """down((up + 1) * gate * sigmoid(alpha * gate)), gate clamped from above and up on both sides at `limit`:
    GPT-OSS's experts (alpha 1.702, limit 7.0, with biases). Official fuses gate and up into one interleaved
    gate_up_proj tensor; here they are the usual two projections."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, alpha: float, limit: float, bias: bool):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x).clamp(max=self.limit)
        up = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return self.down_proj((up + 1) * glu)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, limit={self.limit}"


def feed_forward(hidden_size: int, intermediate_size: int, hidden_act: str, *, gated: bool, bias: bool,
                 activation_dropout: float = 0.0, down_in_weight_dtype: bool = False) -> nn.Module:
    kind = GatedFeedForward if gated else FeedForward
    return kind(hidden_size, intermediate_size, hidden_act, bias=bias, activation_dropout=activation_dropout,
                down_in_weight_dtype=down_in_weight_dtype)


class PreNormResidual:
    """The forward of a pre-norm residual layer: h = x + attn(norm(x)); out = h + mlp(norm(h)). The layer classes
    that mix it in (TinyCausalDecoderLayer, TinyEncoderPreNormLayer) build its modules, None where a variant has none:
    norms on the sublayers' outputs too (`attn_output_layernorm`, `mlp_output_layernorm`: Gemma 3's sandwich norms),
    or only there (OLMo 2: no `input_layernorm` / `post_attention_layernorm`, h = x + norm(attn(x))); `dropout` of
    each sublayer's output while training (GPT-2, Phi-3, ModernBERT)."""

    @runtime_layer(in_place="pre_norm_in_place")
    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, **attention_kwargs) -> torch.Tensor:
        norm = self.input_layernorm  # a submodule read once: each read is a Python call of nn.Module.__getattr__
        normed = hidden_states if norm is None else norm(hidden_states)
        attended, _ = self.self_attn(normed, attention_mask, position_embeddings, **attention_kwargs)
        if self.attn_output_layernorm is not None:
            attended = self.attn_output_layernorm(attended)
        if self.dropout is not None:
            attended = self.dropout(attended)
        hidden_states = hidden_states + attended
        norm = self.post_attention_layernorm
        normed = hidden_states if norm is None else norm(hidden_states)
        transformed = self.mlp(normed)
        if self.mlp_output_layernorm is not None:
            transformed = self.mlp_output_layernorm(transformed)
        if self.dropout is not None:
            transformed = self.dropout(transformed)
        return hidden_states + transformed


# ---- rotary positions ------------------------------------------------------------------------------------------


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Llama's convention: the two halves of the head dimension form the (real, imaginary) pairs."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """query [B, H, S, D] and key [B, Hkv, S, D] rotated by cos, sin [B, S, R], the same for every head; R < D
    (partial rotary): only [..., :R] is rotated. Returns both, each in its own dtype."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if cos.shape[-1] < query.shape[-1]:
        return partially_rotated(query, cos, sin), partially_rotated(key, cos, sin)
    query_rotated = query * cos + rotate_half(query) * sin
    key_rotated = key * cos + rotate_half(key) * sin
    if query_rotated.dtype != query.dtype or key_rotated.dtype != key.dtype:  # cos / sin in a wider dtype
        query_rotated, key_rotated = query_rotated.to(query.dtype), key_rotated.to(key.dtype)
    return query_rotated, key_rotated


def partially_rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, S, D] with x[..., :R] rotated by cos, sin [B, 1, S, R] and the rest as it is, in x's dtype."""
    rotary_dim = cos.shape[-1]
    rotated = x[..., :rotary_dim] * cos + rotate_half(x[..., :rotary_dim]) * sin
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin [B, S, rotary dims] for position ids [B, S]; computed in float32 and returned in x's dtype.

    The frequencies of every rope type are rope.py's (transformers' arithmetic). For every type but the sequence
    dependent ones, cos/sin of the first max_position_embeddings positions come from a float32 table (built once
    per device: the same values in fewer kernels per decoding step); positions past it are computed from the same
    formula, as official models do for any position. "dynamic" recomputes inv_freq when the sequence grows past
    the cached length and restores it for short sequences, and "longrope" picks its long or short factors at every
    call, exactly like transformers' `dynamic_rope_update` / `longrope_frequency_update`.
    """

    def __init__(self, config, rope_parameters: Optional[dict] = None, head_dim: Optional[int] = None,
                 float32: bool = False, rounded_float32: bool = False):
        """rope_parameters: this module's own (one layer type's); by default config.rope_parameters. head_dim: the
        dimensions the rotation covers when they are not config.head_dim (MLA's qk_rope_head_dim). float32: cos/sin
        stay float32 whatever x's dtype (OLMo 2: q and k are rotated in float32, then cast back). rounded_float32:
        cos/sin rounded to x's dtype first, then returned as float32, so that q and k are rotated in float32 by the
        rounded values (official ModernBERT's order)."""
        super().__init__()
        self.float32, self.rounded_float32 = float32, rounded_float32
        self.rope_parameters = standardize_rope_parameters(
            rope_parameters if rope_parameters is not None else getattr(config, "rope_parameters", None),
            max_position_embeddings=config.max_position_embeddings,
            owner=type(config).__name__,
        )
        self.rope_type = self.rope_parameters["rope_type"]
        if head_dim is None:
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.head_dim = rotary_dim(self.rope_parameters, head_dim, owner=type(config).__name__)
        self.max_position_embeddings = config.max_position_embeddings
        inv_freq, self.attention_scaling = compute_inv_freq(self.rope_parameters, self.head_dim, self.max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)
        self.original_max_seq_len = self.max_seq_len_cached = self.max_position_embeddings
        table = self.max_position_embeddings
        self._table_positions = table if self.rope_type not in SEQUENCE_DEPENDENT_TYPES and table <= MAX_TABLE_POSITIONS else 0
        self._long_inv_freq = None  # longrope: the long-factor frequencies, computed on first use
        self._table = None  # (key, cos, sin): a plain attribute, rebuilt when the device or inv_freq changes

    @torch.no_grad()
    def _init_buffers(self) -> None:
        """Recomputes the non-persistent buffers (from_pretrained leaves them uninitialised)."""
        inv_freq, self.attention_scaling = compute_inv_freq(self.rope_parameters, self.head_dim, self.max_position_embeddings)
        if self.inv_freq.device.type != "meta":
            self.inv_freq.copy_(inv_freq)
            self.original_inv_freq.copy_(inv_freq)
        self.max_seq_len_cached = self.original_max_seq_len
        self._table = None

    @torch.no_grad()
    def _dynamic_update(self, position_ids: torch.Tensor, device: torch.device) -> None:
        seq_len = torch.max(position_ids) + 1
        max_seq_len_cached = self.max_seq_len_cached
        if seq_len > max_seq_len_cached:  # grown past what inv_freq was computed for
            inv_freq, self.attention_scaling = compute_inv_freq(
                self.rope_parameters, self.head_dim, self.max_position_embeddings, device=device, seq_len=seq_len
            )
            self.register_buffer("inv_freq", inv_freq, persistent=False)
            self.max_seq_len_cached = seq_len
        if seq_len < self.original_max_seq_len and max_seq_len_cached > self.original_max_seq_len:  # back to short
            original_inv_freq = self.original_inv_freq.to(device)
            self.register_buffer("inv_freq", original_inv_freq, persistent=False)
            self.original_inv_freq = original_inv_freq
            self.max_seq_len_cached = self.original_max_seq_len

    @torch.no_grad()
    def _longrope_update(self, position_ids: torch.Tensor, device: torch.device) -> None:
        seq_len = torch.max(position_ids) + 1
        original_max = self.rope_parameters["original_max_position_embeddings"]
        if self._long_inv_freq is None:
            self._long_inv_freq, _ = compute_inv_freq(
                self.rope_parameters, self.head_dim, self.max_position_embeddings, seq_len=original_max + 1
            )
        inv_freq = torch.where(seq_len > original_max, self._long_inv_freq.to(device), self.original_inv_freq.to(device))
        self.inv_freq.copy_(inv_freq)

    def _cos_sin(self, positions: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(device=device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device, self.inv_freq.dtype, self.inv_freq.data_ptr())
        if self._table is None or self._table[0] != key:
            self._table = (key, *self._cos_sin(torch.arange(self._table_positions, device=device), device))
        return self._table[1], self._table[2]

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rope_type == "dynamic":
            self._dynamic_update(position_ids, x.device)
        elif self.rope_type == "longrope":
            self._longrope_update(position_ids, x.device)
        # The table is a CPU path: off the CPU its bounds check would wait on the device (int(max)) at every forward
        # and it would hold 2 * positions * head_dim floats for the model's life (8 MiB for TinyLlama's layout, seen
        # on an H200), so cos/sin are computed there as official computes them. Compiled graphs fuse that
        # computation too; a Python-held table would only add guards.
        if (self._table_positions and x.device.type == "cpu" and not torch.compiler.is_compiling()
                and int(position_ids.max()) < self._table_positions):
            cos_table, sin_table = self._tables(x.device)
            cos, sin = cos_table[position_ids], sin_table[position_ids]
        else:
            cos, sin = self._cos_sin(position_ids, x.device)
        if self.float32:
            return cos, sin
        if self.rounded_float32:
            return cos.to(dtype=x.dtype).float(), sin.to(dtype=x.dtype).float()
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

    def extra_repr(self) -> str:
        rounding = ", float32" if self.float32 else ", rounded_float32" if self.rounded_float32 else ""
        return f"rope_type={self.rope_type!r}, head_dim={self.head_dim}, theta={self.rope_parameters['rope_theta']}{rounding}"


class QueryTemperature(NamedTuple):
    """Llama 4's attention temperature on its NoPE layers (Nakanishi 2025, "Scalable-Softmax Is Superior for
    Attention"): the query of the token at cache index t is multiplied by
    1 + attn_scale * log(1 + floor((t + 1) / floor_scale)), which sharpens attention as the context grows."""

    scales: torch.Tensor  # [1 | B, 1, S, 1] float32, broadcast over heads and head dimensions

    def apply(self, query: torch.Tensor) -> torch.Tensor:
        return (query * self.scales).to(query.dtype)


def query_temperature(token_indices: torch.Tensor, floor_scale: float, attn_scale: float) -> QueryTemperature:
    """token_indices [1 | B, S]: each new token's index in its row of the cache (transformers' Llama 4 counts
    the cached tokens plus 0 .. S - 1, left padding included)."""
    scales = torch.log1p(torch.floor((token_indices.float() + 1.0) / floor_scale)) * attn_scale + 1.0
    return QueryTemperature(scales[:, None, :, None])


# ---- attention ---------------------------------------------------------------------------------------------------


def interface_inputs(module, implementation: str, attention_mask, query: torch.Tensor, key: torch.Tensor,
                     attention_kwargs: dict):
    """(mask, is_causal, visible rows or None) from a masks.AttentionMask (or None) for the attention function
    `implementation`: ours take it as it is (its declared layout into attention_kwargs, for the flash kernels),
    transformers' take their own forms (engines.foreign_mask)."""
    mask, is_causal, layout, hidden_rows = attention_mask if attention_mask is not None else (None, False, None, None)
    if implementation in HF_TINY_BACKEND_NAMES:
        if layout is not None:
            attention_kwargs["layout"] = layout
        if hidden_rows is not None:
            attention_kwargs["hidden_rows"] = hidden_rows
        return mask, is_causal, None
    return foreign_mask(module, implementation, mask, is_causal, query, key.shape[2])


# Where an Attention module applies its q/k norm (see Attention.__init__).
QK_NORM_PLACES = ("head", "projection", "rotated")


class Attention(nn.Module):
    """Multi-head attention with grouped key/value heads: encoder self-attention, causal self-attention and
    cross-attention. Owns the projections, the per-head q/k norms, RoPE and the cache update; the math
    softmax(q kᵀ · scale + mask) v is the attention function `config._attn_implementation` names (attention.py),
    called the way transformers' attention modules call it, with the attributes those functions read (config,
    layer_idx, num_key_value_groups, is_causal, scaling, head_dim).

    q, k and v are projected side by side and the function is looked up and called once: the shape vLLM's
    Transformers backend reads from this source to fuse q/k/v and to put its paged attention behind the call.
    """

    def __init__(self, config, layer_idx: int, *, hidden_size: int, num_heads: int, num_key_value_heads: int,
                 head_dim: int, bias: bool, output_bias: bool, scaling: float, dropout: float = 0.0,
                 is_causal: bool = False, is_cross_attention: bool = False, qk_norm: Optional[dict] = None,
                 qk_norm_at: str = "head", sinks: bool = False):
        """qk_norm: the keyword arguments of the RMSNorm of queries and keys, or None. qk_norm_at: where it acts,
        one of QK_NORM_PLACES: "head" (each head, before RoPE: Qwen3, Gemma 3), "projection" (the whole q / k
        projection before the heads split: OLMo 2), "rotated" (each head after RoPE: Llama 4). sinks: a learned
        logit per head in the softmax denominator (GPT-OSS's `sinks`), passed to the attention function as
        transformers' `s_aux`."""
        super().__init__()
        if qk_norm_at not in QK_NORM_PLACES:
            raise ValueError(f"qk_norm_at={qk_norm_at!r}; choose one of {list(QK_NORM_PLACES)}")
        self.config = config  # read for config._attn_implementation, at every call
        self.layer_idx = layer_idx
        self.num_heads, self.num_key_value_heads, self.head_dim = num_heads, num_key_value_heads, head_dim
        self.num_key_value_groups = num_heads // num_key_value_heads
        self.is_causal = is_causal and not is_cross_attention
        self.is_cross_attention = is_cross_attention
        self.scaling = scaling
        self.dropout = dropout
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_key_value_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_key_value_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=output_bias)
        self.qk_norm_at = qk_norm_at
        whole = qk_norm_at == "projection"
        self.q_norm = RMSNorm(num_heads * head_dim if whole else head_dim, **qk_norm) if qk_norm else None
        self.k_norm = RMSNorm(num_key_value_heads * head_dim if whole else head_dim, **qk_norm) if qk_norm else None
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None

    def _heads(self, states: torch.Tensor, norm: Optional[nn.Module] = None) -> torch.Tensor:
        """[B, S, H * D] -> [B, H, S, D], with the q/k norm where it acts before RoPE: over the whole projection
        or over each head."""
        if norm is not None and self.qk_norm_at == "projection":
            states = norm(states)
        states = torch.unflatten(states, -1, (-1, self.head_dim))  # one call, so vLLM's fx trace passes through it
        if norm is not None and self.qk_norm_at == "head":
            states = norm(states)
        return states.transpose(1, 2)

    def _positioned(self, query: torch.Tensor, key: torch.Tensor, position_embeddings):
        """Positions: RoPE's rotation by (cos, sin), or on Llama 4's NoPE layers its query temperature; then the
        q/k norm of rotated heads (Llama 4)."""
        if isinstance(position_embeddings, QueryTemperature):
            query = position_embeddings.apply(query)
        elif position_embeddings is not None:
            query, key = apply_rotary(query, key, *position_embeddings)
        if self.q_norm is not None and self.qk_norm_at == "rotated":
            query, key = self.q_norm(query), self.k_norm(key)
        return query, key

    def _cross_attention_qkv(self, hidden_states, key_value_states: Optional[torch.Tensor], cache):
        """Queries of the decoder states; keys and values of the encoder states: projected at the first decoding
        step, then read from the cache (the encoder states do not change while decoding)."""
        query = self._heads(self.q_proj(hidden_states), self.q_norm)
        if key_value_states is None:
            raise ValueError(f"cross-attention layer {self.layer_idx} needs encoder hidden states (key_value_states)")
        cross_cache = cache.cross_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
        if isinstance(cache, EncoderDecoderCache) and cache.is_updated.get(self.layer_idx):
            layer = cross_cache.layers[self.layer_idx]
            return query, layer.keys, layer.values
        key = self._heads(self.k_proj(key_value_states), self.k_norm)
        value = self._heads(self.v_proj(key_value_states))
        if cross_cache is not None:
            key, value = cross_cache.update(key, value, self.layer_idx)
            if isinstance(cache, EncoderDecoderCache):
                cache.is_updated[self.layer_idx] = True
        return query, key, value

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_embeddings=None, *, cache=None,
                key_value_states: Optional[torch.Tensor] = None, output_attentions: bool = False, **attention_kwargs):
        """attention_mask: a masks.AttentionMask; position_embeddings: (cos, sin), a QueryTemperature or None;
        cache: a transformers Cache or continuous batching's paged cache (cross-attention: an EncoderDecoderCache or
        its cross-attention cache); attention_kwargs travel to the attention function."""
        batch, length = hidden_states.shape[:2]
        if self.is_cross_attention:
            query, key, value = self._cross_attention_qkv(hidden_states, key_value_states, cache)
        else:
            # one call each, three plain statements on one input: the pattern vLLM's Transformers backend
            # rewrites into one fused q/k/v product
            query_states = self.q_proj(hidden_states)
            key_states = self.k_proj(hidden_states)
            value_states = self.v_proj(hidden_states)
            query, key, value = self._heads(query_states, self.q_norm), self._heads(key_states, self.k_norm), self._heads(value_states)
            query, key = self._positioned(query, key, position_embeddings)
            if isinstance(cache, Cache):
                key, value = cache.update(key, value, self.layer_idx)
            elif cache is not None:
                key, value = paged_cache_update(cache, key, value, self.layer_idx, attention_kwargs)

        implementation = self.config._attn_implementation
        mask, is_causal, visible = interface_inputs(self, implementation, attention_mask, query, key, attention_kwargs)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, None)
        if self.sinks is not None:
            check_takes_sinks(implementation, attention_interface)
        # scaling and s_aux written as attributes of self: vLLM's backend reads both from this call's source
        out, weights = attention_interface(
            self, query, key, value, mask, scaling=self.scaling, s_aux=self.sinks,
            dropout=self.dropout if self.training else 0.0, is_causal=is_causal, output_attentions=output_attentions,
            **attention_kwargs,
        )
        if visible is not None:  # query rows that see no key (padding) give zeros, as in our own backends
            out = out.masked_fill(~visible[:, 0, :, 0, None, None], 0.0)
        return self.o_proj(out.reshape(batch, length, -1)), weights  # the function returns [B, S, H, D]
