"""Multi-head Latent Attention (DeepSeek-V2 / V3): keys and values are compressed into one small latent vector
per token, and that latent (plus one shared rotary key) is all the KV cache holds.

Per token x, with H heads (DeepSeek-V2 paper, section 2.1, eq. 9-19):
    c_kv = RMSNorm(W_dkv x)                      the latent, kv_lora_rank wide          (kv_a_proj_with_mqa, first part)
    k_rope = RoPE(W_kr x)                        one rotary key shared by all heads      (kv_a_proj_with_mqa, last part)
    k_nope_h, v_h = W_uk_h c_kv, W_uv_h c_kv     per-head keys and values from the latent (kv_b_proj)
    q_h = [q_nope_h, RoPE(q_rope_h)]             from x, or through a low-rank bottleneck
                                                 c_q = RMSNorm(W_dq x), q = W_uq c_q     (q_a_proj, q_b_proj)
    k_h = [k_nope_h, k_rope]
The cache stores c_kv [B, 1, T, kv_lora_rank] as its "keys" and k_rope [B, 1, T, qk_rope_head_dim] as its
"values" (official transformers' layout), i.e. (kv_lora_rank + qk_rope_head_dim) numbers per token and layer
instead of 2 * H * head_dim.

Two ways to attend, same result:
- expanded (default): build k_h and v_h for every cached token, then ordinary attention through the backend.
- absorbed (config.mla_absorb): W_uk is folded into the query, q_lat_h = W_uk_h^T q_nope_h, so that
  q_h . k_h = q_lat_h . c_kv + q_rope_h . k_rope: every head attends to the same single "key" [c_kv, k_rope] and
  "value" c_kv (multi-query attention over the latent), and W_uv is applied after: o_h = W_uv_h (sum_t p_t c_kv_t).
  Decoding then reads only the cache, never expands it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from transformers.cache_utils import Cache

from .attention import ALL_ATTENTION_FUNCTIONS
from .engines import paged_cache_update
from .layers import RMSNorm, apply_rotary, interface_inputs

# DeepSeek's latent norms use this epsilon whatever config.rms_norm_eps says (official DeepseekV3RMSNorm default).
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MlaSpec:
    kv_lora_rank: int
    q_lora_rank: Optional[int]  # None: queries projected directly (q_proj)
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    bias: bool  # on q_a_proj, kv_a_proj_with_mqa and o_proj (DeepSeek's attention_bias)


class LatentAttention(nn.Module):
    """MLA self-attention with DeepSeek's parameter names (q_a_proj, q_a_layernorm, q_b_proj or q_proj;
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj; o_proj), called like layers.Attention."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        mla: MlaSpec = config.mla_spec()
        self.config = config
        self.layer_idx = layer_idx
        self.is_cross_attention = False
        self.is_causal = True
        self.num_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.rank = mla.kv_lora_rank
        self.head_dim = self.nope_dim + self.rope_dim  # of queries and (expanded) keys
        self.scaling = config.attention_scale()
        self.dropout = config.attention_dropout
        hidden, heads = config.hidden_size, self.num_heads
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=mla.bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * self.head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope_dim, bias=mla.bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=mla.bias)

    @property
    def absorbed(self) -> bool:
        return bool(self.config.mla.mla_absorb)

    @property
    def num_key_value_groups(self) -> int:
        """Read by attention functions that repeat K/V: expanded keys are per head, the latent is one."""
        return self.num_heads if self.absorbed else 1

    def _queries(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            states = self.q_proj(hidden_states)
        else:
            states = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        return states.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)  # [B, H, S, D]

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_embeddings=None, *, cache=None,
                key_value_states: Optional[torch.Tensor] = None, output_attentions: bool = False, **attention_kwargs):
        if key_value_states is not None:
            raise ValueError("Multi-head Latent Attention is self-attention only; got key_value_states")
        batch, seq_len = hidden_states.shape[:2]
        q_nope, q_rope = self._queries(hidden_states).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden_states).split([self.rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent).unsqueeze(1)  # [B, 1, S, rank]
        k_rope = k_rope.unsqueeze(1)  # [B, 1, S, rope]
        q_rope, k_rope = apply_rotary(q_rope, k_rope, *position_embeddings)
        paged_cache = None
        if isinstance(cache, Cache):
            latent, k_rope = cache.update(latent, k_rope, self.layer_idx)
        elif cache is not None:  # continuous batching's paged cache stores the expanded keys and values
            paged_cache = cache
        if self.absorbed:
            up = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
            w_uk, w_uv = up.split([self.nope_dim, self.v_dim], dim=1)  # [H, nope, rank], [H, v, rank]
            query = torch.cat((torch.einsum("bhsn,hnr->bhsr", q_nope, w_uk), q_rope), dim=-1)
            key, value = torch.cat((latent, k_rope), dim=-1), latent  # one "head" shared by all query heads
        else:
            k_nope, value = (
                self.kv_b_proj(latent[:, 0]).unflatten(-1, (self.num_heads, -1)).transpose(1, 2)
                .split([self.nope_dim, self.v_dim], dim=-1)
            )
            key = torch.cat((k_nope, k_rope.expand(-1, self.num_heads, -1, -1)), dim=-1)
            query = torch.cat((q_nope, q_rope), dim=-1)
        if paged_cache is not None:
            key, value = paged_cache_update(paged_cache, key, value, self.layer_idx, attention_kwargs)
        implementation = self.config._attn_implementation
        mask, is_causal, visible = interface_inputs(self, implementation, attention_mask, query, key, attention_kwargs)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, None)
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
        if visible is not None:  # query rows that see no key (padding) give zeros, as in our own backends
            out = out.masked_fill(~visible[:, 0, :, 0, None, None], 0.0)  # [B, S, H, rank] or [B, S, H, v_head_dim]
        if self.absorbed:
            out = torch.einsum("bshr,hvr->bshv", out, w_uv)
        return self.o_proj(out.reshape(batch, seq_len, -1)), weights


__all__ = ["LatentAttention", "MlaSpec"]
